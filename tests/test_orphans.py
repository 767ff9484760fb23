"""A restarted sweep takes over the trials its dead predecessor left RUNNING (klbench.sweep.jobs and
klbench.sweep.orphans.settle_orphans): a trial whose job finished keeps that job's result, one whose job raised is
FAIL, and one whose job left nothing is FAIL and queued again. The result files are written as submitit
writes them: a pickled ("success", JobReturn) in `.submitit/<job id>/<job id>_0_result.pkl`.

The SLURM version of this, with a real `kill -9` and real array jobs, is tests/slurm/test_scaleout.py.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from hydra.core.utils import JobReturn, JobStatus
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState

from klbench.sweep import jobs
from klbench.sweep.orphans import settle_orphans
from klbench.sweep.study import RETRY_OF, STUDY_SWEEP_DIR, prepare_study

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
    settle_orphans(study, [done, raised, lost], [folder.parent])
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
    settle_orphans(study, [trial], [folder.parent])
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
    jobs.wait(folder)
    assert proc.poll() is not None and jobs.results(folder.parent) == []
    assert jobs.alive(folder) == []


# ---- the evidence: MLflow first, result files only from this user's own sweep folders ----

class Planted:
    """Unpickling it creates `marker`: a crafted result file can run any command this way."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def plant(sweep_dir, marker) -> Path:
    """A crafted result file where a local job of `sweep_dir` (id: a pid, gone) would leave its result."""
    (sweep_dir / ".submitit" / "4242").mkdir(parents=True)
    path = sweep_dir / ".submitit" / "4242" / "4242_0_result.pkl"
    with open(path, "wb") as f:
        pickle.dump(("success", Planted(marker)), f)
    return path


def sweep_config(outputs):
    from klbench.config.compose import compose
    outputs.mkdir(exist_ok=True)  # as the sweep callback does
    return compose(["sweep=rl_beta", "experiment=tabular"], outputs=outputs, hydra=True)


def dead_study(cfg):
    """The sweep's study as its dead predecessor left it: one trial RUNNING."""
    sw = cfg.hydra.sweeper
    study = optuna.create_study(study_name=sw.study_name, storage=sw.storage, directions=["maximize", "minimize"],
                                load_if_exists=True)
    return study, study.ask({"estimator.beta": BETA})


def warnings_about(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def test_resume_never_reads_the_folder_the_study_names(tmp_path, caplog):
    """Anyone who can write the study database can set its klbench.sweep_dir: the resume must not unpickle
    what that folder holds, and says once that it ignored it."""
    cfg = sweep_config(tmp_path / "outputs")
    study, trial = dead_study(cfg)
    attacker, marker = tmp_path / "attacker", tmp_path / "code-ran"
    plant(attacker, marker)
    study.set_user_attr(STUDY_SWEEP_DIR, str(attacker))
    with caplog.at_level(logging.WARNING):
        prepare_study(cfg)
    assert not marker.exists()
    (line,) = warnings_about(caplog, str(attacker))
    assert "ignored" in line
    assert study.trials[trial.number].state == TrialState.FAIL  # no evidence: it runs again
    assert [t.user_attrs.get(RETRY_OF) for t in study.trials if t.state == TrialState.WAITING] == [trial.number]


def test_resume_reads_the_folder_this_user_recorded(tmp_path, caplog):
    """The usual resume: a new invocation gets a new sweep folder and takes the finished job's result
    from the previous one, which this user's sweep recorded."""
    outputs = tmp_path / "outputs"
    first = sweep_config(outputs)
    prepare_study(first)  # records its folder
    study, trial = dead_study(first)
    write_result(Path(first.hydra.sweep.dir) / ".submitit", "3_0", trial.params["estimator.beta"],
                 JobStatus.COMPLETED, (1.5, 0.25))
    second = sweep_config(outputs)
    assert second.hydra.sweep.dir != first.hydra.sweep.dir
    with caplog.at_level(logging.WARNING):
        prepare_study(second)
    assert study.trials[trial.number].values == [1.5, 0.25]
    assert not warnings_about(caplog, "ignored")


@pytest.mark.parametrize("spoil", ["file writable by its group", "folder writable by all", "file of another user"])
def test_result_file_refused_unless_only_this_user_can_write_it(tmp_path, caplog, spoil):
    sweep, marker = tmp_path / "sweep", tmp_path / "code-ran"
    path = plant(sweep, marker)
    if spoil == "file writable by its group":
        os.chmod(path, 0o664)
    elif spoil == "folder writable by all":
        os.chmod(path.parent.parent, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    with caplog.at_level(logging.WARNING):
        assert jobs.results(sweep) == []
    assert not marker.exists()
    assert len(warnings_about(caplog, "not reading")) == 1


def test_record_of_the_sweep_folder_must_be_this_users(tmp_path):
    outputs, folder = tmp_path / "outputs", tmp_path / "sweep"
    jobs.record_sweep_dir(outputs, "study", "sqlite:///x.db", folder)
    assert jobs.recorded_sweep_dir(outputs, "study", "sqlite:///x.db") == folder.resolve()
    assert jobs.recorded_sweep_dir(outputs, "other study", "sqlite:///x.db") is None
    (record,) = (outputs / jobs.REGISTRY).glob("*.json")
    assert oct(record.stat().st_mode & 0o777) == oct(0o600)
    os.chmod(record, 0o646)
    assert jobs.recorded_sweep_dir(outputs, "study", "sqlite:///x.db") is None


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """(client, experiment id) of a real MLflow store, shared by this module's tests (each its own runs)."""
    from mlflow import MlflowClient
    root = tmp_path_factory.mktemp("mlflow")
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    return client, client.create_experiment("sweep", artifact_location=str(root / "artifacts"))


@pytest.fixture
def mlflow_children(mlflow_store):
    """Child runs of a new sweep parent run, as trials write them; runs() reads them back."""
    from mlflow.entities import Metric, Param
    client, exp = mlflow_store
    parent = client.create_run(exp).info.run_id

    def child(beta: float, status: str, values=(1.5, 0.25), started_s_ago: float = 0.0) -> str:
        tags = {"mlflow.parentRunId": parent, "klbench.steps_done": "60", "klbench.max_steps": "60"}
        start = int((time.time() - started_s_ago) * 1000)
        rid = client.create_run(exp, start_time=start, tags=tags).info.run_id
        client.log_batch(rid, metrics=[Metric("val/reward", values[0], start, 60), Metric("val/seq_kl", values[1], start, 60)],
                         params=[Param("estimator.beta", str(beta)), Param("estimator.name", "rb")])
        client.set_terminated(rid, status)
        return rid

    def runs() -> list:
        from klbench.analysis.mlflow_io import child_runs
        return child_runs(client, parent, noticed_by="a test")
    return child, runs


METRICS = ["val/reward", "val/seq_kl"]


def test_trials_taken_from_their_mlflow_runs_without_unpickling(dead_sweep, mlflow_children, tmp_path):
    study, (done, raised, _), folder = dead_sweep
    child, runs = mlflow_children
    child(done.params["estimator.beta"], "FINISHED", (1.5, 0.25))
    child(raised.params["estimator.beta"], "FAILED")
    marker = tmp_path / "code-ran"
    plant(folder.parent, marker)  # our own folder, but no result file is needed: none is read
    settle_orphans(study, [done, raised], [folder.parent], runs(), METRICS)
    assert not marker.exists()
    assert study.trials[done.number].state == TrialState.COMPLETE and study.trials[done.number].values == [1.5, 0.25]
    assert study.trials[raised.number].state == TrialState.FAIL
    assert not [t for t in study.trials if t.state == TrialState.WAITING]  # a failed trial is not run again


def test_a_run_from_before_the_trial_is_not_its_run(dead_sweep, mlflow_children):
    study, (trial, *_), _ = dead_sweep
    child, runs = mlflow_children
    child(trial.params["estimator.beta"], "FINISHED", started_s_ago=3600)  # an earlier trial of the same params
    settle_orphans(study, [trial], [], runs(), METRICS)
    assert study.trials[trial.number].state == TrialState.FAIL
    assert [t.user_attrs.get(RETRY_OF) for t in study.trials if t.state == TrialState.WAITING] == [trial.number]


def test_resumed_parent_run_drops_how_the_last_invocation_ended(mlflow_store, tmp_path):
    from klbench.sweep.parent import reopen_parent
    from klbench.sweep.study import STUDY_PARENT
    client, exp = mlflow_store
    parent = client.create_run(exp, tags={"klbench.error": "the sweep process ended with an error",
                                          "klbench.sweep.failed_trials": "#1 {}"}).info.run_id
    client.set_terminated(parent, "FAILED")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/optuna.db")
    study.set_user_attr(STUDY_PARENT, parent)
    assert reopen_parent(client, study, exp) == parent
    run = client.get_run(parent)
    assert run.info.status == "RUNNING"
    assert not {"klbench.error", "klbench.sweep.failed_trials"} & set(run.data.tags)
