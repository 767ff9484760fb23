"""Two KL losses as people write them in RL trainers today, to audit against the tabular ground truth.

Both take a KLBatch and return one loss per sequence [B], the shape `klbench.tabular.audit` expects:

    from klbench.examples import grpo_k3_loss
    from klbench.tabular import audit
    print(audit(grpo_k3_loss))   # -> partial_kl_ref_pi: not the KL the objective names
"""
from __future__ import annotations

import torch

from klbench.estimators import KLBatch


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
    if batch.group is None:
        raise ValueError("rloo_k1_in_reward_loss needs KLBatch.group: prompt ids, n >= 2 samples per prompt")
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(batch.mask, batch.logp, zero)  # [B, T]
    kl = (logp - torch.where(batch.mask, batch.ref_logp, zero)).sum(-1).detach()  # [B] k1 per sequence
    score = torch.zeros_like(kl) if reward is None else reward.to(kl.dtype)
    rlhf_reward = score - beta * kl  # [B]
    # leave-one-out baseline: mean reward of the other samples of the same prompt
    _, inverse, counts = torch.unique(batch.group, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError("rloo_k1_in_reward_loss needs n >= 2 samples per prompt")
    totals = torch.zeros(len(counts), dtype=kl.dtype, device=kl.device).index_add_(0, inverse, rlhf_reward)  # [G]
    baseline = (totals[inverse] - rlhf_reward) / (counts[inverse] - 1).to(kl.dtype)  # [B]
    advantage = rlhf_reward - baseline  # [B]
    return -advantage * logp.sum(-1)


def grpo_k3_bias_corrected_loss(batch: KLBatch) -> torch.Tensor:
    """TRL GRPO with `use_bias_correction_kl`, on-policy: k3 times the importance ratio pi / sg(pi). [B]

    The ratio is 1 in value but carries grad l_t, which turns the k3 gradient into rho_t * grad l_t.
    """
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    logp = torch.where(batch.mask, batch.logp, zero)  # [B, T]
    r = logp - torch.where(batch.mask, batch.ref_logp, zero)  # [B, T]
    ratio = torch.exp(logp - logp.detach())  # [B, T], on-policy: old policy = current policy
    per_token_kl = (torch.exp(-r) - 1 + r) * ratio
    return (per_token_kl * batch.mask).sum(-1)


def k2_mse_loss(batch: KLBatch) -> torch.Tensor:
    """verl "mse" / k2 KL loss: 1/2 (logp - ref_logp)^2 per token, autodiffed, summed. [B]"""
    zero = torch.zeros((), dtype=batch.logp.dtype, device=batch.logp.device)
    r = torch.where(batch.mask, batch.logp - batch.ref_logp, zero)  # [B, T]
    return 0.5 * (r ** 2).sum(-1)
