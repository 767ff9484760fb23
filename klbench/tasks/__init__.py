"""The tasks, found by name: one registry through which the entry point (klbench.tasks.train.run_task) runs every
task. Each runner below imports its module only when its task runs: a tabular RL run never imports the probe's
plots or the pretraining code, and the task modules may import this package without a circle."""
from __future__ import annotations

from typing import Callable

from omegaconf import DictConfig, OmegaConf


def run_training(cfg: DictConfig) -> dict[str, float]:
    """task=rl, task=distill: one run of klbench.tasks.rl.RLTask in a Lightning Trainer (klbench/tasks/train.py)."""
    from klbench.tasks import train
    return train.run_training(cfg)


def run_pretrain(cfg: DictConfig) -> dict[str, float]:
    """task=pretrain: builds the embedded LM of model=embedded (klbench/tasks/pretrain.py)."""
    from klbench.tasks import pretrain
    return pretrain.run_pretrain(cfg)


def run_probe(cfg: DictConfig) -> dict[str, float]:
    """task=probe: measures every estimator on a policy/reference pair (klbench/tasks/probe.py)."""
    from klbench.tasks import probe
    return probe.run_probe(cfg)


TASKS: dict[str, Callable[[DictConfig], dict[str, float]]] = {
    "rl": run_training,  # KL-regularised RL
    "distill": run_training,  # RL with beta = 1 toward the teacher, by default no reward
    "pretrain": run_pretrain,
    "probe": run_probe,
}
# the tasks that train: they answer a sweep with (val/reward, val/seq_kl)
TRAINING = ("rl", "distill")


def runner(name: str) -> Callable[[DictConfig], dict[str, float]]:
    """The function that runs task `name` on a checked config and returns its metrics."""
    if name not in TASKS:
        raise ValueError(f"task.name={name!r} is unknown; valid: {', '.join(TASKS)}")
    return TASKS[name]


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
