"""Progress where output is not a terminal (issue 42, item 4): SLURM logs, nohup and CI saw nothing between a
run's start and its end block. Now a line at every tenth of the steps, or every KLBENCH_PROGRESS_SECONDS when a
tenth takes longer, with the step, the rate and the latest reward and KL; a sweep's lines name the trial
(klbench.console.progress.TrainingLines)."""
from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import cli_inprocess
from test_sweeps import cli_env

from klbench.console import progress

# the values carry the step they were logged at, MLflow's (issue 51: a stale "KL 0" read as "not computed"), and
# the line its clock time, as Hydra's lines in the same log have
LINE = re.compile(r"klbench: (?P<who>.+?): step (?P<step>\d+)/(?P<total>\d+) \(\d+%\) "
                  r"at (?P<clock>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d), (?P<rate>[\d.]+) steps/s, "
                  r"reward (?P<reward>[-\d.e]+), KL (?P<kl>[-\d.e]+)( \(step (?P<at>\d+)\))?"
                  r"(, val reward (?P<val_reward>[-\d.e]+), val KL (?P<val_kl>[-\d.e]+) \(step (?P<val_at>\d+)\))?, "
                  r"\d+ s so far(, about \d+ s left)?")


def _drive(lines, steps: int, seconds_per_step: float, monkeypatch) -> list[int]:
    """The steps at which `lines` prints, on a fake clock that advances seconds_per_step per step."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: clock[0])
    trainer = SimpleNamespace(max_steps=steps, global_step=0, callback_metrics={}, progress_bar_metrics={})
    module = SimpleNamespace(last_logged={"train/reward": 0.5, "train/kl_rb": 0.25})
    lines.on_train_start(trainer, module)
    for step in range(1, steps + 1):
        lines.on_train_batch_start(trainer, module, None, step - 1)  # as Lightning calls it: a due line prints
        clock[0] += seconds_per_step
        trainer.global_step = step
        lines.on_train_batch_end(trainer, module, None, None, step - 1)
    lines.on_train_end(trainer, module)
    return trainer


def test_a_line_every_tenth_or_every_n_seconds_whichever_comes_first(monkeypatch, capsys):
    _drive(progress.TrainingLines(seconds=60), 100, 1.0, monkeypatch)  # a tenth (10 s) before 60 s
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"klbench: training: step 0/100 at \S+ \S+, a line every 10 steps or 60 s "
                        r"\(KLBENCH_PROGRESS_SECONDS\)", err[0]), err[0]
    assert [int(LINE.fullmatch(e)["step"]) for e in err[1:]] == list(range(10, 101, 10)), err
    m = LINE.fullmatch(err[1])
    assert (m["rate"], m["reward"], m["kl"]) == ("1", "0.5", "0.25"), err[1]

    _drive(progress.TrainingLines(seconds=25), 100, 10.0, monkeypatch)  # a tenth takes 100 s: every 25 s
    err = capsys.readouterr().err.splitlines()
    steps = [int(LINE.fullmatch(e)["step"]) for e in err[1:]]
    assert steps[:4] == [3, 6, 9, 10] and steps[-1] == 100, steps  # 30 s since the last line, then the tenth
    assert LINE.fullmatch(err[1])["rate"] == "0.1"


def test_the_seconds_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(progress.SECONDS_ENV, "7.5")
    assert progress.TrainingLines().seconds == 7.5


def test_a_terminal_gets_the_bar_and_no_lines(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.lines() == []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert [type(c) for c in progress.lines()] == [progress.TrainingLines]


def _klbench_to_a_file(tmp_path, *args: str) -> str:
    # stdout and stderr to one file, as SLURM and nohup write them (the CLI in this process, tests/cli_inprocess.py)
    proc = cli_inprocess.run(args, cwd=tmp_path, env=cli_env(tmp_path / "outputs"), stderr=subprocess.STDOUT)
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:]
    return text


def test_a_run_with_output_to_a_file_shows_progress_lines(tmp_path):
    # train/ values every 5 steps, a validation every 4, a line every 2: the lines fall between both (issue 51)
    text = _klbench_to_a_file(tmp_path, "experiment=tabular", "task.max_steps=20", "task.log_every=5",
                              "task.val_every=4", "logger=csv")
    assert re.search(r"^klbench: training: step 0/20 at \S+ \S+, a line every 2 steps or 60 s", text, re.M), text
    found = [LINE.fullmatch(line) for line in text.splitlines() if line.startswith("klbench: training: step ")]
    found = [m for m in found if m]
    assert [int(m["step"]) for m in found] == list(range(2, 21, 2)), text[-3000:]
    assert all(m["who"] == "training" and float(m["rate"]) > 0 for m in found)
    assert float(found[-1]["kl"]) > 0  # the latest KL, not the first
    csv = _metrics_csv(tmp_path)
    for m in found:
        step = int(m["step"])
        # train/ values of the last logging step done (steps 0, 5, 10, 15: the step index, MLflow's and the CSV's)
        assert int(m["at"]) == (step - 1) // 5 * 5, m.group(0)
        assert float(m["kl"]) == float(f"{csv[('train/kl_rb', int(m['at']))]:.3g}"), m.group(0)
        # a validation shows in the line of its own step, not one line late
        if step >= 4:
            assert int(m["val_at"]) == step // 4 * 4, m.group(0)
            assert float(m["val_kl"]) == float(f"{csv[('val/seq_kl', int(m['val_at']))]:.3g}"), m.group(0)


def _metrics_csv(tmp_path) -> dict[tuple[str, int], float]:
    """(metric, step) -> value of the one metrics.csv a run under tmp_path wrote."""
    import csv
    (path,) = list((tmp_path / "outputs").rglob("metrics.csv"))
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k != "step" and v not in ("", None):
                    out[(k, int(row["step"]))] = float(v)
    return out


def test_a_sweeps_lines_say_which_trial_runs(tmp_path):
    text = _klbench_to_a_file(tmp_path, "-m", "sweep=rl_beta", "experiment=tabular", "hydra.sweeper.n_trials=2",
                              "task.max_steps=10", "task.val_every=10")
    who = {m["who"] for m in map(LINE.fullmatch, text.splitlines()) if m}
    assert len(who) == 2 and all(re.fullmatch(r"trial [01] \(b=[\d.]+ rb s0 rl-tabular\)", w) for w in who), who
