"""The mismatch meter: how far the sampler's distribution (the rollout engine's, pi_s) is from the scorer's (the
trainer's, pi), per token, from the two log-probs of each sampled token alone (docs/mismatch.md).

    mismatch_metrics(sampler_logp, scorer_logp, mask) -> {"mismatch_k1", "mismatch_k3", "mismatch_chi2", ...}

With r = pi(y_t) / pi_s(y_t) and y_t ~ pi_s, the masked token means are unbiased for, per position:
  mismatch_k1    -log r                  KL(pi_s || pi)
  mismatch_k3    r - 1 - log r           KL(pi_s || pi) too, never negative per token; where pi_s cuts tokens pi
                                         keeps (top-p, top-k) its mean falls short by the mass pi puts on them
  mismatch_chi2  (r - 1)^2               chi^2(pi || pi_s) = Var_{pi_s}[r]: the variance of the IS weight a
                                         correction multiplies by (its effective sample size is 1 / (1 + chi^2))
  mismatch_max_abs  max |log r|          the worst token (what a truncation or mask threshold sees)
Pure torch, detached, no state: a logging helper, never part of a loss.
"""
from __future__ import annotations

import torch


# chi^2 of the sampler against the scorer above which a run's end says so: the samples' effective size is
# 1 / (1 + chi^2) of their number, so 0.1 loses about 9% of it
MISMATCH_CHI2_LARGE = 0.1


def mismatch_metrics(sampler_logp: torch.Tensor, scorer_logp: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """0-dim float tensors; sampler_logp, scorer_logp, mask: [B, T] (mask bool: real response tokens)."""
    shapes = {"sampler_logp": sampler_logp, "scorer_logp": scorer_logp, "mask": mask}
    for name, t in shapes.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"mismatch_metrics: {name} must be a tensor, got {type(t).__name__}")
    if sampler_logp.shape != scorer_logp.shape or mask.shape != scorer_logp.shape:
        raise ValueError(f"mismatch_metrics: sampler_logp {tuple(sampler_logp.shape)}, scorer_logp "
                         f"{tuple(scorer_logp.shape)} and mask {tuple(mask.shape)} must have one shape [B, T]")
    m = mask.bool()
    s, q = sampler_logp.detach().double(), scorer_logp.detach().double()
    if not (torch.isfinite(s[m]).all() and torch.isfinite(q[m]).all()):
        raise ValueError("mismatch_metrics: non-finite log-probs on masked-in tokens (a token the sampler or the "
                         "scorer gives probability 0 was sampled: the two do not share support)")
    n = m.sum().clamp(min=1)
    log_r = torch.where(m, q - s, torch.zeros((), dtype=s.dtype))  # [B, T] log pi / pi_s, 0 on padding
    r = log_r.exp()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return (torch.where(m, x, torch.zeros((), dtype=x.dtype)).sum() / n).float()

    return {"mismatch_k1": mean(-log_r), "mismatch_k3": mean(r - 1 - log_r), "mismatch_chi2": mean((r - 1) ** 2),
            "mismatch_max_abs": log_r.abs().max().float() if bool(m.any()) else torch.zeros(())}
