"""A restarted sweep takes over the trials its dead predecessor left RUNNING (klbench.jobs and
klbench.sweep.study.settle_orphans): a trial whose job finished keeps that job's result, one whose job raised is
FAIL, and one whose job left nothing is FAIL and queued again. The result files are written as submitit
writes them: a pickled ("success", JobReturn) in `.submitit/<job id>/<job id>_0_result.pkl`.

The SLURM version of this, with a real `kill -9` and real array jobs, is tests/slurm/test_scaleout.py.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import time

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from klbench import jobs
from klbench.sweep.study import RETRY_OF, settle_orphans

BETA = FloatDistribution(1e-3, 1.0, log=True)


def write_result(folder, job_id: str, beta: float, status: JobStatus, value) -> None:
    ret = JobReturn(overrides=[f"estimator.beta={beta}", "experiment=tabular"], status=status)
    ret._return_value = value
    (folder / job_id).mkdir(parents=True)
    with open(folder / job_id / f"{job_id}_0_result.pkl", "wb") as f:
        pickle.dump(("success", ret), f)


@pytest.fixture
def dead_sweep(tmp_path):
    """A study with three trials RUNNING, as a killed sweep process leaves them."""
    study = optuna.create_study(directions=["maximize", "minimize"], storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = [study.ask({"estimator.beta": BETA}) for _ in range(3)]
    return study, trials, tmp_path / "sweep" / ".submitit"


def test_finished_failed_and_missing_jobs(dead_sweep):
    study, (done, raised, lost), folder = dead_sweep
    write_result(folder, "12_0", done.params["estimator.beta"], JobStatus.COMPLETED, (1.5, 0.25))
    write_result(folder, "12_1", raised.params["estimator.beta"], JobStatus.FAILED, FloatingPointError("nan"))
    (folder / "12").mkdir()  # the array job's own folder: its submission script, no result
    settle_orphans(study, [done, raised, lost], str(folder.parent))
    by_number = {t.number: t for t in study.trials}
    assert by_number[done.number].state == TrialState.COMPLETE and by_number[done.number].values == [1.5, 0.25]
    assert by_number[raised.number].state == TrialState.FAIL
    assert by_number[lost.number].state == TrialState.FAIL
    (retry,) = [t for t in study.trials if t.state == TrialState.WAITING]  # queued: the next ask runs it
    assert retry.user_attrs[RETRY_OF] == lost.number and retry.system_attrs["fixed_params"] == lost.params
    assert RETRY_OF not in {k for t in (by_number[done.number], by_number[raised.number]) for k in t.user_attrs}


def test_non_finite_result_is_not_taken(dead_sweep):
    study, (trial, *_), folder = dead_sweep
    write_result(folder, "7_0", trial.params["estimator.beta"], JobStatus.COMPLETED, (float("nan"), 0.1))
    settle_orphans(study, [trial], str(folder.parent))
    assert study.trials[trial.number].state == TrialState.FAIL


def test_waits_for_a_local_job_still_running(tmp_path, monkeypatch):
    """A submitit local job is a process on this host, its id its pid: the rerun waits for it to end."""
    monkeypatch.setattr(jobs, "POLL_S", 0.2)
    folder = tmp_path / ".submitit"
    # a process whose command line names submitit, as submitit's local jobs do
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)", "submitit"])
    (folder / str(proc.pid)).mkdir(parents=True)
    deadline = time.monotonic() + 10  # until exec, /proc shows the forking parent's command line
    while not jobs.alive(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert jobs.alive(folder) == [str(proc.pid)]
    assert jobs.wait_and_collect(folder) == [] and proc.poll() is not None
    assert jobs.alive(folder) == []
