"""Issue 50 (round 5), the command lines: an output path checked before minutes of work (klbench-audit
--mismatch), an environment variable's typo and a deleted key refused in one line before any run exists, and a
run whose reader went away (`| head -1`) that keeps training."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from test_sweeps import cli_env

import cli_inprocess


def test_audit_checks_every_output_path_before_the_work(tmp_path, monkeypatch, capsys):
    """Issue 50.4: --mismatch in a missing folder computed for 650 s, then a 17-line FileNotFoundError."""
    from klbench.libraries import cli, mismatch_report

    def never(*a, **k):
        raise AssertionError("the work started before the output path was checked")
    monkeypatch.setattr(mismatch_report, "run", never)
    (tmp_path / "file").write_text("x")
    cases = {("--mismatch", tmp_path / "missing" / "m.md"): f"the folder {tmp_path / 'missing'} does not exist",
             ("--markdown", tmp_path / "file" / "l.md", "--all"): "(it is a file)",
             ("--verdicts", tmp_path): "it is a folder; give a file path"}
    for args, says in cases.items():
        assert cli.main([*map(str, args)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"klbench-audit: error: {args[0]} {args[1]}: ") and says in err
        assert err.rstrip().endswith("nothing was computed"), err


def one_line(tmp_path: Path, *args: str, **env: str) -> str:
    outputs = tmp_path / "outputs"
    proc = cli_inprocess.run(["experiment=tabular", "task.max_steps=2", *args], cwd=tmp_path,
                             env=cli_env(outputs, **env))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (outputs / "runs").exists() or not any((outputs / "runs").rglob("klbench.log"))  # no run folder
    assert not (outputs / "mlflow.db").exists()  # no MLflow run
    return proc.stderr.strip()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan"])
def test_a_bad_progress_seconds_is_refused_before_the_run(tmp_path, value):
    """Issue 50.8: `abc` was a 30-line ValueError 40 s into a FAILED run; 0 and -1 a line every step, silently."""
    line = one_line(tmp_path, KLBENCH_PROGRESS_SECONDS=value)
    assert line == (f"klbench: error: KLBENCH_PROGRESS_SECONDS={value!r}: expected the longest wait in seconds "
                    "between two progress lines, a number > 0 (unset: 60)")


@pytest.mark.parametrize("key, default", [("task.lr", "0.0003"), ("estimator.beta", "0.05")])
def test_deleting_a_key_with_a_default_is_refused_before_the_run(tmp_path, key, default):
    """Issue 50.9: `~task.lr` gave a 43-line KeyError and a FAILED run, `~estimator.beta` 26 lines."""
    line = one_line(tmp_path, f"~{key}")
    if key == "estimator.beta":  # experiment=tabular sets its own beta: the declared default is the option's
        default = line.split("(its default: ")[1].split(")")[0]
    assert line == (f"klbench: error: ~{key}: {key} cannot be deleted, the run reads it (its default: {default}); "
                    f"leave it out of the command line for its default, or give {key}=<value>")


def test_a_closed_pipe_drops_the_stream_and_says_so_once(caplog):
    """Issue 50.10, in this process: writes and flushes after the reader closed its end pass (into /dev/null, at
    the file-descriptor level too), and one warning says so."""
    from klbench.console.pipes import Guarded
    read, write = os.pipe()
    os.close(read)  # the reader went away
    raw = os.fdopen(write, "w", buffering=1)
    stream = Guarded(raw, "stdout")
    with caplog.at_level("WARNING", logger="klbench.console"):
        assert stream.write("first line\n") == len("first line\n")  # raised BrokenPipeError unguarded
        stream.write("more")
        stream.flush()
        os.write(raw.fileno(), b"a C-level write")  # the descriptor is /dev/null now: no EPIPE
    assert stream.lost and [r.getMessage() for r in caplog.records] == [
        "klbench: the reader of stdout went away (a closed pipe, e.g. `| head`); the run goes on, its console "
        "output dropped, logging to klbench.log and MLflow"]
    raw.close()


@pytest.mark.slow
def test_a_run_whose_reader_goes_away_keeps_training(tmp_path):
    """Issue 50.10: `klbench ... | head -1` died at its first print (BrokenPipeError, rc 1) and left a folder of
    Hydra's files. Decided: the run goes on, its console dropped, and finishes in its log and MLflow. A real
    process and pipe: 23 s on the loaded 2-core VM, so slow."""
    outputs = tmp_path / "outputs"
    proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", "experiment=tabular", "task.max_steps=6",
                             "task.val_every=3"], cwd=tmp_path, env=cli_env(outputs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()  # what `head -1` reads, then it exits
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err
    (log,) = outputs.rglob("klbench.log")
    text = log.read_text()
    assert "the reader of stdout went away (a closed pipe, e.g. `| head`); the run goes on" in text
    assert "step 6/6 (100%)" in text and (log.parent / "checkpoints" / "last.ckpt").is_file()
    client = mlflow.MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and "val/reward" in run.data.metrics


@pytest.mark.parametrize("var", ["KLBENCH_PROGRESS_SECONDS", "KLBENCH_STOP_TIMEOUT_S", "KLBENCH_OPTUNA_RETRY_S"])
def test_a_bad_environment_value_stops_a_sweep_before_it_starts(tmp_path, var):
    """Issue 50.8 in a sweep: checked with each trial's config, the typo failed every trial in turn and the sweep's
    parent ended FAILED. Checked before Hydra starts: one line, no sweep folder, no store."""
    outputs = tmp_path / "outputs"
    proc = cli_inprocess.run(["-m", "sweep=rl_beta", "experiment=tabular", "hydra.sweeper.n_trials=1",
                              "task.max_steps=2"], cwd=tmp_path, env=cli_env(outputs, **{var: "abc"}))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith(f"klbench: error: {var}='abc': expected ") and not outputs.exists()
