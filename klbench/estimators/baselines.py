"""The leave-one-out baseline, shared by the `loo` estimator, the in-reward placement family, the RLOO
reward advantage of the RL task and the example losses: one implementation, one error message."""
from __future__ import annotations

import torch


def leave_one_out_mean(x: torch.Tensor, group: torch.Tensor | None, who: str) -> torch.Tensor:
    """[B] the mean of x over the other samples of the same prompt.

    x: [B]; group: [B] prompt ids. Independent of sample i itself, so subtracting it from a score-function
    coefficient adds no bias. `who` names the caller in the errors (no group, or a prompt sampled once).
    """
    if group is None:
        raise ValueError(f"{who} needs KLBatch.group: prompt ids, with n >= 2 samples per prompt")
    _, inverse, counts = torch.unique(group, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError(f"{who} needs n >= 2 samples per prompt; group sizes found: {sorted(set(counts.tolist()))}")
    totals = torch.zeros(len(counts), dtype=x.dtype, device=x.device).index_add_(0, inverse, x)  # [G]
    return (totals[inverse] - x) / (counts[inverse] - 1).to(x.dtype)


def rloo_advantage(reward: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[B] r_i - mean_{j != i in the same group} r_j. One sample per prompt has no baseline: the schema
    allows that only without a reward term, where the reward is 0."""
    if len(torch.unique(group)) == len(group):
        return reward
    return reward - leave_one_out_mean(reward, group, "the RLOO reward baseline")
