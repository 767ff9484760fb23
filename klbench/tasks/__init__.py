"""The tasks, found by name: one registry through which the entry point (klbench.tasks.train.run) runs every
task. A runner is named as "module:function" and imported only when its task runs: a tabular RL run never
imports the probe's plots or the pretraining code, and the runners may import this package without a circle."""
from __future__ import annotations

import importlib
from typing import Callable

from omegaconf import DictConfig, OmegaConf

TASKS = {
    "rl": "klbench.tasks.train:run_training",  # KL-regularised RL (klbench.tasks.rl.RLTask in a Trainer)
    "distill": "klbench.tasks.train:run_training",  # RL with beta = 1 toward the teacher, by default no reward
    "pretrain": "klbench.tasks.pretrain:run_task",  # builds the embedded LM of model=embedded
    "probe": "klbench.tasks.probe:run_task",  # measures every estimator on a policy/reference pair
}
# the tasks that train: they answer a sweep with (val/reward, val/seq_kl)
TRAINING = ("rl", "distill")


def runner(name: str) -> Callable[[DictConfig], dict[str, float]]:
    """The function that runs task `name` on a checked config and returns its metrics."""
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is unknown; valid: {', '.join(TASKS)}")
    module, _, function = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def build_task(cfg: DictConfig, policy, reward):
    """The LightningModule of a training task (TRAINING): distillation is RL with beta = 1."""
    from klbench.tasks.rl import RLTask
    if cfg.task.name not in TRAINING:
        raise ValueError(f"task.name={cfg.task.name!r} trains no LightningModule; the training tasks: "
                         f"{', '.join(TRAINING)}")
    est = OmegaConf.to_container(cfg.estimator, resolve=True)
    task = OmegaConf.to_container(cfg.task, resolve=True)
    kl_ctl = OmegaConf.to_container(cfg.kl_ctl, resolve=True) if "kl_ctl" in cfg else None
    return RLTask(policy, reward, est, task, kl_ctl)
