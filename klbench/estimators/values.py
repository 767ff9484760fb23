"""Value estimators: a detached number per sampled sequence whose mean estimates KL(pi || pi_ref).

Under a temperature / top-k / top-p sampling, (pi, pi_ref) is the pair of the KL target
(klbench.estimators.sampling): mc, cv and rb stay unbiased at target=sampler; at target=model only rb serves
(prefix importance weights); tempered targets under truncation bias them all (docs/sampling.md).
"""
from __future__ import annotations

import torch

from klbench.estimators.base import (VALUE_ESTIMATORS, Estimate, Estimator, control_variate, prefix_weights, register,
                                     seq_sum)
from klbench.estimators.batch import KLBatch
from klbench.estimators.options import ControlVariateOptions

value = register(VALUE_ESTIMATORS)


@value
class MC(Estimator):
    """mc (Schulman's k1): rho = sum_t rho_t. Unbiased; a single sample can be negative."""

    name = "mc"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return seq_sum(batch.rho).detach()


@value
class K2(Estimator):
    """k2: 1/2 sum_t rho_t^2. Biased; this is what "mse" KL losses use."""

    name = "k2"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return 0.5 * seq_sum(batch.rho.detach() ** 2)


@value
class CV(Estimator):
    """cv: control variate with multiplier lam. Unbiased because E_pi[exp(-rho) - 1] = 0.

    level="token":    sum_t [rho_t + lam (exp(-rho_t) - 1)]   (lam=1 is Schulman's k3)
    level="sequence": rho + lam (exp(-rho) - 1)
    With clamp=c the estimate is clamped to [-c, c] (per token or per sequence), and
    `estimate(batch).n_clamped` counts the clamps that fired, so that none goes unseen.
    """

    name = "cv"
    defaults = ControlVariateOptions().model_dump()

    def compute(self, batch: KLBatch) -> Estimate:
        out = control_variate(batch, self.lam, self.level, self.clamp)
        return Estimate(out.values.detach(), out.n_clamped)


@value
class CVOpt(Estimator):
    """cv_opt: sequence-level cv with lam fitted on the batch to minimise variance (paper 001's optimal alpha).

    lam* = -Cov(rho, e^-rho - 1) / Var(e^-rho - 1) over the batch (0 when that variance is 0, where every
    lam gives the same estimate). Unbiased only asymptotically, since lam* depends on the same samples.
    The multiplier fitted on a batch is `estimate(batch).fitted_lam`.
    """

    name = "cv_opt"

    def compute(self, batch: KLBatch) -> Estimate:
        r = seq_sum(batch.rho.detach())  # [B]
        if r.numel() < 2:
            raise ValueError("cv_opt fits its multiplier on the batch and needs at least 2 sequences")
        c = torch.expm1(-r)  # [B], zero-mean control variate under pi
        c_centered = c - c.mean()
        var = (c_centered ** 2).mean()
        lam = -((r - r.mean()) * c_centered).mean() / var if var > 0 else torch.zeros_like(var)
        return Estimate(r + lam * c, fitted_lam=float(lam))


@value
class RB(Estimator):
    """rb (Rao-Blackwellised): sum_t kappa_t, the exact per-position KL over the vocabulary.

    Unbiased, never negative; its variance is usually well below mc's, but not always (an exact counterexample at
    4.8x mc's: tests/test_tabular.py::test_variance_orderings_can_reverse). Needs logits and ref_logits in the batch.
    Off-policy (KLBatch.old_logp, y ~ pi_old): sum_t W_<t kappa_t, each position's KL weighted by the importance
    ratio of its prefix W_<t = prod_{s<t} pi/pi_old; unbiased for kl_pi_ref under y ~ pi_old (pi_old covering pi),
    e.g. task.kl_target=model, where pi_old is the tempered sampler. Exactly the on-policy value when old_logp = logp.
    """

    name = "rb"
    off_policy = True

    def compute(self, batch: KLBatch) -> torch.Tensor:
        if batch.old_logp is None:
            return seq_sum(batch.kappa).detach()
        return seq_sum(prefix_weights(batch) * batch.kappa.detach())

