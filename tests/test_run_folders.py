"""One folder per run, and resumes that continue only the run they belong to (issue 18, findings 1 and 2).

- Runs started in the same second each get a folder of their own (klbench/record/rundir.py), so no two share a
  `mlflow_run_id.txt` or a `last.ckpt` (here by a barrier; 6 real starts at once in
  tests/test_record.py::test_parallel_klbench_runs_on_a_fresh_outputs_folder).
- A checkpoint resumes only into the MLflow run that wrote it.
- Re-running the resume command of a finished run leaves it FINISHED and says so; raising max_steps
  (with ckpt_allow_changes) trains it further.
- `ckpt_path=last` without a checkpoint says to start again, and settles the run it meant to continue.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from klbench.record import rundir, runs
from test_record import TABULAR, all_runs, client_of, env_for, klbench, steps


def _claim_after(barrier, base: str, out) -> None:
    barrier.wait()
    out.put(rundir.claim(base))


def test_claims_made_at_the_same_moment_get_distinct_folders(tmp_path):
    """12 processes released by one barrier claim the same name: each gets a folder no other got."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(12), ctx.Queue()
    base = str(tmp_path / "runs" / "2026-11-24" / "12-00-00-rl-rb")
    procs = [ctx.Process(target=_claim_after, args=(barrier, base, out)) for _ in range(12)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join()
    assert len(set(got)) == 12 and base in got and f"{base}-12" in got
    assert all(Path(g).is_dir() for g in got)


def test_checkpoint_of_another_run_is_refused(tmp_path):
    """Two runs that once shared a folder: seed 0's mlflow_run_id.txt beside seed 1's last.ckpt. Resuming
    as seed 1 used to splice seed 1's training into seed 0's FINISHED run."""
    outputs = tmp_path / "outputs"
    a, b = tmp_path / "a", tmp_path / "b"
    assert klbench(outputs, *TABULAR, "seed=0", f"hydra.run.dir={a}").returncode == 0
    assert klbench(outputs, *TABULAR, "seed=1", "task.max_steps=40", f"hydra.run.dir={b}").returncode == 0
    shutil.copy(b / "checkpoints" / "last.ckpt", a / "checkpoints" / "last.ckpt")  # what sharing left
    client = client_of(outputs)
    seed0 = (a / runs.RUN_ID_FILE).read_text()
    before = steps(client, seed0, "train/kl_mc")
    proc = klbench(outputs, *TABULAR, "seed=1", "task.max_steps=40", f"hydra.run.dir={a}", "ckpt_path=last")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"belongs to MLflow run {seed0}" in proc.stderr and "Traceback" not in proc.stderr
    r = client.get_run(seed0)
    assert r.info.status == "FINISHED" and steps(client, seed0, "train/kl_mc") == before
    assert r.data.tags[runs.STEPS_DONE] == "20"


def test_resuming_a_finished_run_leaves_it_finished(tmp_path):
    """`klbench ... hydra.run.dir=D` and then the same with ckpt_path=last: exit 0, the run stays FINISHED
    with its record untouched. max_steps=25 is not a multiple of val_every=10: the final validation's
    checkpoint is what marks the run finished."""
    outputs = tmp_path / "outputs"
    args = [*TABULAR, "task.max_steps=25", f"hydra.run.dir={tmp_path / 'D'}"]
    first = klbench(outputs, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    client = client_of(outputs)
    (r,) = all_runs(client)
    history = {k: steps(client, r.info.run_id, k) for k in ("train/kl_mc", "val/reward")}
    again = klbench(outputs, *args, "ckpt_path=last")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "this run already finished" in again.stdout
    (r2,) = all_runs(client)
    assert r2.info.status == "FINISHED" and r2.info.end_time == r.info.end_time
    assert {k: steps(client, r.info.run_id, k) for k in history} == history
    # trained further on purpose: the same run, no step twice
    longer = klbench(outputs, *args[:-2], "task.max_steps=40", args[-1], "ckpt_path=last",
                     "ckpt_allow_changes=[task.max_steps]")
    assert longer.returncode == 0, longer.stderr[-2000:]
    (r3,) = all_runs(client)
    assert r3.info.status == "FINISHED" and r3.data.tags[runs.STEPS_DONE] == "40"
    assert steps(client, r.info.run_id, "train/kl_mc") == list(range(40))
    assert steps(client, r.info.run_id, "val/reward") == [0, 10, 20, 25, 30, 40]


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path):
    """A run killed before its first checkpoint: `ckpt_path=last` says to start again without it, in one
    line, and marks the dead run KILLED at once (it used to stay RUNNING until the next fresh start)."""
    outputs = tmp_path / "outputs"
    args = ["experiment=tabular", "task.max_steps=100000", "task.val_every=100000", f"hydra.run.dir={tmp_path / 'D'}"]
    proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", *args], cwd=tmp_path, env=env_for(outputs),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    id_file = tmp_path / "D" / runs.RUN_ID_FILE
    deadline = time.time() + 120
    while not id_file.is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(1.0)  # let it train a little
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_id = id_file.read_text().strip()
    client = client_of(outputs)
    assert client.get_run(run_id).info.status == "RUNNING"
    resumed = klbench(outputs, *args, "ckpt_path=last")
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert "start it again without ckpt_path" in resumed.stderr, resumed.stderr[-2000:]
    r = client.get_run(run_id)
    assert r.info.status == "KILLED" and "resume refused" in r.data.tags[runs.ENDED]


def test_a_refused_resume_leaves_the_runs_hydra_files(tmp_path):
    """Hydra saves the config into <run folder>/.hydra at every start: a resume refused for another config used
    to overwrite the files that describe the run. Each later start now saves into .hydra/attempt-<time>."""
    outputs, run = tmp_path / "outputs", tmp_path / "run"
    assert klbench(outputs, *TABULAR, "seed=0", f"hydra.run.dir={run}").returncode == 0
    saved = {p.name: p.read_text() for p in (run / ".hydra").glob("*.yaml")}
    assert set(saved) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    for seed in (1, 0):  # refused (another seed), then accepted (the finished run: left as it is)
        proc = klbench(outputs, *TABULAR, f"seed={seed}", f"hydra.run.dir={run}", "ckpt_path=last")
        assert proc.returncode == (1 if seed else 0), proc.stderr[-2000:]
    assert {p.name: p.read_text() for p in (run / ".hydra").glob("*.yaml")} == saved
    attempts = sorted((run / ".hydra").glob("attempt-*"))
    assert len(attempts) == 2  # one folder each, even within one second
    assert ["seed=1" in (a / "overrides.yaml").read_text() for a in attempts] == [True, False]
    assert all("ckpt_path=last" in (a / "overrides.yaml").read_text() for a in attempts)
