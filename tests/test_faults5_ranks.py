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
