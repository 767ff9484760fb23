"""Trials across two SLURM nodes (issue 52): the two-node cluster of two_nodes.py, each node a slurmd in namespaces
of its own with its own address on a private bridge. hardware=ddp and hardware=fsdp with hardware.num_nodes=2, one
rank per node, through `klbench -m ... hydra/launcher=slurm`: one FINISHED MLflow run with the metrics of the same
job on 2 local ranks, each rank on its own node's address. docs/scale-out.md, "Two nodes".
"""
from __future__ import annotations

import ipaddress
import subprocess
import time
from pathlib import Path

import pytest
from test_scaleout import klbench, only_kid
from test_sweeps import mlflow_client as client

pytestmark = pytest.mark.slurm

# the two-node partition: one CPU and one rank per node (hydra.launcher.nodes = hardware.num_nodes)
TWO = ["hydra/launcher=slurm", "hydra.launcher.partition=two", "hydra.launcher.nodes=2",
       "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0",
       "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=5"]
ONE_BETA = 'hydra.sweeper.params={estimator.beta:"choice(0.1)"}'


def assert_across_nodes(cluster, kid) -> None:
    """The job ran one task on each node, and each rank used its own node's bridge address."""
    job = kid.data.tags["klbench.slurm_job"]
    steps = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,NTasks,NNodes,NodeList"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert f"{job}.0|2|2|klb-n[1-2]" in steps, steps  # srun's step: 2 tasks on the 2 nodes
    # "0=klb-n1/10.200.0.2 1=klb-n2/10.200.0.3" (klbench.tasks.rank_hosts), rank 0 on the first node
    ranks = dict(r.split("=") for r in kid.data.tags["klbench.rank_hosts"].split())
    assert sorted(ranks.values()) == [f"{n}/{a}" for n, a in sorted(cluster.ADDR.items())], ranks
    for host_addr in ranks.values():
        addr = ipaddress.ip_address(host_addr.split("/")[1])
        assert not addr.is_loopback and addr in cluster.NET
    log = (Path(kid.data.tags["klbench.run_dir"]) / "klbench.log").read_text()
    assert f"ranks: {kid.data.tags['klbench.rank_hosts']}" in log
    # one whole checkpoint in the shared run folder, rank 0's: no per-rank copies or shards
    ckpts = sorted(p.name for p in (Path(kid.data.tags["klbench.run_dir"]) / "checkpoints").iterdir())
    assert ckpts == ["last.ckpt"], ckpts


def local_metrics(out: Path, *overrides: str) -> dict[str, float]:
    """The same job on 2 local ranks of this machine (Lightning starts rank 1), no SLURM: its final val metrics."""
    klbench(out, *overrides, "estimator.beta=0.1", "logger.experiment=straight")
    c = client(out)
    (run,) = c.search_runs([c.get_experiment_by_name("straight").experiment_id], max_results=1)
    return {k: v for k, v in run.data.metrics.items() if k.startswith("val/")}


def test_ddp_across_two_nodes(two_nodes, tmp_path):
    out = tmp_path / "outputs"
    trial = ["experiment=tabular", "estimator=rb", "task.max_steps=20", "task.val_every=10", "hardware=ddp",
             "hardware.accelerator=cpu"]
    klbench(out, "-m", "sweep=rl_beta", *trial, "hardware.devices=1", "hardware.num_nodes=2", ONE_BETA,
            "hydra.sweeper.n_trials=1", *TWO)
    c, kid = only_kid(out)
    assert_across_nodes(two_nodes, kid)
    assert kid.data.params["hardware.num_nodes"] == "2"
    straight = local_metrics(out, *trial, "hardware.devices=2")
    assert straight and {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)


def test_fsdp_across_two_nodes(two_nodes, tmp_path, tiny_arch):
    policy, ref = tiny_arch("llama")
    out = tmp_path / "outputs"
    trial = ["model=hf", f"model.name_or_path={policy}", f"model.ref_name_or_path={ref}", "estimator=naive_mc",
             "task.prompts_per_step=4", "task.n_samples=2", "task.max_new_tokens=8", "task.val_prompts=4",
             "task.max_steps=4", "task.val_every=2", "hardware=fsdp", "hardware.accelerator=cpu"]
    klbench(out, "-m", "sweep=rl_beta", *trial, "hardware.devices=1", "hardware.num_nodes=2", ONE_BETA,
            "hydra.sweeper.n_trials=1", *TWO)
    c, kid = only_kid(out)
    assert_across_nodes(two_nodes, kid)
    assert kid.data.params["hardware.strategy"] == "fsdp2"
    val = [m.step for m in c.get_metric_history(kid.info.run_id, "val/seq_kl")]
    assert val == [0, 2, 4] and kid.data.metrics["val/seq_kl"] > 0
    straight = local_metrics(out, *trial, "hardware.devices=2")
    assert straight and {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)


# ---- bad input: refused in one line before anything is submitted ----

def _refused(out: Path, *args: str) -> str:
    import subprocess
    import sys

    from test_sweeps import cli_env
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", "-m", "sweep=rl_beta", "experiment=tabular",
                           "hardware=ddp", "hardware.accelerator=cpu", "hardware.devices=1", ONE_BETA,
                           "hydra.sweeper.n_trials=1", *args], cwd=out.parent, env=cli_env(out), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "klbench sweep: NodesError" in line]
    assert len(said) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (out / "optuna.db").exists() and not (out / "mlflow.db").exists()  # nothing of the sweep exists
    return said[0]


def test_more_nodes_than_the_partition_has_is_refused_before_submission(two_nodes, tmp_path):
    before = subprocess.run(["sacct", "-n", "-X", "-o", "JobID", "-S", "now-1hour"], capture_output=True,
                            text=True).stdout.split()
    line = _refused(tmp_path / "outputs", "hardware.num_nodes=3", *[a.replace("nodes=2", "nodes=3") for a in TWO])
    assert "hardware.num_nodes=3: SLURM partition 'two' has 2 nodes" in line
    after = subprocess.run(["sacct", "-n", "-X", "-o", "JobID", "-S", "now-1hour"], capture_output=True,
                           text=True).stdout.split()
    assert after == before  # no job was submitted


def test_a_launcher_node_count_other_than_num_nodes_is_refused(two_nodes, tmp_path):
    line = _refused(tmp_path / "outputs", "hardware.num_nodes=2", *[a.replace("nodes=2", "nodes=1") for a in TWO])
    assert "hardware.num_nodes=2 but hydra.launcher.nodes=1" in line


# ---- a node lost mid-run ----

def _job_pids(cluster, node: str) -> list[int]:
    """The processes of jobs on `node` (everything in its network namespace but its slurmd)."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.netns(node)], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm != "slurmd":
            out.append(int(pid))
    return out


@pytest.mark.slow  # minutes: a run to its first checkpoint, SLURM's node-failure detection, a requeued attempt
def test_a_node_lost_mid_run_is_requeued_and_resumes_exactly(two_nodes, tmp_path, monkeypatch):
    """klb-n2 leaves the network and its processes die (kill -9, link down: rank 0 gets no FIN, as from a node that
    lost power) after the first checkpoint. Rank 0 is blocked in gloo's allreduce, which would wait out the process
    group's timeout (30 min, torch's default). What ends it is SLURM: klb-n2 stops answering pings, is DOWN after
    SlurmdTimeout (10 s here, 300 s by default), the job is NODE_FAIL and srun kills its step on klb-n1 (SIGKILL: no
    handler runs). The run, RUNNING in the record, is KILLED once anyone reads the runs (its job is pending again,
    klbench.record.runs.reap). SLURM requeues the batch job (JobRequeue=1); once klb-n2 is back it runs again and
    the trial resumes from last.ckpt: the run FINISHED, no step logged twice, the metrics of a straight run."""
    from test_scaleout import assert_resumed_cleanly, only_trial_run, sacct, wait_for
    out = tmp_path / "outputs"
    steps, every = 1200, 200
    trial = ["experiment=tabular", "estimator=rb", f"task.max_steps={steps}", f"task.val_every={every}",
             "hardware=ddp", "hardware.accelerator=cpu"]
    sweep = klbench(out, "-m", "sweep=rl_beta", *trial, "hardware.devices=1", "hardware.num_nodes=2", ONE_BETA,
                    "hydra.sweeper.n_trials=1", *[a.replace("timeout_min=5", "timeout_min=20") for a in TWO],
                    background=True)
    try:
        run = wait_for("the trial's first checkpoint", lambda: only_trial_run(out), 300, sweep)
        job = run.data.tags["klbench.slurm_job"]
        subprocess.run(["ip", "link", "set", two_nodes._veth("klb-n2"), "down"], check=True)
        two_nodes.stop_node("klb-n2")  # slurmd and rank 1, kill -9
        lost = time.monotonic()
        wait_for("rank 0 on klb-n1 to end", lambda: not _job_pids(two_nodes, "klb-n1"), 90, sweep)
        ended_after = time.monotonic() - lost
        # SLURM's kill is SIGKILL on a node failure: no rank lives to mark the run. Whoever reads the runs next
        # (a run starting, klbench-pareto, a resumed sweep: klbench.record.runs.reap) finds its job pending again
        wait_for("the job requeued", lambda: "PD" in subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"],
                                                                    capture_output=True, text=True).stdout, 60)
        from klbench.record.runs import reap
        c = client(out)
        reap(c, [run.info.experiment_id], noticed_by="the node-loss test")
        during = c.get_run(run.info.run_id)
        attempts = sacct(job)
        print(f"node lost at step >= {run.data.tags['klbench.steps_done']}: rank 0 ended {ended_after:.1f} s later; "
              f"run {during.info.status}; attempts {[a['state'] for a in attempts]}")
        assert ended_after < 60  # SlurmdTimeout 10 s, slurmctld's ping cycle, the step's kill: ~30 s measured
        assert during.info.status == "KILLED"  # not RUNNING while nothing runs
        assert f"SLURM job {job} is gone" in during.data.tags["klbench.ended"]
        assert attempts[0]["state"] == "NODE_FAIL"
        subprocess.run(["ip", "link", "set", two_nodes._veth("klb-n2"), "up"], check=True)
        two_nodes.start_node("klb-n2")
        assert sweep.wait(timeout=600) == 0
    finally:
        if sweep.poll() is None:
            sweep.kill()
        subprocess.run(["ip", "link", "set", two_nodes._veth("klb-n2"), "up"], capture_output=True)
        if not two_nodes.healthy():
            two_nodes.start_node("klb-n2")
    c, kid = only_kid(out)
    assert_resumed_cleanly(c, kid, steps, every)
    assert [a["state"] for a in sacct(job)][-1] == "COMPLETED"
    assert_across_nodes(two_nodes, kid)
    straight = local_metrics(out, *trial, "hardware.devices=2", f"task.max_steps={steps}")
    assert {k: kid.data.metrics[k] for k in straight} == pytest.approx(straight, rel=1e-6)


def test_a_run_whose_job_is_pending_again_is_killed_by_the_reaper(slurm_cluster, tmp_path):
    """The node-loss test's record, in seconds: a RUNNING run owned by a SLURM job that is pending (as after a
    requeue) has no process; one owned by a running job has. klbench.record.runs.reap marks only the first KILLED."""
    from mlflow import MlflowClient

    from klbench.record import runs
    from klbench.record.store import ensure_experiment
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = ensure_experiment(uri, "reap", None, None)
    c = MlflowClient(uri)

    def sbatch(*args: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "-p", "main", "-c", "1", "--mem=50M", "-o", "/dev/null",
                               *args, "--wrap", "sleep 60"], capture_output=True, text=True, check=True).stdout.strip()

    pending, running = sbatch("--hold"), sbatch()
    try:
        from test_scaleout import wait_for
        wait_for("the job to run", lambda: subprocess.run(["squeue", "-h", "-j", running, "-o", "%t"],
                                                          capture_output=True, text=True).stdout.strip() == "R", 30)
        ids = {job: c.create_run(exp, tags={runs.HOST: "klb-n1", runs.PID: "4242", runs.SLURM_JOB: job}).info.run_id
               for job in (pending, running)}
        assert runs.reap(c, [exp], noticed_by="the test") == [ids[pending]]
        assert c.get_run(ids[pending]).info.status == "KILLED"
        assert c.get_run(ids[running]).info.status == "RUNNING"
    finally:
        subprocess.run(["scancel", pending, running], capture_output=True)
