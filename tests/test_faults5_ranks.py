"""Issue 50 (round 5), multi-rank runs: a resume on another number of ranks refused before the record reopens
(item 6), and SIGTERM to a hardware=fsdp launcher that ends every try KILLED with 143, never hung (item 5)."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import mlflow
import pytest
import torch
from ranks_cli import rank_args, rank_env
from test_sweeps import cli_env

import cli_inprocess


def test_a_resume_on_another_number_of_ranks_leaves_a_finished_run_finished(tmp_path):
    """Issue 50.6: the refusal ran inside fit, after the record reopened, and the FINISHED run became FAILED. The
    checkpoint of a finished run is given the RNG streams of two ranks, as a 2-rank run saves them; the resume on
    one rank is refused in one line and the run stays FINISHED."""
    outputs, run = tmp_path / "outputs", tmp_path / "run"
    args = ["experiment=tabular", "task.max_steps=4", "task.val_every=2", f"hydra.run.dir={run}"]
    first = cli_inprocess.run(args, cwd=tmp_path, env=cli_env(outputs))
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    data = torch.load(ckpt, weights_only=True)
    data["rng_ranks"] = [data["rng"], data["rng"]]
    torch.save(data, ckpt)
    again = cli_inprocess.run([*args, "task.max_steps=8", "ckpt_path=last", "ckpt_allow_changes=[task.max_steps]"],
                              cwd=tmp_path, env=cli_env(outputs))
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"{ckpt} was saved by 2 hardware=ddp ranks and this run has 1" in again.stderr
    client = mlflow.MlflowClient(f"sqlite:///{outputs}/mlflow.db")
    (record,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert record.info.status == "FINISHED"


def test_the_watchdog_marks_and_ends_a_rank_that_does_not_stop(monkeypatch):
    """Issue 50.5, the bound: a rank blocked in a collective after SIGTERM never returns to Python. The watchdog
    marks the run KILLED (what klbench.record.lifecycle registers) and ends the process with 128 + the signal; a
    stop that ends first leaves it nothing to do."""
    from klbench.record import interrupts
    marked, ended = [], []
    monkeypatch.setattr(interrupts, "_on_stuck", [marked.append])
    interrupts.watchdog(signal.SIGTERM, timeout=0.2, end=ended.append).join(5)
    assert marked == [signal.SIGTERM] and ended == [143]
    monkeypatch.setattr(interrupts, "_stop_done", __import__("threading").Event())
    thread = interrupts.watchdog(signal.SIGTERM, timeout=0.5, end=ended.append)
    interrupts.stop_finished()
    thread.join(5)
    assert marked == [signal.SIGTERM] and ended == [143]


TRIES = 4


@pytest.mark.slow
def test_sigterm_to_an_fsdp_launcher_ends_every_try_killed(tmp_path, tiny_arch):
    """Issue 50.5: 2 CPU ranks, SIGTERM to the launcher 0-3 s after the first checkpoint. Of 6 tries, 1 hung both
    ranks in futex_do_wait for over 10 minutes (RUNNING), 1 was SIGKILLed by Lightning's observer before it marked
    the run KILLED (RUNNING). Every try must end 143, KILLED, with the resume line, within the stop timeout."""
    pair = tiny_arch("llama")
    for i in range(TRIES):
        where = tmp_path / str(i)
        where.mkdir()
        args = [a for a in rank_args(where, pair, "fsdp", 4, "task.max_steps=200") if a != "logger=csv"]
        env = {**rank_env(where), "KLBENCH_STOP_TIMEOUT_S": "60"}
        proc = subprocess.Popen(args, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        ckpt = where / "run" / "checkpoints" / "last.ckpt"
        deadline = time.time() + 300
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(i * 3 / max(1, TRIES - 1))  # 0 to 3 s after it
        proc.send_signal(signal.SIGTERM)  # the launcher (rank 0) only, as `kill <pid>` does
        try:
            out, _ = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"try {i}: not ended 180 s after SIGTERM:\n{out[-3000:]}")
        os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None  # no rank left behind
        assert proc.returncode == 143, f"try {i}: rc {proc.returncode}\n{out[-3000:]}"
        assert "stopped by SIGTERM" in out and "ckpt_path=last" in out, out[-3000:]
        client = mlflow.MlflowClient(f"sqlite:///{where}/outputs/mlflow.db")
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert run.info.status == "KILLED", f"try {i}: {run.info.status}\n{out[-3000:]}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
