"""What a newcomer meets on the console (docs/console.md): each Lightning message once, no library notices
at default verbosity (KLBENCH_VERBOSE=1 brings them back), a run's last lines say where it is, `--help`
lists the sweeps, the progress bar counts the run's steps, and a tabular run without MLflow imports neither
transformers nor MLflow.

The sweep's end (labelled Pareto trials, pareto.png/csv in its folder) is checked in tests/test_sweeps.py.
"""
from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cli_inprocess
from test_sweeps import cli_env

from klbench.console import messages as console

ROOT = Path(__file__).resolve().parent.parent
TINY = ["experiment=tabular", "task.max_steps=4", "task.val_every=2"]
# the real CLI, reporting at exit which heavy packages the run imported
REPORT_MODULES = """
import atexit, sys
atexit.register(lambda: print("MODULES", sorted(m for m in ("transformers", "mlflow", "scipy", "matplotlib")
                                                 if m in sys.modules)))
from klbench.cli import main
main()
"""


def klbench(outputs: Path, *overrides: str, env: dict | None = None, process: bool = False) -> subprocess.CompletedProcess:
    """The CLI in this process (tests/cli_inprocess.py), or with `process` a real one that says what it imported."""
    if not process:
        proc = cli_inprocess.run(overrides, cwd=outputs.parent, env=cli_env(outputs, **(env or {})))
    else:
        proc = subprocess.run([sys.executable, "-c", REPORT_MODULES, *overrides], cwd=outputs.parent,
                              env=cli_env(outputs, **(env or {})), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def where(stdout: str) -> dict[str, str]:
    """The run's last lines, `klbench: <label>  <value>`, by label."""
    return {m[1].strip(): m[2] for m in re.finditer(r"^klbench: (run folder|MLflow run|to see it)\s+(.*)$",
                                                    stdout, re.M)}


def test_tabular_run_without_mlflow_is_quiet_and_lean(tmp_path):
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, *TINY, "logger=none", process=True)
    out = proc.stdout + proc.stderr
    assert out.count("Seed set to 0") == 1, out  # Lightning's own handler and Hydra's both printed it
    for notice in ("litlogger", "GPU available", "TPU available", "LeafSpec", "`srun` command", "`Trainer.fit` stopped"):
        assert notice not in out, notice
    assert "MODULES []" in proc.stdout  # no transformers, MLflow, scipy or matplotlib (klbench/tasks/lean.py)
    run_dir = Path(where(proc.stdout)["run folder"])
    assert run_dir.is_dir() and (run_dir / "klbench.log").is_file() and outputs in run_dir.parents
    assert "Seed set to 0" in (run_dir / "klbench.log").read_text()


def test_run_ends_with_where_its_record_is(tmp_path):
    outputs = tmp_path / "outputs"
    proc = klbench(outputs, *TINY)
    lines = where(proc.stdout)
    run_dir = Path(lines["run folder"])
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    assert lines["MLflow run"].startswith(run_id) and "in experiment 'klbench'" in lines["MLflow run"]
    # `--port N` where another program holds MLflow's default port 5000 (test_mlflow_ui_command_takes_a_free_port...)
    ui = re.fullmatch(rf"mlflow ui --backend-store-uri {re.escape(f'sqlite:///{outputs.resolve()}/mlflow.db')}"
                      r"( --port (\d+))?",
                      lines["to see it"])
    assert ui, lines["to see it"]
    assert f"http://127.0.0.1:{ui[2] or 5000}/#/experiments/1/runs/{run_id}" in proc.stdout
    assert f"#/experiments/1/runs/{run_id}" in proc.stdout
    last = [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("MODULES")][-1]
    assert f"/runs/{run_id}" in last  # they are the run's last lines


def test_where_lines_paste_into_a_shell_with_spaces_in_the_outputs_path(tmp_path):
    """The printed `mlflow ui` command, split by bash as a paste would be, names the run's store."""
    from mlflow.tracking import MlflowClient
    outputs = tmp_path / "my runs" / "out dir"
    outputs.mkdir(parents=True)
    lines = where(klbench(outputs, *TINY).stdout)
    assert Path(lines["run folder"]).is_dir() and outputs in Path(lines["run folder"]).parents
    argv = subprocess.run(["bash", "-c", lines["to see it"].replace("mlflow ui", "printf '%s\\n'", 1)],
                          capture_output=True, text=True, check=True).stdout.splitlines()
    assert argv[:2] == ["--backend-store-uri", f"sqlite:///{outputs.resolve()}/mlflow.db"], lines["to see it"]
    run_id = lines["MLflow run"].split()[0]
    assert MlflowClient(tracking_uri=argv[1]).get_run(run_id).info.status == "FINISHED"


def _read_back(override: str) -> object:
    """The value a `key=value` on the command line becomes: Hydra's override parser, then OmegaConf."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    return OmegaConf.create({"v": OverridesParser.create().parse_override(override).value()}).v


@pytest.mark.parametrize("value", ["/runs/2026-11-25/01-02-03-rl-rb", "/home/josé/runs/a", "/tmp/my runs/x",
                                   "/tmp/a\\", "/tmp/a\\\\", '/tmp/a\\"b', '/tmp/"q"', "/tmp/a${x}", "/tmp/a\\${x}",
                                   "/tmp/a'b", "/tmp/a=b,c", "relative/dir", "123", "true", "null"])
def test_resume_override_reads_back_as_the_run_folder(value):
    """The resume command's hydra.run.dir=... reads back as the folder, whatever its characters: before, a
    non-ASCII name was left unquoted (a parse error), a trailing backslash escaped the closing quote, and ${
    became an interpolation."""
    from klbench.cli import hydra_override
    assert _read_back(hydra_override("hydra.run.dir", value)) == value


def test_resume_override_reads_back_for_every_short_string():
    """Every string of up to 3 characters over the characters Hydra or OmegaConf give a meaning to (longer runs
    of backslashes before a quote or ${ are in the cases above)."""
    import itertools
    from klbench.cli import hydra_override
    alphabet = ["a", "\\", '"', "$", "{", "}", "'", " ", "é", "/"]
    for n in range(1, 4):
        for chars in itertools.product(alphabet, repeat=n):
            value = "".join(chars)
            assert _read_back(hydra_override("k", value)) == value, value


VERBOSITY = """
import logging, sys, warnings
logging.basicConfig(stream=sys.stdout, format="%(name)s: %(message)s", level=logging.INFO)
from klbench.console import messages as console
console.setup()
logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
logging.getLogger("lightning.pytorch.utilities.rank_zero").info("a message klbench keeps")
logging.getLogger("transformers.modeling_utils").warning("`loss_type=None` was set in the config but ...")
logging.getLogger("optuna.storages._rdb.storage").info("A new study created in RDB with name: s")
for line in ("Study name: s", "Storage: sqlite:////o/optuna.db", "Sampler: TPESampler", "Directions: ['maximize']"):
    logging.getLogger("hydra_plugins.hydra_optuna_sweeper._impl").info(line)
warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
warnings.warn("a warning klbench keeps", FutureWarning)
"""


def test_notices_are_silenced_by_message_and_come_back_with_klbench_verbose():
    def run(verbose: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "KLBENCH_VERBOSE": verbose}
        proc = subprocess.run([sys.executable, "-c", VERBOSITY], env=env, capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr

    quiet, loud = run(""), run("1")
    for kept in ("a message klbench keeps", "a warning klbench keeps"):
        assert kept in quiet and kept in loud
    for silenced in ("GPU available", "loss_type=None", "LeafSpec", "A new study created", "Study name:",
                     "Storage:", "Sampler:", "Directions:"):
        assert silenced not in quiet and silenced in loud


def test_help_names_klbench_and_lists_the_sweeps():
    proc = cli_inprocess.run(["--help"], cwd=ROOT, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("klbench") and "cli is powered" not in proc.stdout
    sweeps = sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml"))
    assert f"sweep: {', '.join(sweeps)}" in proc.stdout


def test_mlflow_ui_lines():
    assert console.mlflow_ui_lines("sqlite:////o/mlflow.db", "3", "abc") == [
        "mlflow ui --backend-store-uri sqlite:////o/mlflow.db",
        "then open http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"]
    assert console.mlflow_ui_lines("sqlite:////my runs/it's/mlflow.db", "3", None)[0] == \
        "mlflow ui --backend-store-uri 'sqlite:////my runs/it'\"'\"'s/mlflow.db'"
    assert console.mlflow_ui_lines("http://mlflow-host:5000/", "3", None) == [
        "open http://mlflow-host:5000/#/experiments/3/runs?workflowType=machine_learning"]
    assert console.display_uri("postgresql://klbench:secret@db/klbench") == "postgresql://klbench:***@db/klbench"


def test_progress_bar_counts_steps_of_the_run_with_reward_and_kl(capsys):
    from types import SimpleNamespace

    from klbench.console.progress import StepProgressBar
    trainer = SimpleNamespace(max_steps=300, global_step=100, callback_metrics={}, progress_bar_metrics={})
    module = SimpleNamespace(last_logged={})
    bar = StepProgressBar()
    bar.on_train_start(trainer, module)  # a run resumed at step 100
    assert (bar.bar.n, bar.bar.total) == (100, 300)
    trainer.global_step = 105
    module.last_logged.update({"train/reward": 1.234, "train/kl_rb": 0.5, "train/kl_mc": 9.0, "train/beta": 0.1})
    trainer.callback_metrics = {"val/reward": 1.1, "val/seq_kl": 0.45}
    bar.on_train_batch_end(trainer, module, None, None, 0)
    assert bar.bar.n == 105
    assert bar.bar.postfix == "reward 1.23, KL 0.5, val reward 1.1, val KL 0.45"
    bar.on_train_end(trainer, module)
    assert "step 105/300" in capsys.readouterr().err


def test_step_lines_show_progress_where_there_is_no_terminal(capsys):
    """The embedded pretraining's stand-in for the bar in a log or a pipe: a line per tenth of the steps."""
    from types import SimpleNamespace

    from klbench.console.progress import StepLines
    trainer = SimpleNamespace(max_steps=20, global_step=0, callback_metrics={}, progress_bar_metrics={"loss": 3.0})
    lines = StepLines("pretraining the embedded reference LM")
    lines.on_train_start(trainer, None)
    for step in range(1, 21):
        trainer.global_step = step
        lines.on_train_batch_end(trainer, None, None, None, step - 1)
    lines.on_train_end(trainer, None)
    err = capsys.readouterr().err.splitlines()
    assert [re.search(r"step (\d+)/20", e)[1] for e in err] == [str(s) for s in range(2, 21, 2)], err
    assert re.fullmatch(r"klbench: pretraining the embedded reference LM: step 4/20 \(20%\), loss 3, "
                        r"\d+ s so far, about \d+ s left", err[1]), err[1]
    assert err[-1].startswith("klbench: pretraining the embedded reference LM: step 20/20 (100%)")
    assert "left" not in err[-1]


def test_summary_says_which_metrics_are_exact_and_times_training_apart_from_the_build(capsys):
    from klbench.tasks.train import _print_summary
    after = {"val/reward": 1.1, "val/reward_sampled": 0.9, "val/token_kl": 0.5}
    _print_summary({"val/reward": 0.0}, after, 120, 12.4, 208.0, {"val/reward"})
    out = capsys.readouterr().out
    assert "klbench: 120 steps in 12 s (before them, building the models and data took 208 s)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("val/")}
    assert rows["val/reward"].endswith("exact") and rows["val/reward_sampled"].endswith("from the samples")
    assert rows["val/token_kl"].endswith("0.5000")  # neither: sampled, and nothing exact to compare with
    assert out.rstrip().splitlines()[-1].startswith("exact: over every response")
    _print_summary(None, {"val/reward": 1.0}, 5000, 11.0, 0.0, set(), resumed_at=1050)  # a resumed run
    assert "klbench: steps 1050 -> 5000 (3950) in 11 s" in capsys.readouterr().out
    _print_summary(None, {"val/reward": 1.0}, 3, 1.0, 0.0, set())  # no exact metric (an LM): no legend
    assert "exact" not in capsys.readouterr().out


def test_a_sweep_trial_leaves_how_to_see_it_to_the_sweep(capsys):
    """A trial prints its folder and MLflow run; the `mlflow ui` lines come once, for the sweep's parent."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    info = SimpleNamespace(run_id="c" * 32, run_name="b=0.1 rb s0 rl-tabular", experiment_id="1")
    logger = SimpleNamespace(client=SimpleNamespace(get_run=lambda rid: SimpleNamespace(info=info)),
                             run_id=info.run_id, name="sweep-rl_beta-tabular")
    for parent, shown in ((None, True), ("p" * 32, False)):
        cfg = OmegaConf.create({"paths": {"ckpt_dir": "/o/runs/x/checkpoints"},
                                "logger": {"tracking_uri": "sqlite:////o/mlflow.db", "parent_run_id": parent}})
        console.print_run_where(cfg, logger)
        lines = where(capsys.readouterr().out)
        assert lines["MLflow run"].startswith(info.run_id)
        assert ("to see it" in lines) == shown, lines


def test_mlflow_ui_command_takes_a_free_port_beside_another_ui(monkeypatch):
    """A second `mlflow ui` on a port another UI holds fails ("Address already in use"): where the default
    port is taken, the printed command names a free one, and the link goes there."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        monkeypatch.setattr(console, "UI_PORT", held.getsockname()[1])  # a UI holds the default port
        port = console.ui_port()
        assert port is not None and port != console.UI_PORT
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free
        cmd, link = console.mlflow_ui_lines("sqlite:////o/mlflow.db", "1", "abc", port)
        assert cmd.endswith(f" --port {port}") and link.startswith(f"then open http://127.0.0.1:{port}/#/")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setattr(console, "UI_PORT", s.getsockname()[1])
    assert console.ui_port() is None  # the default port is free: the plain command


def test_frontier_table_puts_each_header_over_its_column():
    from klbench.analysis.frontier import format_table
    summary = {"counts": {"mc": (11, 6), "rb": (12, 8)}, "share": {"mc": 6 / 14, "rb": 8 / 14}, "n_points": 23,
               "n_frontier": 14, "ref_point": (-1.0, 20.0), "hypervolume": 29.75, "n_outside_ref": 0,
               "share_ci": {"mc": (0.2, 0.6), "rb": (0.4, 0.8)}}
    header, *rows = format_table(summary).splitlines()[:4]
    for title in ("points", "frontier points", "share of frontier"):
        end = header.index(title) + len(title)  # each number ends under the end of its header
        assert all(row[end - 1] != " " and (end == len(row) or row[end] == " ") for row in rows), (title, rows)
    assert "  points  frontier points  share of frontier  95% CI" in header


def test_pareto_names_the_store_it_searched(tmp_path, monkeypatch, capsys):
    """`klbench-pareto --parent <id>` for a run another store holds: the error says which store was
    searched and how its address was chosen."""
    from klbench.analysis import pareto
    from klbench.record import store
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(tmp_path))
    store.open_store(store.tracking_uri(), create=True)
    assert pareto.main(["--parent", "0123456789abcdef0123456789abcdef"]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and f"searched sqlite:///{tmp_path}/mlflow.db, from $KLBENCH_OUTPUTS" in err, err


def test_klbench_log_on_a_full_disk_stops_with_one_line(tmp_path, monkeypatch):
    """klbench.log whose disk is full (here /dev/full: every write fails with ENOSPC): prints and log records
    still reach the console, one line says the file stopped, and no print raises nor logging's traceback
    appears (issue 18: the disk filling during a run ends in klbench's one line)."""
    from klbench.console import logfile
    log = tmp_path / logfile.LOG_NAME
    log.symlink_to("/dev/full")
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    root = logging.getLogger()
    handlers = [logging.StreamHandler(out), logging.FileHandler(log)]
    monkeypatch.setattr(root, "handlers", handlers)
    monkeypatch.setattr(root, "level", logging.INFO)
    assert logfile.copy_console()
    try:
        print("before the record")
        logging.getLogger("klbench.test").warning("a record")
        print("after the record")
        print("to stderr", file=sys.stderr)
    finally:
        logfile.stop_copy()
    assert out.getvalue().splitlines() == ["before the record", "a record", "after the record"]
    lines = err.getvalue().splitlines()
    assert lines == [f"klbench: warning: {log} is no longer written (No space left on device); "
                     "the console still shows everything", "to stderr"], lines
    assert handlers[1].level > logging.CRITICAL and handlers[1].stream is None


# main() in a process that goes on afterwards: the collector's state once it returns or exits
AFTER_MAIN = """
import gc, sys
from klbench.cli import main
try:
    main()
except SystemExit as e:
    print("EXIT", e.code)
print("GC", gc.isenabled(), gc.get_freeze_count() > 0)
"""


@pytest.mark.parametrize("overrides,exit_line", [(["logger=none"], None),
                                                (["task.lr=-1"], "EXIT klbench: error: task.lr must be")],
                         ids=["run", "refused"])
def test_one_job_freezes_the_import_time_objects_and_gives_the_collector_back(tmp_path, overrides, exit_line):
    """A single job (klbench.cli.main) keeps Python's cyclic collector off while torch and Lightning import,
    then freezes their objects out of it; whatever way the job ends, the collector is on again after."""
    outputs = tmp_path / "outputs"
    proc = subprocess.run([sys.executable, "-c", AFTER_MAIN, *TINY, *overrides], cwd=tmp_path,
                          env=cli_env(outputs), capture_output=True, text=True, timeout=300)
    assert "GC True True" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("EXIT" not in proc.stdout) if exit_line is None else (exit_line in proc.stdout)
