"""Trials across two SLURM nodes (issue 52): the two-node cluster of two_nodes.py, each node a slurmd in namespaces
of its own with its own address on a private bridge. hardware=ddp and hardware=fsdp with hardware.num_nodes=2, one
rank per node, through `klbench -m ... hydra/launcher=slurm`: one FINISHED MLflow run with the metrics of the same
job on 2 local ranks, each rank on its own node's address. docs/scale-out.md, "Two nodes".
"""
from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

import pytest
from test_scaleout import klbench, states
from test_sweeps import children as kids
from test_sweeps import mlflow_client as client
from test_sweeps import study

pytestmark = pytest.mark.slurm

# the two-node partition: one CPU and one rank per node (hydra.launcher.nodes = hardware.num_nodes)
TWO = ["hydra/launcher=slurm", "hydra.launcher.partition=two", "hydra.launcher.nodes=2",
       "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.gpus_per_node=0",
       "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=5"]
ONE_BETA = 'hydra.sweeper.params={estimator.beta:"choice(0.1)"}'


def only_kid(out: Path):
    import optuna
    (name,) = optuna.get_all_study_names(f"sqlite:///{out}/optuna.db")
    st = study(out, name)
    assert states(st) == ["COMPLETE"]
    c = client(out)
    (kid,) = kids(c, st.user_attrs["klbench.mlflow_parent_run_id"])  # one run for the two ranks
    assert kid.info.status == "FINISHED"
    return c, kid


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
