"""Many processes writing to the shared stores at the same moment lose nothing and duplicate nothing."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.servers

N_PROCS = 8


def _write_at_once(kind: str, url: str) -> list[str]:
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("parallel_writers.py")), kind, url,
                        str(N_PROCS)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_optuna_trials_from_parallel_processes(postgres_url):
    import optuna
    optuna.create_study(study_name="concurrent", storage=postgres_url)
    pids = _write_at_once("optuna", postgres_url)
    trials = optuna.load_study(study_name="concurrent", storage=postgres_url).trials
    assert sorted(t.number for t in trials) == list(range(N_PROCS))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    # one trial per process, none recorded twice
    assert sorted(str(t.user_attrs["pid"]) for t in trials) == sorted(pids) and len(set(pids)) == N_PROCS


def test_mlflow_metrics_from_parallel_processes(mlflow_server):
    from mlflow import MlflowClient
    client = MlflowClient(mlflow_server)
    client.create_experiment("concurrent")
    run_ids = _write_at_once("mlflow", mlflow_server)
    assert len(set(run_ids)) == N_PROCS
    for run_id in run_ids:
        history = client.get_metric_history(run_id, "loss")
        assert sorted(m.step for m in history) == list(range(20)), run_id
        assert client.get_run(run_id).info.status == "FINISHED"
