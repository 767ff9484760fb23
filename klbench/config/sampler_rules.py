"""The rules of task.sampler and task.behaviour across groups (klbench/models/sampler_engine.py, docs/mismatch.md):
each refusal is one line, before any model loads. Read by klbench.config.rules._check_combination."""
from __future__ import annotations

from types import SimpleNamespace

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel

from klbench.config.errors import ConfigError
from klbench.config.training import TaskRL
from klbench.estimators.options import corrects_off_policy
from klbench.estimators.targets import truncates
from klbench.models.sampler_lines import engine_truncation


def check_sampler(cfg: DictConfig, t: TaskRL, e: BaseModel, model: str) -> None:
    """t, e: the validated task and estimator. Nothing to check while the sampler is the trainer."""
    given = t.sampler if isinstance(t.sampler, dict) else t.sampler.model_dump()
    s = SimpleNamespace(**given)
    pg = getattr(t, "pg_correction", None)
    mode = (pg.get("mode") if isinstance(pg, dict) else getattr(pg, "mode", "none")) or "none"
    if mode != "none" and t.inner_steps > 1:
        raise ConfigError(f"task.pg_correction.mode={mode} with task.inner_steps={t.inner_steps}: the correction "
                          "weights the on-policy REINFORCE term, and inner steps train PPO's clipped surrogate on "
                          "pi_old's samples instead; use one of the two")
    if (s.precision, s.attn_implementation, s.lag) == ("same", "same", 0):
        if mode != "none" and model == "tabular" and t.kl_target != "model":
            raise ConfigError(f"task.pg_correction.mode={mode}: with model=tabular the sampler is the table itself "
                              "and keeps no log-probs of its own; set task.sampler.* (an engine that is not the "
                              "trainer) or mode=none")
        return
    what = ", ".join(f"task.sampler.{k}={v}" for k, v in given.items() if v not in ("same", 0))
    if model == "tabular" and s.attn_implementation != "same":
        raise ConfigError(f"task.sampler.attn_implementation={s.attn_implementation}: model=tabular is a table of "
                          "logits, with no attention; use a language model or attn_implementation=same")
    hw = OmegaConf.select(cfg, "hardware.strategy")
    if hw == "fsdp2":
        raise ConfigError(f"{what} copies the whole policy into a rollout engine, and hardware=fsdp shards it over "
                          "ranks: use hardware=cpu, gpu or ddp")
    if s.lag and t.inner_steps > 1:
        raise ConfigError(f"task.sampler.lag={s.lag} with task.inner_steps={t.inner_steps}: the lag counts optimiser "
                          "steps between a rollout's weights and the step that trains on it; choose one of the two")
    if t.behaviour == "sampler":
        if truncates(t.top_k, t.top_p):
            cut = ", ".join([f"top_k={t.top_k}"] * (t.top_k > 0) + [f"top_p={t.top_p:g}"] * (t.top_p < 1))
            raise ConfigError(engine_truncation(what, cut))
        if not corrects_off_policy(e.name, getattr(e, "ratio", None)):
            raise ConfigError(f"{what} draws the rollouts with an engine that is not the trainer, and "
                              f"task.behaviour=sampler gives the batch its log-probs as the behaviour policy, but "
                              f"estimator {e.name}" + (" with ratio=none" if e.name == "in_loss" else "") +
                              " assumes y ~ pi: use estimator=rb, in_reward, or in_loss with estimator.ratio="
                              "token|sequence, or task.behaviour=scorer (the mismatch then stays invisible to it)")
        ctl = OmegaConf.select(cfg, "kl_ctl.name")
        if ctl not in (None, "fixed"):
            raise ConfigError(f"kl_ctl={ctl} with {what} and task.behaviour=sampler is not supported: the "
                              "controller's KL signal is a value estimate, which needs y ~ pi; use kl_ctl=fixed")
    if s.precision != "same":
        from klbench.models.sampler_engine import check_device
        accelerator = OmegaConf.select(cfg, "hardware.accelerator") or "cpu"
        if accelerator == "auto":  # Lightning's choice: a GPU where torch sees one
            import torch
            accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        check_device(s.precision, "cuda" if accelerator == "gpu" else accelerator)
