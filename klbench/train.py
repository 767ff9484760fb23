"""Build a run from a composed config and train it. Hydra-free: takes an OmegaConf config."""
from __future__ import annotations

import math
import os
import time
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from klbench import tracking
from klbench.estimators import GRADIENT_ESTIMATORS, gradient_estimator
from klbench.policies import TabularPolicy, build_policy

TABULAR_PROMPT = "<tabular>"
# LMPolicy keeps its models in eval mode on purpose (no dropout: see policies.py); Lightning's notice about it
# would only alarm users at every run
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


def check_config(cfg: DictConfig) -> None:
    """Stop bad input before anything is built or trained, naming the config field."""
    est = cfg.estimator
    if est.name not in GRADIENT_ESTIMATORS:
        raise ValueError(f"estimator.name={est.name!r} is unknown; valid: {', '.join(GRADIENT_ESTIMATORS)}")
    if est.beta < 0:
        raise ValueError(f"estimator.beta must be >= 0, got {est.beta}")
    allowed = GRADIENT_ESTIMATORS[est.name].defaults
    for key in est:
        if key not in ("name", "beta") and key not in allowed:
            raise ValueError(f"estimator.{key} does not apply to estimator {est.name!r} "
                             f"(its options: {', '.join(allowed) or 'none'})")
    try:  # option values (lam, level, clamp) are checked by the estimator itself, before anything is built
        gradient_estimator(est.name, **{k: v for k, v in est.items() if k not in ("name", "beta")})
    except ValueError as e:
        raise ValueError(f"estimator config: {e}") from e
    if cfg.task.name == "pretrain":
        return
    if cfg.task.name == "distill":
        if cfg.get("teacher") is None:
            raise ValueError("task=distill needs a teacher: add model@teacher=<option> (or use experiment=distill)")
        if est.beta != 1:
            raise ValueError(f"task=distill minimises KL(student || teacher) itself: estimator.beta must be 1, "
                             f"got {est.beta} (weight an extra reward with task.reward_coef instead)")
        if cfg.task.reward_coef != 0 and cfg.reward.kind == "none":
            raise ValueError(f"task.reward_coef={cfg.task.reward_coef} needs a reward, but reward=none")
    elif cfg.get("teacher") is not None:
        raise ValueError(f"a teacher (model@teacher) only applies to task=distill, not task={cfg.task.name}")
    n = cfg.task.n_samples
    if est.name == "loo" and n < 2:
        raise ValueError(f"estimator loo needs task.n_samples >= 2 (samples per prompt), got {n}")
    if cfg.reward.kind != "none" and cfg.task.reward_coef != 0 and n < 2:
        raise ValueError(f"the RLOO reward baseline needs task.n_samples >= 2, got {n}")
    if cfg.model.kind == "tabular" and cfg.reward.kind not in ("tabular", "none"):
        raise ValueError(f"model=tabular needs reward=tabular or reward=none (got reward.kind={cfg.reward.kind})")
    if cfg.reward.kind == "tabular" and cfg.model.kind != "tabular":
        raise ValueError(f"reward=tabular needs model=tabular (got model.kind={cfg.model.kind})")
    hw = cfg.hardware
    if hw.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"hardware.accelerator={hw.accelerator} but no CUDA GPU is visible; use hardware=cpu")
    if hw.precision.startswith("bf16") and hw.accelerator in ("gpu", "cuda") and not torch.cuda.is_bf16_supported():
        raise ValueError("hardware.precision=bf16 but this GPU does not support bfloat16")


def build_reward(cfg: DictConfig, policy):
    """The `reward` group. TODO(lead): move into klbench/rewards.py once it lands."""
    if cfg.kind == "none":
        return None
    if cfg.kind == "tabular":
        from klbench.tabular import TabularReward
        return TabularReward(policy.table, seed=cfg.seed, scale=cfg.scale)
    from klbench import rewards
    if cfg.kind == "vader":
        return rewards.VaderReward()
    if cfg.kind == "hf_classifier":
        return rewards.HFClassifierReward(cfg.name_or_path, cfg.label, batch_size=cfg.batch_size, score=cfg.score)
    raise ValueError(f"reward.kind must be vader, hf_classifier, tabular or none; got {cfg.kind!r}")


def build_data(cfg: DictConfig, policy) -> pl.LightningDataModule:
    from klbench.data import PromptData, load_prompts
    t = cfg.task
    if isinstance(policy, TabularPolicy):  # one implicit prompt; the data only sets the batch shape
        # many batches per epoch, so every DDP process gets full batches after the sampler splits them
        return PromptData([TABULAR_PROMPT] * t.prompts_per_step * 64, [TABULAR_PROMPT] * t.val_prompts,
                          t.prompts_per_step, t.val_prompts, cfg.seed)
    train, val = load_prompts(cfg.dataset)
    return PromptData(train, val, t.prompts_per_step, t.val_prompts, cfg.seed)


def build_trainer(cfg: DictConfig, logger, max_steps: int, val_every: int) -> pl.Trainer:
    hw = cfg.hardware
    ckpt = ModelCheckpoint(dirpath=cfg.paths.ckpt_dir, save_last=True, every_n_train_steps=val_every,
                           save_top_k=0)
    return pl.Trainer(accelerator=hw.accelerator, devices=hw.devices, strategy=hw.strategy, precision=hw.precision,
                      num_nodes=hw.num_nodes, max_steps=max_steps, val_check_interval=val_every,
                      check_val_every_n_epoch=None, logger=logger, callbacks=[ckpt],
                      gradient_clip_val=cfg.task.get("grad_clip"), log_every_n_steps=1,
                      num_sanity_val_steps=0, enable_model_summary=False, deterministic=False)


def resolve_ckpt(cfg: DictConfig) -> str | None:
    if cfg.ckpt_path in (None, "null"):
        return None
    path = os.path.join(cfg.paths.ckpt_dir, "last.ckpt") if cfg.ckpt_path == "last" else cfg.ckpt_path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path!r}: no checkpoint at {path}")
    return path


def run(cfg: DictConfig) -> dict[str, float]:
    """Train one run; returns the final validation metrics."""
    check_config(cfg)
    os.makedirs(cfg.paths.outputs, exist_ok=True)
    if cfg.task.name == "pretrain":
        return pretrain_embedded(cfg)
    pl.seed_everything(cfg.seed, workers=True)
    t0 = time.time()
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.outputs, cfg.get("teacher"))
    reward = build_reward(cfg.reward, policy)
    module = build_task(cfg, policy, reward)
    data = build_data(cfg, policy)
    ckpt_path = resolve_ckpt(cfg)
    logger = tracking.build_logger(cfg, resume=ckpt_path is not None)
    trainer = build_trainer(cfg, logger, cfg.task.max_steps, cfg.task.val_every)
    before = None
    if ckpt_path is None:
        trainer.validate(module, datamodule=data, verbose=False)
        before = _val_metrics(trainer.callback_metrics)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    if trainer.global_step % cfg.task.val_every != 0:
        trainer.validate(module, datamodule=data, verbose=False)
    after = _val_metrics(trainer.callback_metrics)
    if trainer.is_global_zero:
        tracking.log_samples(logger, module.sample_tables, cfg)
        _print_summary(before, after, trainer.global_step, time.time() - t0)
    for key in ("val/reward", "val/seq_kl"):
        if not math.isfinite(after.get(key, float("nan"))):
            raise FloatingPointError(f"{key} is {after.get(key)} after training: this run is not usable")
    return after


def _val_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k.startswith("val/")}


def _print_summary(before: dict | None, after: dict, step: int, seconds: float) -> None:
    keys = sorted(after)
    print(f"\nklbench: {step} steps in {seconds:.0f} s")
    print(f"{'metric':<22} {'before (step 0)':>16} {'after (step ' + str(step) + ')':>18}")
    for k in keys:
        b = f"{before[k]:.4f}" if before and k in before else "-"
        print(f"{k:<22} {b:>16} {after[k]:>18.4f}")


def pretrain_embedded(cfg: DictConfig) -> dict[str, float]:
    """task=pretrain: build (or, with task.force, rebuild) the embedded LM that model=embedded describes."""
    import json
    import shutil

    from klbench import models
    from klbench.policies import embedded_spec
    if cfg.model.kind != "embedded":
        raise ValueError(f"task=pretrain builds the embedded LMs: it needs model=embedded, got model.kind={cfg.model.kind}")
    spec = embedded_spec(cfg.model.preset, cfg.model.spec)
    path = models.embedded_lm_dir(spec, cfg.paths.outputs)
    if cfg.task.force and os.path.isdir(path):
        shutil.rmtree(path)
    path = models.ensure_embedded_lm(spec, cfg.paths.outputs)
    with open(os.path.join(path, "pretrain_metrics.json")) as f:
        metrics = json.load(f)
    print(f"klbench: embedded {spec['name']} LM at {path}")
    for k, v in sorted(metrics.items()):
        print(f"  {k:<24} {v}")
    return metrics


def build_task(cfg: DictConfig, policy, reward) -> pl.LightningModule:
    """The `task` group: one LightningModule class per task name."""
    from klbench.tasks.rl import RLTask
    frontier = None
    if isinstance(policy, TabularPolicy) and reward is not None:
        frontier = policy.table.pareto_frontier(reward.table)
    est = OmegaConf.to_container(cfg.estimator, resolve=True)
    task = OmegaConf.to_container(cfg.task, resolve=True)
    if cfg.task.name in ("rl", "distill"):  # distillation is RL with beta = 1 and (by default) no reward
        return RLTask(policy, reward, est, task, frontier)
    raise ValueError(f"task.name={cfg.task.name!r} is unknown; valid: rl, distill, pretrain")
