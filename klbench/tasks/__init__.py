"""LightningModules and task runners: rl, distill, pretrain."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf


def build_task(cfg: DictConfig, policy, reward):
    """The `task` group: one LightningModule class per task name."""
    from klbench.tasks.rl import RLTask
    est = OmegaConf.to_container(cfg.estimator, resolve=True)
    task = OmegaConf.to_container(cfg.task, resolve=True)
    if cfg.task.name in ("rl", "distill"):  # distillation is RL with beta = 1 and (by default) no reward
        kl_ctl = OmegaConf.to_container(cfg.kl_ctl, resolve=True) if "kl_ctl" in cfg else None
        return RLTask(policy, reward, est, task, kl_ctl)
    raise ValueError(f"task.name={cfg.task.name!r} is unknown; valid: rl, distill, pretrain")
