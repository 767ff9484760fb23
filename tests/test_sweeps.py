"""Sweeps: every sweep and launcher config composes; on the tabular model, a sweep runs end to end on
the local launcher with an MLflow parent run and its Pareto frontier, a restarted study neither loses
nor repeats trials, and a failing trial is recorded as failed without ending its sweep.

The sweeps run the CLI in this process (tests/cli_inprocess.py); they share one outputs folder (one MLflow and one Optuna
database, as a user's sweeps do) and use a different study each, except the restart test, which
continues the study of the first sweep.
"""
from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import cli_inprocess
from klbench.config.compose import compose

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml"))
LAUNCHERS = sorted(p.stem for p in (ROOT / "conf" / "hydra" / "launcher").glob("*.yaml"))
TINY = ["experiment=tabular", "task.max_steps=10", "task.val_every=5"]


def cli_env(outputs: Path, **extra: str) -> dict[str, str]:
    """The environment of a klbench CLI process writing to `outputs`, free of this process's sweep state."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID",
                                                            "KLBENCH_RESUME_CKPT")}
    # one thread: the tabular model gains nothing from more, and a busy 2-core machine loses a lot
    env.update(KLBENCH_OUTPUTS=str(outputs), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    return env


def klbench_multirun(outputs: Path, *overrides: str, timeout: int = 240,
                     process: bool = False) -> subprocess.CompletedProcess:
    """`klbench -m ...` in this process (tests/cli_inprocess.py), or with `process` a real one."""
    if not process:
        proc = cli_inprocess.run(["-m", *overrides], cwd=outputs.parent, env=cli_env(outputs))
    else:
        proc = subprocess.run([sys.executable, "-m", "klbench.cli", "-m", *overrides], cwd=outputs.parent,
                              env=cli_env(outputs), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def study(outputs: Path, name: str):
    import optuna
    return optuna.load_study(study_name=name, storage=f"sqlite:///{outputs}/optuna.db")


def mlflow_client(outputs: Path):
    from mlflow import MlflowClient
    return MlflowClient(f"sqlite:///{outputs}/mlflow.db")


def children(client, parent_id: str) -> list:
    exp = client.get_run(parent_id).info.experiment_id
    return client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent_id}'")


def by_state(st) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in st.trials:
        out.setdefault(t.state.name, []).append(t)
    return out


# ---- configs ----

def test_the_three_sweeps_exist():
    assert {"rl_beta", "rl_beta_lambda", "estimators_grid"} <= set(SWEEPS)
    assert {"local", "slurm", "slurm_site_example"} <= set(LAUNCHERS)


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes(tmp_path, name):
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    cfg = compose([f"sweep={name}", "experiment=tabular"], outputs=tmp_path / "outputs", hydra=True)
    sw = cfg.hydra.sweeper
    assert sw._target_.endswith("OptunaSweeper")
    assert list(sw.direction) == ["maximize", "minimize"]  # optimized_metrics: val/reward up, val/seq_kl down
    assert list(cfg.optimized_metrics) == ["val/reward", "val/seq_kl"]
    assert sw.storage == f"sqlite:///{tmp_path}/outputs/optuna.db"  # not MLflow's database
    assert cfg.logger.tracking_uri != sw.storage
    assert name in sw.study_name and "tabular" in sw.study_name
    assert 0 < sw.max_failure_rate < 1 and sw.n_jobs >= 2 and sw.sampler.seed is not None
    assert cfg.hydra.callbacks.sweep_tracking._target_ == "klbench.sweep.callback.SweepTracking"
    assert cfg.logger.parent_run_id is None and cfg.ckpt_path is None  # outside a trial process
    dists, fixed, _ = create_params_from_overrides([f"{k}={v}" for k, v in sw.params.items()])
    swept = {"rl_target_kl": "kl_ctl.target", "kl_placement": "estimator.value"}.get(name, "estimator.beta")
    assert swept in dists and not fixed
    if name.startswith("rl_beta"):
        beta = dists["estimator.beta"]
        assert beta.log and beta.low == 1e-3 and beta.high == 1.0


def test_grid_size_caps_the_study(tmp_path):
    from klbench.sweep.study import study_total
    cfg = compose(["sweep=estimators_grid", "experiment=tabular"], outputs=tmp_path, hydra=True)
    assert study_total(cfg) == 2 * 5 * 3
    cfg = compose(["sweep=estimators_grid", "experiment=tabular", 'hydra.sweeper.params={seed:"choice(0)"}'],
                  outputs=tmp_path, hydra=True)
    assert study_total(cfg) == 2 * 5
    # the plugin would still enumerate a dimension fixed on the command line, repeating grid points
    cfg = compose(["sweep=estimators_grid", "experiment=tabular", "seed=0"], outputs=tmp_path, hydra=True)
    with pytest.raises(ValueError, match="seed"):
        study_total(cfg)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_composes(tmp_path, launcher):
    cfg = compose(["sweep=rl_beta", "experiment=tabular", f"hydra/launcher={launcher}"], outputs=tmp_path,
                  hydra=True)
    lc = cfg.hydra.launcher
    if launcher == "local":
        assert lc._target_.endswith("LocalLauncher")
        assert cfg.hydra.sweeper.n_jobs == 2
        assert cfg.hydra.job.env_set.OMP_NUM_THREADS == str(lc.cpus_per_task)
    else:
        assert lc._target_.endswith("SlurmLauncher")
        assert lc.max_num_timeout > 0 and lc.gpus_per_node >= 1 and lc.timeout_min > 0
        assert cfg.hydra.sweeper.n_jobs == lc.array_parallelism  # one batch fills the array
        assert "partition" in lc and "account" in lc
    if launcher == "slurm_site_example":
        assert lc.partition and lc.account and lc.setup


# ---- sweeps on the tabular model ----

@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweeps") / "outputs"


@pytest.fixture(scope="module")
def local_sweep(outputs):
    """2 trials of rl_beta for rb, both at once in their own processes (submitit local launcher)."""
    proc = klbench_multirun(outputs, "sweep=rl_beta", "estimator=rb", *TINY, "hydra.sweeper.n_trials=2",
                            "hydra/launcher=local")
    return proc, "klbench-rl_beta-rb-tabular"


def test_local_sweep_end_to_end(outputs, local_sweep):
    proc, name = local_sweep
    st = study(outputs, name)
    complete = by_state(st).get("COMPLETE", [])
    assert len(st.trials) == 2 and len(complete) == 2
    client = mlflow_client(outputs)
    parent = client.get_run(st.user_attrs["klbench.mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["optuna.study_name"] == name
    kids = children(client, parent.info.run_id)
    assert sorted(k.info.status for k in kids) == ["FINISHED", "FINISHED"]
    assert ({float(k.data.params["estimator.beta"]) for k in kids}
            == {t.params["estimator.beta"] for t in complete})
    # the trial's returned objectives are its final logged metrics
    logged = sorted((k.data.metrics["val/reward"], k.data.metrics["val/seq_kl"]) for k in kids)
    returned = sorted(tuple(t.values) for t in complete)
    assert logged == [pytest.approx(v, rel=1e-6) for v in returned]  # float32 metrics, float64 in MLflow
    assert {"pareto.png", "pareto.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    rows = list(csv.DictReader(open(client.download_artifacts(parent.info.run_id, "pareto.csv"))))
    assert {r["run_id"] for r in rows} == {k.info.run_id for k in kids}
    # the sweep's end: Optuna's Pareto trials labelled, the plot and table in its folder, the parent run named
    sweep_dir = Path(parent.data.tags["klbench.sweep.dir"]).resolve()
    assert (sweep_dir / "pareto.png").stat().st_size > 0
    assert list(csv.DictReader(open(sweep_dir / "pareto.csv"))) == rows
    assert "Values: [" not in proc.stdout + proc.stderr and "  val/reward    val/seq_kl  params" in proc.stdout
    assert f"klbench: sweep folder  {sweep_dir}\n" in proc.stdout
    assert f"klbench: MLflow run    {parent.info.run_id} (" in proc.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{outputs.resolve()}/mlflow.db" in proc.stdout
    assert parent.data.metrics["pareto/n_points"] == 2
    assert parent.data.metrics["pareto/frontier_gap/rb"] > -1e-6  # nothing beats the exact optimum
    assert all(Path(k.data.tags["klbench.run_dir"], "checkpoints", "last.ckpt").is_file() for k in kids)


def test_restarted_study_loses_and_repeats_nothing(outputs, local_sweep):
    """A sweep process that died left one trial RUNNING in Optuna and its run RUNNING in MLflow;
    repeating the command with n_trials=3 closes both, re-runs that trial's beta, and stops at 3."""
    from optuna.distributions import FloatDistribution
    _, name = local_sweep
    st = study(outputs, name)
    parent_id = st.user_attrs["klbench.mlflow_parent_run_id"]
    dead = st.ask({"estimator.beta": FloatDistribution(1e-3, 1.0, log=True)})
    client = mlflow_client(outputs)
    exp_id = client.get_run(parent_id).info.experiment_id
    # a trial run whose process on this host is gone (this pid, another start time: a reused pid)
    owner = {"klbench.host": socket.gethostname(), "klbench.pid": str(os.getpid()), "klbench.pid_start": "0"}
    stale = client.create_run(exp_id, tags={"mlflow.parentRunId": parent_id, **owner}).info.run_id
    done_before = {t.number for t in by_state(st)["COMPLETE"]}

    cmd = ["sweep=rl_beta", "estimator=rb", *TINY]  # the same task overrides; launcher may differ
    klbench_multirun(outputs, *cmd, "hydra.sweeper.n_trials=3")
    st = study(outputs, name)
    states = by_state(st)
    complete = states["COMPLETE"]
    assert len(complete) == 3 and done_before < {t.number for t in complete}
    assert len({t.params["estimator.beta"] for t in complete}) == 3
    assert [t.number for t in states["FAIL"]] == [dead.number]
    rerun = [t for t in complete if t.user_attrs.get("klbench.retry_of") == dead.number]
    assert len(rerun) == 1 and rerun[0].params == dead.params
    kids = {k.info.run_id: k.info.status for k in children(client, parent_id)}
    assert kids.pop(stale) == "KILLED"
    assert sorted(kids.values()) == ["FINISHED"] * 3
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["pareto/n_points"] == 3

    proc = klbench_multirun(outputs, *cmd, "hydra.sweeper.n_trials=3")  # complete: nothing to run
    assert "3 of 3 trials finished, running 0" in proc.stdout + proc.stderr
    assert len(study(outputs, name).trials) == len(st.trials)

    # other task overrides under the same study name are refused, not mixed into it
    env = {**os.environ, "KLBENCH_OUTPUTS": str(outputs), "HF_HUB_OFFLINE": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    bad = cli_inprocess.run(["-m", *cmd, "task.lr=0.5", "hydra.sweeper.n_trials=4"], cwd=outputs.parent, env=env)
    assert bad.returncode != 0 and "hydra.sweeper.study_name" in bad.stderr
    assert len(study(outputs, name).trials) == len(st.trials)


def test_resumed_sweep_proposes_new_points(outputs):
    """Asked for more trials, a rerun of a finished sweep must not replay its random start-up betas."""
    cmd = ["sweep=rl_beta", "estimator=seq", *TINY]
    klbench_multirun(outputs, *cmd, "hydra.sweeper.n_trials=2")
    klbench_multirun(outputs, *cmd, "hydra.sweeper.n_trials=4")
    complete = by_state(study(outputs, "klbench-rl_beta-seq-tabular"))["COMPLETE"]
    assert len(complete) == 4 and len({t.params["estimator.beta"] for t in complete}) == 4


def test_failing_trial_does_not_end_the_sweep(outputs):
    """One grid point has an invalid beta: that trial fails before anything is built (no MLflow run), the
    other three finish, and the parent run reports the failed trial."""
    klbench_multirun(outputs, "sweep=estimators_grid", *TINY,
                     'hydra.sweeper.params={estimator:"choice(seq)",estimator.beta:"choice(0.05,0.1,-1.0,0.2)",'
                     'seed:"choice(0)"}')
    st = study(outputs, "klbench-estimators_grid-tabular")
    states = by_state(st)
    assert len(states["COMPLETE"]) == 3 and len(states["FAIL"]) == 1
    assert states["FAIL"][0].params["estimator.beta"] == -1.0
    client = mlflow_client(outputs)
    parent_id = st.user_attrs["klbench.mlflow_parent_run_id"]
    kids = children(client, parent_id)
    assert sorted(k.info.status for k in kids) == ["FINISHED"] * 3
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["pareto/n_points"] == 3
    assert "estimator.beta" in parent.data.tags["klbench.sweep.failed_trials"]


def test_failure_after_training_marks_the_run_failed(outputs, local_sweep, tmp_path):
    """Lightning marks a run FAILED for exceptions inside fit; train.run_task's own checks come after fit
    (non-finite final metrics), when the run is already FINISHED: the callback corrects it."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from klbench.sweep.callback import SweepTracking
    client = mlflow_client(outputs)
    exp_id = client.get_experiment_by_name("sweep-rl_beta-tabular").experiment_id
    run_id = client.create_run(exp_id).info.run_id
    client.set_terminated(run_id, "FINISHED")
    (tmp_path / "mlflow_run_id.txt").write_text(run_id)
    cfg = OmegaConf.create({"hydra": {"mode": "MULTIRUN", "runtime": {"output_dir": str(tmp_path)},
                                      "overrides": {"task": ["estimator.beta=0.1"]}},
                            "logger": {"kind": "mlflow", "tracking_uri": f"sqlite:///{outputs}/mlflow.db"}})
    from hydra.types import RunMode
    cfg.hydra.mode = RunMode.MULTIRUN
    ret = JobReturn()
    ret.status, ret._return_value = JobStatus.FAILED, FloatingPointError("val/reward is nan after training")
    SweepTracking().on_job_end(cfg, ret)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["klbench.error"] == "FloatingPointError: val/reward is nan after training"


@pytest.mark.slow
def test_requeued_trial_resumes_from_its_checkpoint(outputs):
    """submitit's local executor signals a trial at its timeout and starts it again, as SLURM does on
    timeout or preemption: the new attempt resumes from last.ckpt and continues the same MLflow run."""
    # long enough to outlast the 1-minute limit at the step rate of docs/sweeps.md ("Requeued trials")
    klbench_multirun(outputs, "sweep=rl_beta", "estimator=loo", "experiment=tabular", "task.max_steps=12000",
                     "task.val_every=500", "hydra.sweeper.n_trials=1", "hydra/launcher=local",
                     "hydra.launcher.timeout_min=1", timeout=580, process=True)  # signalled 30 s after each start
    st = study(outputs, "klbench-rl_beta-loo-tabular")
    assert [t.state.name for t in st.trials] == ["COMPLETE"]
    client = mlflow_client(outputs)
    (kid,) = children(client, st.user_attrs["klbench.mlflow_parent_run_id"])
    assert kid.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(kid.info.run_id, "val/reward")]
    assert steps[-1] == 12000 and len(steps) == len(set(steps))  # one run, no step logged twice
    train = [m.step for m in client.get_metric_history(kid.info.run_id, "train/kl_mc")]
    assert len(train) == len(set(train)) == 12000 // 5
    log = (Path(kid.data.tags["klbench.run_dir"]) / "klbench.log").read_text()
    assert "resuming this trial from" in log


def test_last_grid_trial_failing_does_not_crash_the_sweep():
    """What the Optuna sweeper plugin does with a batch of two grid trials when the one told last failed:
    GridSampler calls study.stop() outside study.optimize, which raised and ended the sweep with exit 1
    although every result was recorded. The sweep callback swallows exactly that error."""
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState

    from klbench.sweep.study import tolerate_grid_stop
    tolerate_grid_stop()
    study = optuna.create_study(directions=["maximize", "minimize"],
                                sampler=optuna.samplers.GridSampler({"b": [0.1, -1.0]}, seed=0))
    trials = [study.ask({"b": FloatDistribution(-1.0, 0.1)}) for _ in range(2)]
    ok, bad = sorted(trials, key=lambda t: t.params["b"] < 0)
    study.tell(ok, values=[1.0, 0.5])
    study.tell(bad, state=TrialState.FAIL)  # the grid is now complete: stop() is called here
    assert [t.state for t in study.trials if t.params["b"] < 0] == [TrialState.FAIL]
