"""A PostgreSQL outage in the middle of a store=server sweep loses no result and trains no trial twice.

Real parts only: the sweep is the klbench CLI (4 tabular trials, 2 at a time on the local launcher), its
study lives in the `postgres_url` cluster, its runs on the `mlflow_server` fixture, and the outage is
`pg_ctl stop -m fast` while the first batch trains, so that the sweeper's next database call (telling
Optuna the batch's results) meets a stopped server, or, after a quick restart, a stale pooled connection.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from test_sweeps import cli_env

pytestmark = pytest.mark.servers

# STEPS: a trial trains for seconds (after seconds of start-up), long enough to stop the server meanwhile
N_TRIALS, STEPS, OUTAGE_S = 4, 300, 20


def _sweep(tmp_path, postgres_url, mlflow_server, name: str, log: str = "", **env: str) -> subprocess.Popen:
    """The sweep, started; its console goes to tmp_path/<log or name>.log."""
    args = [sys.executable, "-m", "klbench.cli", "-m", "sweep=rl_beta", "experiment=tabular", "estimator=rb",
            f"task.max_steps={STEPS}", f"task.val_every={STEPS // 2}", "store=server", "hydra/launcher=local",
            f"hydra.sweeper.n_trials={N_TRIALS}", "hydra.sweeper.n_jobs=2", f"hydra.sweeper.study_name={name}",
            f"logger.experiment={name}"]
    env = cli_env(tmp_path / "outputs", KLBENCH_MLFLOW_URI=mlflow_server, KLBENCH_OPTUNA_STORAGE=postgres_url,
                  **env)
    with open(tmp_path / f"{log or name}.log", "w") as out:  # a file, not a pipe: nobody reads while it runs
        # own process group: its trial jobs go with it if the test gives up on it
        return subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def _trial_runs(client, name: str) -> list:
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id]) if exp is not None else []
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags]


def _wait_for(client, name: str, status: str, n: int = 2, timeout: float = 300) -> None:
    """Returns once n trial runs of experiment `name` have this status (RUNNING: the first batch trains)."""
    deadline = time.monotonic() + timeout
    while sum(r.info.status == status for r in _trial_runs(client, name)) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"no {n} {status} trial runs of {name} after {timeout} s")
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, log, timeout: float = 600) -> tuple[int | None, str]:
    """(exit status, console) of the sweep; None if it still ran after `timeout` seconds (then killed)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return None, log.read_text()
    return proc.returncode, log.read_text()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _check_record(postgres_url, client, name: str, out: str) -> None:
    """Every trial COMPLETE once, one FINISHED child per trial, no beta trained twice, the parent
    FINISHED without an error tag, and its frontier built from 4 runs."""
    import optuna
    st = optuna.load_study(study_name=name, storage=postgres_url)
    states = sorted(t.state.name for t in st.trials)
    assert states == ["COMPLETE"] * N_TRIALS, (states, out[-4000:])
    parent = st.user_attrs["klbench.mlflow_parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    kids = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(k.info.status for k in kids) == ["FINISHED"] * N_TRIALS, out[-4000:]
    betas = sorted(float(k.data.params["estimator.beta"]) for k in kids)
    assert len(set(betas)) == N_TRIALS and betas == sorted(t.params["estimator.beta"] for t in st.trials)
    run = client.get_run(parent)
    assert run.info.status == "FINISHED" and "klbench.error" not in run.data.tags, run.data.tags
    assert run.data.metrics["pareto/n_points"] == N_TRIALS
    assert f"{N_TRIALS} used" in out


@pytest.mark.slow
def test_sweep_waits_out_a_20s_outage(postgres_url, postgres_ctl, mlflow_server, tmp_path):
    from mlflow import MlflowClient
    client, name = MlflowClient(mlflow_server), "outage-20s"
    proc = _sweep(tmp_path, postgres_url, mlflow_server, name)
    try:
        _wait_for(client, name, "RUNNING")
        postgres_ctl.stop()
        down = time.monotonic()
        # the first batch ends while the server is down: the sweeper's next call (telling Optuna its
        # results) meets the outage
        _wait_for(client, name, "FINISHED")
        time.sleep(max(3.0, OUTAGE_S - (time.monotonic() - down)))
        postgres_ctl.start()
        rc, out = _finish(proc, tmp_path / f"{name}.log")
    finally:
        _kill(proc)
    assert rc == 0, out[-5000:]
    assert "unreachable" in out and "retrying" in out  # it said what it waited for
    _check_record(postgres_url, client, name, out)


@pytest.mark.slow
def test_rerun_after_a_longer_outage_adopts_the_trained_trials(postgres_url, postgres_ctl, mlflow_server,
                                                                tmp_path):
    """The outage outlasts the retry budget (5 s here): the sweep gives up in one line, and its rerun takes
    the trials that trained meanwhile from their MLflow runs instead of training them again."""
    from mlflow import MlflowClient
    client, name = MlflowClient(mlflow_server), "outage-budget"
    proc = _sweep(tmp_path, postgres_url, mlflow_server, name, KLBENCH_OPTUNA_RETRY_S="5")
    try:
        _wait_for(client, name, "RUNNING")
        postgres_ctl.stop()
        rc, out = _finish(proc, tmp_path / f"{name}.log")
    finally:
        _kill(proc)
    postgres_ctl.start()
    assert rc != 0, out[-5000:]
    assert sum("giving up" in line for line in out.splitlines()) == 1, out[-5000:]
    import optuna
    st = optuna.load_study(study_name=name, storage=postgres_url)
    assert sorted(t.state.name for t in st.trials) == ["RUNNING", "RUNNING"]  # trained, not told: not FAIL
    parent = client.get_run(st.user_attrs["klbench.mlflow_parent_run_id"])
    assert parent.info.status == "FAILED" and "klbench.error" in parent.data.tags
    rc, out = _finish(_sweep(tmp_path, postgres_url, mlflow_server, name, log="rerun"), tmp_path / "rerun.log")
    assert rc == 0, out[-5000:]
    assert out.count("taken from its job (MLflow run") == 2, out[-5000:]
    _check_record(postgres_url, client, name, out)


@pytest.mark.slow  # 53 s on the 2-core CI VM (docs/testing.md)
def test_quick_restart_fails_no_trained_trial(postgres_url, postgres_ctl, mlflow_server, tmp_path):
    """A 2 s restart while the first batch trains: the sweeper's pooled connections are stale when it
    tells Optuna the results, and no trained trial may be marked FAIL for that."""
    from mlflow import MlflowClient
    client, name = MlflowClient(mlflow_server), "outage-restart"
    proc = _sweep(tmp_path, postgres_url, mlflow_server, name)
    try:
        _wait_for(client, name, "RUNNING")
        postgres_ctl.stop()
        time.sleep(2)
        postgres_ctl.start()
        rc, out = _finish(proc, tmp_path / f"{name}.log")
    finally:
        _kill(proc)
    assert rc == 0, out[-5000:]
    _check_record(postgres_url, client, name, out)
