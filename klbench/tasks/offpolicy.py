"""task.inner_steps > 1: each rollout batch is reused for that many optimiser steps (GRPO num_iterations, PPO epochs).

Step i of a rollout (i = global_step mod inner_steps) trains on samples from pi_old, the policy at step 0 of the
rollout. The reward term is PPO's clipped surrogate with the per-token ratio w_t = pi(y_t|y_<t) / pi_old(y_t|y_<t)
and the rollout's advantage A (task.advantage, fixed for the rollout), aggregated as task.loss_agg
(klbench/estimators/advantages.py; seq_sum shown):

    loss_reward = -mean_i sum_t min(w_t A_i, clip(w_t, 1 - clip_eps, 1 + clip_eps) A_i)

At w = 1 (step 0) its gradient is the on-policy RLOO gradient. The KL term is beta x the configured gradient
estimator on a KLBatch that carries old_logp (schema.py admits only estimators that correct for pi_old).

The rollout lives in memory only: schema.py requires task.val_every and task.max_steps to be multiples of
inner_steps, so every checkpoint (made at validations and at the end) falls on a rollout boundary and a resume
draws the next rollout exactly as the uninterrupted run does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from klbench.estimators.advantages import aggregate
from klbench.models.policies import Rollout
from klbench.tasks.step import backward_in_parts


@dataclass
class CachedRollout:
    ro: Rollout
    reward: torch.Tensor  # [B]
    adv: torch.Tensor  # [B] task.advantage
    old_logp: torch.Tensor  # [B, T] the KL batch's behaviour log-probs at the rollout, detached
    old_sampler_logp: torch.Tensor  # [B, T] log pi_s,old of the sampled tokens (the reward's PPO ratio), detached


def ppo_reward_loss(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                    clip_eps: float, loss_agg: tuple[str, int | None] = ("seq_sum", None)
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clipped reward loss (scalar, aggregated as loss_agg = (task.loss_agg, L_max)) and its ratio statistics.

    logp, old_logp: [B, T]; mask: [B, T] bool; adv: [B]. Statistics over real tokens: `ratio_mean` (mean w_t)
    and `clip_frac`, the fraction of tokens whose gradient the clip removes (w_t > 1 + eps with A > 0, or
    w_t < 1 - eps with A < 0).
    """
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_w = torch.where(mask, logp, zero) - torch.where(mask, old_logp, zero)  # [B, T], zero off the mask
    w = torch.exp(log_w)  # [B, T]
    a = adv.to(logp.dtype).unsqueeze(-1)  # [B, 1]
    per_token = torch.minimum(w * a, w.clamp(1 - clip_eps, 1 + clip_eps) * a)  # [B, T]
    loss = -aggregate(per_token, mask, *loss_agg)
    with torch.no_grad():
        clipped = ((w > 1 + clip_eps) & (a > 0)) | ((w < 1 - clip_eps) & (a < 0))  # [B, T]
        n = mask.sum().clamp(min=1)
        stats = {"train/ratio_mean": w[mask].sum() / n, "train/clip_frac": (clipped & mask).sum() / n}
    return loss, stats


def off_policy_step(task, prompts: list[str]) -> torch.Tensor:
    """One optimiser step of RLTask with task.inner_steps > 1 (see the module docstring)."""
    k, step = int(task.cfg["inner_steps"]), task.global_step
    i = step % k
    if i == 0:
        ro = task.policy.rollout(prompts, task.cfg["n_samples"])
        reward = task.rewards(ro)  # [B]
    elif task.cached_rollout is None:
        raise RuntimeError(f"step {step} is step {i} of a rollout, but no rollout is cached: a checkpoint off a "
                           f"rollout boundary? task.val_every and task.max_steps must be multiples of {k}")
    else:
        ro, reward = task.cached_rollout.ro, task.cached_rollout.reward
    where = f"step {step} (step {i} of its rollout)"

    def loss_fn(batch):
        slogp = task.policy.sampler_logp(ro, batch)  # [B, T]
        if i == 0:  # pi_old is this very policy: the behaviour log-probs are the batch's own, detached
            # (log pi_s for kl_target=model off plain sampling, which the batch carries already)
            old = batch.old_logp if batch.old_logp is not None else batch.logp.detach()
            old_s, adv = slogp.detach(), task.reward_advantage(batch, reward, ro.group)
        else:
            c = task.cached_rollout
            old, old_s, adv = c.old_logp, c.old_sampler_logp, c.adv
        loss_reward, stats = ppo_reward_loss(slogp, old_s, batch.mask, adv, float(task.cfg["clip_eps"]),
                                             task.loss_agg)
        loss, n_clamped = task.total_loss(replace(batch, old_logp=old), loss_reward, where)
        return loss, (n_clamped, stats, old, old_s, adv, slogp.detach())

    scoring = task.policy.scoring(ro, task.micro_batch_size, task.needs_kappa(step))
    batch, loss, (n_clamped, stats, old, old_s, adv, slogp) = backward_in_parts(task.policy, scoring, loss_fn)
    if i == 0:
        task.cached_rollout = CachedRollout(ro, reward, adv, old, old_s)
    if task.logging_step(step):
        if i == 0:  # on-policy samples: every value estimator is valid
            task._log_train(batch, reward, ro, loss, n_clamped, slogp)
        else:  # value estimators assume y ~ pi: the train/kl_* metrics are logged at rollout starts only
            m = {"train/reward": reward.mean(), "train/loss": loss.detach(),
                 "train/response_len": batch.mask.sum(-1).float().mean()}
            if n_clamped is not None:
                m["train/n_clamped"] = float(n_clamped)
            task._log_now(m)
        task._log_now(stats)
    control = getattr(task, "_control_beta", None)  # the beta controller (kl_ctl) logs this step's beta
    if control is not None:
        control(batch)  # kl_ctl=fixed only (schema.py): no value estimate is read from these samples
    return loss
