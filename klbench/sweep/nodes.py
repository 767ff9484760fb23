"""A multi-node sweep's nodes, checked before any job is submitted (docs/scale-out.md, "Two nodes").

With hydra/launcher=slurm every trial is one SLURM job of hydra.launcher.nodes nodes x tasks_per_node tasks, and
Lightning expects hardware.num_nodes x hardware.devices ranks. Asked for more nodes than the partition has, SLURM
keeps the job pending forever (or refuses it after the sweep has opened its records); with a launcher node count
other than hardware.num_nodes, Lightning waits for ranks that never come, or starts two trainings. Either is one
line here, before the sweep's study, parent run or first job exists. No torch here.
"""
from __future__ import annotations

import logging
import subprocess

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class NodesError(ValueError):
    pass


def _slurm(config: DictConfig) -> bool:
    return "SlurmLauncher" in str(OmegaConf.select(config, "hydra.launcher._target_") or "")


def partition_nodes(partition: str | None) -> tuple[str, int] | None:
    """(partition, its node count) as sinfo says, `partition` None: the cluster's default; None when sinfo cannot
    tell (no sinfo here, or the controller does not answer: submission will say why)."""
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode:
        return None
    counts: dict[str, int] = {}
    default = None
    for line in r.stdout.splitlines():  # one line per partition and node state: "two* 2", "main 1"
        name, n = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        counts[name] = counts.get(name, 0) + int(n)
    name = partition or default
    return (name, counts[name]) if name in counts else None


def check(config: DictConfig) -> None:
    """NodesError, one line, for a SLURM sweep whose hardware.num_nodes the launcher or the partition cannot give."""
    if not _slurm(config):
        return
    want = int(OmegaConf.select(config, "hardware.num_nodes") or 1)
    nodes = int(OmegaConf.select(config, "hydra.launcher.nodes") or 1)
    if nodes != want:
        raise NodesError(f"hardware.num_nodes={want} but hydra.launcher.nodes={nodes}: each trial's job must have one "
                         f"node per hardware.num_nodes (set hydra.launcher.nodes={want})")
    if want == 1:
        return
    partition = OmegaConf.select(config, "hydra.launcher.partition")
    found = partition_nodes(partition)
    if found is None:
        log.warning("sinfo did not answer: hardware.num_nodes=%d not checked against the partition's nodes", want)
        return
    name, have = found
    if want > have:
        raise NodesError(f"hardware.num_nodes={want}: SLURM partition {name!r} has {have} node"
                         f"{'s' if have != 1 else ''} (sinfo), so the trials' jobs could never start; choose "
                         f"hardware.num_nodes <= {have} or a partition with more nodes (hydra.launcher.partition)")
