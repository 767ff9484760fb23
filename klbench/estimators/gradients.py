"""Gradient estimators: a surrogate per sequence whose autograd is one sample of a gradient.

Each docstring states the surrogate and its expected gradient over y ~ pi; the tabular
tests check those statements exactly. naive_mc and naive_cv are wrong on purpose.
Under a temperature / top-k / top-p sampling, "pi, pi_ref" is the pair of the KL target
(klbench.estimators.sampling): target=sampler keeps every statement exactly; target=model leaves only rb
(off-policy) serving; tempered targets under truncation bias every estimator (docs/sampling.md,
tests/test_sampling_exact.py).
"""
from __future__ import annotations

import torch

from klbench.estimators.base import (GRADIENT_ESTIMATORS, Estimate, Estimator, control_variate, prefix_weights,
                                     register, reward_to_go, seq_sum)
from klbench.estimators.batch import KLBatch
from klbench.estimators.baselines import leave_one_out_mean
from klbench.estimators.options import ControlVariateOptions

gradient = register(GRADIENT_ESTIMATORS)


@gradient
class NaiveMC(Estimator):
    """naive_mc: autodiff through k1, L = sum_t rho_t. Expected gradient: ZERO (pitfall 1).

    E_pi[grad log pi(y)] = 0, so this only adds noise: it never regularises.
    """

    name = "naive_mc"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return seq_sum(batch.rho)


@gradient
class NaiveCV(Estimator):
    """naive_cv: autodiff through cv with multiplier lam (pitfall 2: the wrong KL direction).

    level="sequence": L = rho + lam (exp(-rho) - 1); expected gradient lam * grad kl_ref_pi = lam * grad KL(pi_ref || pi).
    level="token":    L = sum_t [rho_t + lam (exp(-rho_t) - 1)]; expected gradient
                      lam * E_y[sum_t grad KL(pi_ref(.|y_<t) || pi(.|y_<t))], prefix held fixed.
    level="token", lam=1 is the GRPO / verl low_var_kl / OpenRLHF k3 loss. With clamp=c,
    `estimate(batch).n_clamped` counts the clamps that fired.
    """

    name = "naive_cv"
    defaults = ControlVariateOptions().model_dump()

    def compute(self, batch: KLBatch) -> Estimate:
        return control_variate(batch, self.lam, self.level, self.clamp)


@gradient
class Token(Estimator):
    """token: L = sum_t sg(rho_t) l_t (same gradient as autodiff of k2). Pitfall 3: a partial gradient.

    Expected gradient: E_y[sum_t grad KL(pi(.|y_<t) || pi_ref(.|y_<t))] with the prefix held fixed;
    it misses how y_t changes the later positions' KL.
    """

    name = "token"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return seq_sum(batch.rho.detach() * batch.masked_logp)


@gradient
class Seq(Estimator):
    """seq: L = sg(rho) sum_t l_t (REINFORCE with the sequence log-ratio). Expected gradient: grad kl_pi_ref."""

    name = "seq"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return seq_sum(batch.rho.detach()) * seq_sum(batch.masked_logp)


@gradient
class Cumulative(Estimator):
    """cumulative: L = sum_t sg(sum_{s>=t} rho_s) l_t. Expected gradient: grad kl_pi_ref, usually lower variance than seq.

    l_t only multiplies the log-ratios that y_t can influence (s >= t), dropping pure-noise terms of seq.
    """

    name = "cumulative"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        return seq_sum(reward_to_go(batch.rho.detach()) * batch.masked_logp)


@gradient
class LOO(Estimator):
    """loo: L_i = sg(rho_i - mean_{j != i, same prompt} rho_j) sum_t l_{t,i}. Expected gradient: grad kl_pi_ref.

    Needs `group` in the batch and at least 2 samples per prompt.
    """

    name = "loo"

    def compute(self, batch: KLBatch) -> torch.Tensor:
        r = seq_sum(batch.rho.detach())  # [B]
        return (r - leave_one_out_mean(r, batch.group, "loo")) * seq_sum(batch.masked_logp)


@gradient
class RB(Estimator):
    """rb: L = sum_t kappa_t + sum_t sg(sum_{s>t} kappa_s) l_t. Expected gradient: grad kl_pi_ref, usually the lowest
    variance (not always: tests/test_tabular.py::test_variance_orderings_can_reverse).

    Off-policy (KLBatch.old_logp, y ~ pi_old): prefix importance weights, see _off_policy; expected
    gradient under y ~ pi_old: grad kl_pi_ref.

    KL = E_y[sum_t kappa_t(y_<t)]: the first sum is the path-wise part (prefix fixed), the second the
    score-function part for the prefix, with a future-only reward-to-go of the exact per-position KL.
    """

    name = "rb"
    kappa_gradient = reads_kappa = True
    off_policy = True

    def compute(self, batch: KLBatch) -> torch.Tensor:
        kappa = batch.kappa  # [B, T], differentiable through logits
        if batch.old_logp is not None:
            return self._off_policy(batch, kappa)
        future = reward_to_go(kappa.detach()) - kappa.detach()  # [B, T]: sum_{s>t} kappa_s
        return seq_sum(kappa) + seq_sum(future * batch.masked_logp)

    @staticmethod
    def _off_policy(batch: KLBatch, kappa: torch.Tensor) -> torch.Tensor:
        """y ~ pi_old: each term is weighted by the importance ratio of the prefix it depends on, so the
        expected gradient is still grad kl_pi_ref (no truncation: exact, possibly high variance).

        L = sum_t sg(W_<t) kappa_t + sum_t sg(sum_{s>t} W_<s kappa_s) l_t, W_<t = prod_{s<t} pi/pi_old.
        At old_logp == logp every weight is exactly 1 and L equals the on-policy surrogate.
        """
        w_prefix = prefix_weights(batch)  # [B, T]: W_<t, the ratio of y_<t
        wk = w_prefix * kappa.detach()  # [B, T]
        future = reward_to_go(wk) - wk  # [B, T]: sum_{s>t} W_<s kappa_s
        return seq_sum(w_prefix * kappa) + seq_sum(future * batch.masked_logp)
