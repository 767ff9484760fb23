"""KL losses as people write them in RL trainers today, to audit against the tabular ground truth.

Each takes a KLBatch and returns one loss per sequence [B], the shape `klbench.exact.tabular.audit` expects:

    from klbench.exact.examples import grpo_k3_loss
    from klbench.exact.tabular import audit
    print(audit(grpo_k3_loss))   # -> partial_kl_ref_pi: not the KL the objective names
"""
from __future__ import annotations

import torch

from klbench.estimators import KLBatch
from klbench.estimators.baselines import leave_one_out_mean


def grpo_k3_loss(batch: KLBatch) -> torch.Tensor:
    """GRPO-style KL term: Schulman's k3 per token, autodiffed, summed over the response. [B]

    k3 = exp(ref - logp) - (ref - logp) - 1 = exp(-r) - 1 + r with r = logp - ref_logp.
    """
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    # padding log-probs may be -inf: zero them before exp, not after, or 0 * inf poisons the gradient
    r = torch.where(batch.mask, batch.logp - batch.ref_logp, zero)  # [B, T]
    per_token_kl = torch.exp(-r) - 1 + r  # [B, T]
    return (per_token_kl * batch.mask).sum(-1)


def rloo_k1_in_reward_loss(batch: KLBatch, reward: torch.Tensor | None = None, beta: float = 1.0) -> torch.Tensor:
    """RLOO-style: the k1 sequence log-ratio is subtracted from the reward (no gradient through it), a
    leave-one-out baseline over the samples of a prompt, REINFORCE through sum_t l_t. [B]

    reward: [B] task reward (zero by default, which leaves only the KL part). Needs `batch.group`.
    """
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(batch.mask, batch.logp, zero)  # [B, T]
    kl = (logp - torch.where(batch.mask, batch.ref_logp, zero)).sum(-1).detach()  # [B] k1 per sequence
    score = torch.zeros_like(kl) if reward is None else reward.to(kl.dtype)
    rlhf_reward = score - beta * kl  # [B]
    # leave-one-out baseline: mean reward of the other samples of the same prompt
    advantage = rlhf_reward - leave_one_out_mean(rlhf_reward, batch.group, "rloo_k1_in_reward_loss")  # [B]
    return -advantage * logp.sum(-1)


def grpo_k3_bias_corrected_loss(batch: KLBatch) -> torch.Tensor:
    """TRL GRPO with `use_bias_correction_kl`: k3 times the per-token importance ratio pi / pi_old. [B]

    As TRL writes it: old log-probs are the rollout's (batch.old_logp), or the current ones detached when
    each rollout gets a single optimiser step. The ratio is not detached: even where it is 1 in value it
    carries grad l_t, which turns the k3 gradient into w_t rho_t grad l_t.
    """
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(batch.mask, batch.logp, zero)  # [B, T]
    r = logp - torch.where(batch.mask, batch.ref_logp, zero)  # [B, T]
    old = logp.detach() if batch.old_logp is None else torch.where(batch.mask, batch.old_logp, zero)  # [B, T]
    ratio = torch.exp(logp - old)  # [B, T]: TRL's coef_1, differentiable
    per_token_kl = (torch.exp(-r) - 1 + r) * ratio
    return (per_token_kl * batch.mask).sum(-1)


def k2_mse_loss(batch: KLBatch) -> torch.Tensor:
    """verl "mse" / k2 KL loss: 1/2 (logp - ref_logp)^2 per token, autodiffed, summed. [B]"""
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    r = torch.where(batch.mask, batch.logp - batch.ref_logp, zero)  # [B, T]
    return 0.5 * (r ** 2).sum(-1)


def openrlhf_unbiased_gradient_loss(batch: KLBatch, max_weight: float | None = None) -> torch.Tensor:
    """OpenRLHF `compute_approx_kl(..., unbiased_gradient=True)` with k3: the value of k3, the gradient of
    w_t * k1_t * grad l_t with a detached, clamped weight w_t = min(pi / pi_old, max_weight). [B]

    A straight-through loss: k3 forward, and a term that is zero in value and carries the gradient.
    OpenRLHF clamps w at a fixed constant (KL_IS_WEIGHT_CLIP); max_weight=None leaves w unclamped.
    """
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(batch.mask, batch.logp, zero)  # [B, T]
    r = logp - torch.where(batch.mask, batch.ref_logp, zero)  # [B, T] k1 per token
    k3 = torch.exp(-r) - 1 + r  # [B, T]
    old = logp.detach() if batch.old_logp is None else torch.where(batch.mask, batch.old_logp, zero)
    w = torch.exp(logp.detach() - old)  # [B, T], detached importance weight
    if max_weight is not None:
        w = w.clamp(max=max_weight)
    per_token = k3.detach() + (w * r).detach() * (logp - logp.detach())  # value k3, gradient w k1 grad l
    return (per_token * batch.mask).sum(-1)
