"""Many processes writing to the shared stores at the same moment lose nothing and duplicate nothing."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweeps import cli_env

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


def test_sweep_on_server_stores(postgres_url, mlflow_server, tmp_path):
    """A real sweep with store=server: 8 trials at once (local launcher), logging to the MLflow server and
    recording the study in PostgreSQL. Every trial is recorded once, with its whole metric history, and
    nothing lands in the outputs folder's SQLite files."""
    import optuna
    from mlflow import MlflowClient
    outputs = tmp_path / "outputs"
    env = cli_env(outputs, KLBENCH_MLFLOW_URI=mlflow_server, KLBENCH_OPTUNA_STORAGE=postgres_url)
    steps, every = 40, 10
    r = subprocess.run([sys.executable, "-m", "klbench.cli", "-m", "sweep=rl_beta", "experiment=tabular",
                        "estimator=rb", f"task.max_steps={steps}", f"task.val_every={every}", "store=server",
                        f"hydra.sweeper.n_trials={N_PROCS}", f"hydra.sweeper.n_jobs={N_PROCS}",
                        "hydra/launcher=local", "hydra.sweeper.study_name=on-servers"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    st = optuna.load_study(study_name="on-servers", storage=postgres_url)
    assert [t.state.name for t in st.trials] == ["COMPLETE"] * N_PROCS
    client = MlflowClient(mlflow_server)
    parent = st.user_attrs["klbench.mlflow_parent_run_id"]
    exp = client.get_run(parent).info.experiment_id
    kids = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(k.info.status for k in kids) == ["FINISHED"] * N_PROCS
    assert sorted(float(k.data.params["estimator.beta"]) for k in kids) == sorted(
        t.params["estimator.beta"] for t in st.trials)  # one run per trial, none twice
    for k in kids:
        assert [m.step for m in client.get_metric_history(k.info.run_id, "val/reward")] == list(
            range(0, steps + 1, every))
        train = [m.step for m in client.get_metric_history(k.info.run_id, "train/kl_mc")]
        assert len(train) == len(set(train)) == steps // 5
    assert client.get_run(parent).info.status == "FINISHED"
    assert "pareto.png" in {a.path for a in client.list_artifacts(parent)}  # through the server
    assert not (outputs / "mlflow.db").exists() and not (outputs / "optuna.db").exists()
