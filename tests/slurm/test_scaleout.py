"""Sweeps on a real SLURM cluster (the private one of cluster.py): array jobs, preemption, time limits, a
sweep process that dies, and DDP through srun. Each runs the real CLI, as a user would.

All use the tabular model, where a trial is deterministic: a trial interrupted and resumed must end with
exactly the metrics of one that ran straight through.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sweeps import children as kids
from test_sweeps import cli_env, study
from test_sweeps import mlflow_client as client

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
# what fits the test node (2 CPUs): one CPU per trial, two trials at a time
SLURM = ["hydra/launcher=slurm", "hydra.launcher.partition=main", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.gpus_per_node=0", "hydra.launcher.mem_gb=1", "hydra.launcher.array_parallelism=2"]
TAB = ["experiment=tabular", "estimator=rb"]
# one fixed beta, so the test knows the trial's config and can compare it with a straight run
ONE_BETA = 'hydra.sweeper.params={estimator.beta:"choice(0.1)"}'


def klbench(outputs: Path, *args: str, timeout: float = 300, background: bool = False):
    cmd = [sys.executable, "-m", "klbench.cli", *args]
    outputs.parent.mkdir(parents=True, exist_ok=True)
    if background:
        log = open(outputs.parent / f"sweep-{time.time_ns()}.log", "w")
        return subprocess.Popen(cmd, cwd=outputs.parent, env=cli_env(outputs), stdout=log,
                                stderr=subprocess.STDOUT)
    proc = subprocess.run(cmd, cwd=outputs.parent, env=cli_env(outputs), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def states(st) -> list[str]:
    return sorted(t.state.name for t in st.trials)


def only_kid(out: Path):
    """(the MLflow client, the one FINISHED run) of a one-trial sweep in `out` whose study COMPLETED."""
    import optuna
    (name,) = optuna.get_all_study_names(f"sqlite:///{out}/optuna.db")
    st = study(out, name)
    assert states(st) == ["COMPLETE"]
    c = client(out)
    (kid,) = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])  # one run for the two ranks
    assert kid.info.status == "FINISHED"
    return c, kid


def sacct(*job_ids: str) -> list[dict[str, str]]:
    """Every attempt of these jobs (--duplicates lists requeued attempts too)."""
    out = subprocess.run(["sacct", "-n", "-P", "-X", "--duplicates", "-o", "JobID,State,Start,End",
                          "-j", ",".join(job_ids)], capture_output=True, text=True, check=True).stdout
    return [dict(zip(("id", "state", "start", "end"), line.split("|"))) for line in out.splitlines() if line]


def wait_for(what, predicate, timeout: float, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the sweep ended (rc {proc.returncode}) before {what}")
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def only_trial_run(outputs: Path, parent_id: str | None = None):
    """The one RUNNING child run, once it has committed a checkpoint (steps_done > 0)."""
    from mlflow.exceptions import MlflowException

    from klbench.record.store import StoreError, open_store
    try:
        # the sweep creates the store under its lock: this poll must never start creating it too
        open_store(f"sqlite:///{outputs}/mlflow.db", create=False)
        c = client(outputs)
        exp = c.get_experiment_by_name("sweep-rl_beta-tabular")
        runs = c.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
    except (MlflowException, StoreError):
        return None
    runs = [r for r in runs if "mlflow.parentRunId" in r.data.tags and int(r.data.tags.get("klbench.steps_done", 0)) > 0]
    return runs[0] if runs else None


def straight_run(outputs: Path, *overrides: str) -> dict[str, float]:
    """The same trial run straight through in this process's machine, no SLURM: its final val metrics."""
    klbench(outputs, *TAB, "estimator.beta=0.1", *overrides, "logger.experiment=straight")
    c = client(outputs)
    (run,) = c.search_runs([c.get_experiment_by_name("straight").experiment_id], max_results=1,
                           order_by=["attributes.start_time DESC"])
    return {k: v for k, v in run.data.metrics.items() if k.startswith("val/")}


def assert_resumed_cleanly(c, run, max_steps: int, val_every: int) -> None:
    rid = run.info.run_id
    assert run.info.status == "FINISHED"
    for key in ("val/reward", "train/kl_mc", "train/beta"):
        if key not in run.data.metrics:
            continue
        steps = [m.step for m in c.get_metric_history(rid, key)]
        assert len(steps) == len(set(steps)), f"{key}: steps logged twice"
    val = [m.step for m in c.get_metric_history(rid, "val/reward")]
    assert val == list(range(0, max_steps + 1, val_every))
    log = (Path(run.data.tags["klbench.run_dir"]) / "klbench.log").read_text()
    assert "resuming this trial from" in log


# ---- 1. a sweep as array jobs ----

def test_sweep_runs_as_array_jobs(slurm_cluster, tmp_path):
    out = tmp_path / "outputs"
    klbench(out, "-m", "sweep=rl_beta", *TAB, "task.max_steps=20", "task.val_every=10",
            "hydra.sweeper.n_trials=4", *SLURM, "hydra.launcher.timeout_min=5")
    st = study(out, "klbench-rl_beta-rb-tabular")
    assert states(st) == ["COMPLETE"] * 4
    c = client(out)
    parent = c.get_run(st.user_attrs["klbench.mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED"
    children = kids(c, parent.info.run_id)
    assert sorted(k.info.status for k in children) == ["FINISHED"] * 4
    assert "pareto.png" in {a.path for a in c.list_artifacts(parent.info.run_id)}
    jobs = [k.data.tags["klbench.slurm_job"] for k in children]
    assert all("_" in j for j in jobs), jobs  # array tasks: <array job>_<index>
    attempts = sacct(*jobs)
    assert sorted(a["state"] for a in attempts) == ["COMPLETED"] * 4
    # two at a time: at no moment were more than two of them running
    edges = sorted([(a["start"], 1) for a in attempts] + [(a["end"], -1) for a in attempts])
    running = [sum(d for _, d in edges[: i + 1]) for i in range(len(edges))]
    assert max(running) <= 2


# ---- 2 and 3. preemption and time limits: requeued, resumed, nothing logged twice ----

@pytest.mark.slow  # 110 s on the 2-core CI VM: the default set keeps to about 10 minutes (docs/testing.md)
def test_preempted_trial_resumes_from_its_checkpoint(slurm_cluster, tmp_path):
    out = tmp_path / "outputs"
    steps, every = 3000, 500
    task = [f"task.max_steps={steps}", f"task.val_every={every}"]
    # a 60-minute limit: submitit calls any signal before 80% of it a preemption, after it a timeout
    sweep = klbench(out, "-m", "sweep=rl_beta", *TAB, *task, ONE_BETA, "hydra.sweeper.n_trials=1", *SLURM,
                    "hydra.launcher.timeout_min=60", background=True)
    run = wait_for("the trial's first checkpoint", lambda: only_trial_run(out), 240, sweep)
    job, reached = run.data.tags["klbench.slurm_job"], int(run.data.tags["klbench.steps_done"])
    # what SLURM sends before it preempts a job; submitit requeues it
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    assert sweep.wait(timeout=400) == 0
    st = study(out, "klbench-rl_beta-rb-tabular")
    assert states(st) == ["COMPLETE"]
    c = client(out)
    (kid,) = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])
    assert_resumed_cleanly(c, kid, steps, every)
    log = (Path(kid.data.tags["klbench.run_dir"]) / "klbench.log").read_text()
    resumed_at = int(log.split("resuming from step ")[1].split()[0])
    attempts = sacct(job)
    print(f"preemption: signalled after the checkpoint at step {reached}, resumed from step {resumed_at}; "
          f"attempts {[a['state'] for a in attempts]}")
    assert [a["state"] for a in attempts] == ["REQUEUED", "COMPLETED"]
    job_log = next(Path(kid.data.tags["klbench.run_dir"]).parent.glob(f".submitit/{job}/{job}_0_log.err")).read_text()
    assert "this job is preempted" in job_log
    # it resumed from the latest checkpoint: the work lost is what came after it, less than val_every steps
    assert resumed_at >= reached and resumed_at % every == 0
    straight = straight_run(out, *task)
    assert {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)


@pytest.mark.slow  # minutes by design (a 2-minute SLURM time limit, requeued until done): docs/scale-out.md
def test_trial_over_its_time_limit_is_requeued_until_done(slurm_cluster, tmp_path):
    """A 2-minute limit with a 30-second warning. Slurm may send the warning up to 60 s early, so an attempt
    lasts 30 to 90 s. 100000 tabular steps need several attempts, even at the fastest step time measured
    (docs/scale-out.md, the test table). A second sweep with max_num_timeout=0 gets no second attempt and
    ends failed, not finished."""
    steps, every = 100000, 2500
    task = [f"task.max_steps={steps}", f"task.val_every={every}"]
    limit = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=30"]
    a, b = tmp_path / "a" / "outputs", tmp_path / "b" / "outputs"
    bounded = klbench(b, "-m", "sweep=rl_beta", *TAB, *task, ONE_BETA, "hydra.sweeper.n_trials=1", *SLURM,
                      *limit, "hydra.launcher.max_num_timeout=0", background=True)
    klbench(a, "-m", "sweep=rl_beta", *TAB, *task, ONE_BETA, "hydra.sweeper.n_trials=1", *SLURM, *limit,
            "hydra.launcher.max_num_timeout=30", timeout=2400)
    st = study(a, "klbench-rl_beta-rb-tabular")
    assert states(st) == ["COMPLETE"]
    c = client(a)
    (kid,) = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])
    assert_resumed_cleanly(c, kid, steps, every)
    attempts = sacct(kid.data.tags["klbench.slurm_job"])
    print(f"time limit: {len(attempts)} attempts {[x['state'] for x in attempts]}")
    assert 2 <= len(attempts) <= 31 and attempts[-1]["state"] == "COMPLETED"

    bounded.wait(timeout=300)  # its one trial failing, the plugin ends the sweep with an error
    st = study(b, "klbench-rl_beta-rb-tabular")
    assert states(st) == ["FAIL"]
    c = client(b)
    parent = c.get_run(st.user_attrs["klbench.mlflow_parent_run_id"])
    (kid,) = kids(c, parent.info.run_id)
    assert kid.info.status != "FINISHED" and parent.info.status == "FAILED"
    print(f"max_num_timeout=0: trial run {kid.info.status}, attempts "
          f"{[x['state'] for x in sacct(kid.data.tags['klbench.slurm_job'])]}")


# ---- 4. the sweep process dies ----

# kill-9: 97 s on the 2-core CI VM, slow (docs/testing.md); sigterm (111 s) stays in the default set: issue 34's
# guarantee for SLURM-launched trials
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, id="kill-9", marks=pytest.mark.slow),
                                 pytest.param(signal.SIGTERM, id="sigterm")])
def test_rerun_after_the_sweep_process_is_killed(slurm_cluster, tmp_path, sig):
    """kill -9 (or SIGTERM: scancel of a sweep run as a job, docker stop) of the process that waits on the
    array jobs, while the second batch of trials runs. The rerun waits for those jobs, takes their results,
    and runs only the trial never started. Stopped by SIGTERM, the sweep exits 143 with its parent run
    KILLED and names the jobs that still run, whose trials it leaves RUNNING for the rerun."""
    out = tmp_path / "outputs"
    cmd = ["-m", "sweep=rl_beta", *TAB, "task.max_steps=1500", "task.val_every=500", "hydra.sweeper.n_trials=5",
           *SLURM, "hydra.launcher.timeout_min=10"]
    sweep = klbench(out, *cmd, background=True)
    name = "klbench-rl_beta-rb-tabular"

    def second_batch_running():
        # the parent run's file is written after the study and both stores exist: polling them sooner
        # would race the sweep's own creation of them
        if not list(out.glob("multirun/*/*/mlflow_parent_run_id.txt")):
            return False
        st = study(out, name)
        done = sum(t.state.name == "COMPLETE" for t in st.trials)
        return done == 2 and sum(t.state.name == "RUNNING" for t in st.trials) == 2 and only_trial_run(out)

    wait_for("the second batch to be training", second_batch_running, 300, sweep)
    sweep.send_signal(sig)
    sweep.wait()
    if sig == signal.SIGTERM:
        assert sweep.returncode == 143
        st = study(out, name)
        assert client(out).get_run(st.user_attrs["klbench.mlflow_parent_run_id"]).info.status == "KILLED"
        assert states(st) == ["COMPLETE", "COMPLETE", "RUNNING", "RUNNING"]  # the jobs still run
        log = next(out.parent.glob("sweep-*.log")).read_text()
        assert "stopped       by SIGTERM after 2 of 5 trials finished; the jobs " in log, log[-3000:]
    proc = klbench(out, *cmd, timeout=600)
    log = proc.stdout + proc.stderr
    assert log.count("taken from its job") == 2, log[-4000:]
    st = study(out, name)
    assert states(st) == ["COMPLETE"] * 5  # nothing failed, nothing retried, one trial never started ran
    c = client(out)
    children = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])
    assert sorted(k.info.status for k in children) == ["FINISHED"] * 5
    betas = [k.data.params["estimator.beta"] for k in children]
    assert len(set(betas)) == 5  # no trial ran twice
    assert sorted(float(b) for b in betas) == sorted(t.params["estimator.beta"] for t in st.trials)


# ---- 5. DDP through srun ----

def test_ddp_trial_through_srun(slurm_cluster, tmp_path):
    out = tmp_path / "outputs"
    ddp = ["hardware=ddp", "hardware.accelerator=cpu", "hardware.devices=2"]
    task = ["task.max_steps=20", "task.val_every=10"]
    klbench(out, "-m", "sweep=rl_beta", *TAB, *task, *ddp, ONE_BETA, "hydra.sweeper.n_trials=1", *SLURM,
            "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5")
    st = study(out, "klbench-rl_beta-rb-tabular")
    assert states(st) == ["COMPLETE"]
    c = client(out)
    (kid,) = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])  # one run for the two ranks
    assert kid.info.status == "FINISHED"
    job = kid.data.tags["klbench.slurm_job"]
    folder = Path(kid.data.tags["klbench.run_dir"]).parent / ".submitit" / job
    # srun ran the trial as 2 tasks, and rank 1 finished too (submitit writes one result per task)
    tasks = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,NTasks"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert f"{job}.0|2" in tasks, tasks
    assert (folder / f"{job}_1_result.pkl").is_file()
    straight = straight_run(out, *task, *ddp)  # the 2-process local DDP run of the same config
    assert {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)


# ---- 6. hardware=fsdp through srun (issue 45 item 5) ----

def test_fsdp_trial_through_srun(slurm_cluster, tmp_path, tiny_arch):
    """One hardware=fsdp trial on a tiny Llama folder as 2 srun tasks: Lightning's SLURMEnvironment gives the
    FSDP2 strategy its ranks; one MLflow run, with the metrics of the 2-rank local run of the same config."""
    policy, ref = tiny_arch("llama")
    out = tmp_path / "outputs"
    fsdp = ["hardware=fsdp", "hardware.accelerator=cpu", "hardware.devices=2"]
    trial = ["model=hf", f"model.name_or_path={policy}", f"model.ref_name_or_path={ref}", "estimator=naive_mc",
             "task.prompts_per_step=4", "task.n_samples=2", "task.max_new_tokens=8", "task.val_prompts=4",
             "task.max_steps=4", "task.val_every=2"]
    klbench(out, "-m", "sweep=rl_beta", *trial, *fsdp, ONE_BETA, "hydra.sweeper.n_trials=1", *SLURM,
            "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5")
    c, kid = only_kid(out)
    assert kid.data.params["hardware.strategy"] == "fsdp2"
    job = kid.data.tags["klbench.slurm_job"]
    folder = Path(kid.data.tags["klbench.run_dir"]).parent / ".submitit" / job
    tasks = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,NTasks"], capture_output=True, text=True,
                           check=True).stdout.split()
    assert f"{job}.0|2" in tasks, tasks  # srun ran the trial as 2 tasks
    assert (folder / f"{job}_1_result.pkl").is_file()  # and rank 1 finished too
    val = [m.step for m in c.get_metric_history(kid.info.run_id, "val/seq_kl")]
    assert val == [0, 2, 4] and kid.data.metrics["val/seq_kl"] > 0
    # the same trial as 2 local ranks (Lightning starts rank 1): the same metrics
    klbench(out, *trial, *fsdp, "estimator.beta=0.1", "logger.experiment=straight")
    (run,) = c.search_runs([c.get_experiment_by_name("straight").experiment_id], max_results=1)
    straight = {k: v for k, v in run.data.metrics.items() if k.startswith("val/")}
    assert straight and {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)
