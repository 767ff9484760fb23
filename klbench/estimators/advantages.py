"""The reward term of the RL loss: the advantage of each sampled response (`task.advantage`) and how the
per-token terms are summed into one loss (`task.loss_agg`). Pure torch; the RL task (klbench/tasks/rl.py)
calls these, ppo_reward_loss at task.inner_steps > 1.

Notation: B responses, n per prompt (a group g(i)), r_i the reward, |y_i| the number of real tokens of
response i, l_{i,t} = log pi(y_{i,t} | y_{i,<t}), x_{i,t} the per-token term (A_i l_{i,t} on-policy, PPO's
clipped term off-policy).

Advantages, A_i (all detached: the reward does not depend on theta):
    rloo       r_i - mean_{j != i, g(j) = g(i)} r_j                      (leave-one-out; unbiased)
    grpo       (r_i - mean_g r) / (std_g r + eps)                      (GRPO; std with Bessel's n - 1, as
                                                                        TRL and verl compute it; eps =
                                                                        task.adv_eps: verl 1e-6, TRL 1e-4)
    dr_grpo    r_i - mean_g r                                          (Dr. GRPO: no std; the mean includes
                                                                        r_i, so E[grad] = (1 - 1/n) grad E[r])
    reinforce  r_i - mean_{all j in the batch} r_j                     (REINFORCE with the batch mean;
                                                                        E[grad] = (1 - 1/B) grad E[r])

Loss aggregations, the scalar L whose gradient is the reward term (minus the objective's):
    seq_sum              L = -(1/B) sum_i sum_t x_{i,t}                      (klbench's; REINFORCE's; verl
                                                                              seq-mean-token-sum)
    token_mean           L = -(sum_i sum_t x_{i,t}) / (sum_i |y_i|)          (DAPO; TRL loss_type=dapo/bnpo,
                                                                              verl loss_agg_mode=token-mean)
    seq_mean_token_mean  L = -(1/B) sum_i (1/|y_i|) sum_t x_{i,t}            (GRPO's original; TRL loss_type=grpo,
                                                                              verl seq-mean-token-mean)
    seq_sum_norm         L = -(1/(B L_max)) sum_i sum_t x_{i,t}              (Dr. GRPO; TRL loss_type=dr_grpo,
                                                                              verl seq-mean-token-sum-norm;
                                                                              L_max = task.max_new_tokens)
seq_sum and seq_sum_norm differ by the constant L_max only (a learning-rate change); token_mean and
seq_mean_token_mean weight a response's gradient by a length that depends on the sample, so their expected
gradient is no longer grad E[r] (docs/rlvr.md).
"""
from __future__ import annotations

import torch

from klbench.estimators.baselines import rloo_advantage
from klbench.estimators.options import ADVANTAGES, LOSS_AGGS


def group_stats(x: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] mean and [B] unbiased std (n - 1) of x over each sample's group. x: [B]; group: [B] prompt ids."""
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError(f"a group advantage needs n >= 2 samples per prompt; group sizes found: "
                         f"{sorted(set(counts.tolist()))}")
    c = counts.to(x.dtype)  # [G]
    mean = torch.zeros(len(counts), dtype=x.dtype, device=x.device).index_add_(0, inverse, x) / c  # [G]
    dev = (x - mean[inverse]) ** 2  # [B]
    var = torch.zeros_like(mean).index_add_(0, inverse, dev) / (c - 1)  # [G]
    return mean[inverse], var.sqrt()[inverse]


def advantage(reward: torch.Tensor, group: torch.Tensor, kind: str, eps: float = 1e-6) -> torch.Tensor:
    """[B] the detached advantage `kind` (module docstring) of rewards [B] with prompt ids group [B]."""
    r = reward.detach()
    if kind == "rloo":
        return rloo_advantage(r, group)
    if kind == "reinforce":
        return r - r.mean()
    if kind in ("grpo", "dr_grpo"):
        mean, std = group_stats(r, group)
        return (r - mean) / (std + eps) if kind == "grpo" else r - mean
    raise ValueError(f"task.advantage must be one of {', '.join(ADVANTAGES)}; got {kind!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, kind: str, max_len: int | None = None) -> torch.Tensor:
    """The scalar aggregation `kind` (module docstring, without its minus sign) of per_token [B, T] over the
    real tokens mask [B, T] bool. max_len: L_max of seq_sum_norm."""
    x = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))  # [B, T]
    if kind == "seq_sum":
        return x.sum(-1).mean()
    if kind == "token_mean":
        return x.sum() / mask.sum().clamp(min=1)
    if kind == "seq_mean_token_mean":
        return (x.sum(-1) / mask.sum(-1).clamp(min=1).to(x.dtype)).mean()
    if kind == "seq_sum_norm":
        if not max_len or max_len < 1:
            raise ValueError(f"loss_agg='seq_sum_norm' needs max_len >= 1 (task.max_new_tokens), got {max_len!r}")
        return x.sum(-1).mean() / max_len
    raise ValueError(f"task.loss_agg must be one of {', '.join(LOSS_AGGS)}; got {kind!r}")


def reward_loss(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, kind: str,
                max_len: int | None = None) -> torch.Tensor:
    """The on-policy reward term: -aggregate(A_i l_{i,t}). adv: [B] detached; logp, mask: [B, T]."""
    return -aggregate(adv.detach().to(logp.dtype).unsqueeze(-1) * logp, mask, kind, max_len)


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
