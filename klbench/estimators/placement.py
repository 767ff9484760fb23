"""Placement as an axis: any per-sample KL value put in the reward (`in_reward`) or autodiffed in the loss (`in_loss`).

"A Comedy of Estimators" (arXiv 2512.21852) names KL configurations by value estimator x placement: k1 or
k3, added to the reward (no gradient through it: score function) or to the loss (autodiffed). Both families
take the value as an option, `value` in {k1, k2, k3, cv} (cv: `lam`, `level` as in the `cv` value estimator;
k1 = cv lam=0, k3 = cv lam=1 token level), so that every cell of the grid has a name:

    in_reward(value=k1) == seq          in_reward(value=k1, form=reward_to_go) == cumulative
    in_reward(value=k1, baseline=loo) == loo
    in_loss(value=k1) == naive_mc       in_loss(value=k3) == naive_cv (token)    in_loss(value=k2): same gradient as token

(equal sample by sample on-policy; tests/test_placement.py checks it). Both also take samples from a
behaviour policy pi_old (KLBatch.old_logp, several optimiser steps per rollout) and correct for them with
importance ratios w_t = pi(y_t|y_<t) / pi_old(y_t|y_<t). Notation: W = prod_t w_t (sequence ratio),
W_<=t = prod_{s<=t} w_s (prefix ratio); v the per-sequence value, v_t its per-token terms.

The general identity behind the grid: for a value v(y; theta),
    grad E_pi[v] = E_pi[v grad log pi(y)]  (score part: in_reward)  +  E_pi[grad v]  (path-wise part: in_loss).
Only where one part vanishes or is itself a KL gradient does a single placement give grad kl_pi_ref.

Under a sampling (klbench.estimators.sampling) every statement holds for the KL target's pair: `sampler` keeps the
on-policy grid at any temperature and truncation, `model` (a temperature alone) is the off-policy grid with
pi_old = pi_s, and a tempered target under truncation leaves every cell biased (docs/sampling.md).
"""
from __future__ import annotations

from typing import Any

import torch

from klbench.estimators.base import GRADIENT_ESTIMATORS, Estimate, Estimator, register, reward_to_go, seq_sum
from klbench.estimators.batch import KLBatch
from klbench.estimators.baselines import leave_one_out_mean
from klbench.estimators.options import InLossOptions, InRewardOptions, literal_choices, renamed

gradient = register(GRADIENT_ESTIMATORS)


def value_terms(batch: KLBatch, value: str, lam: float, level: str) -> tuple[torch.Tensor, bool]:
    """The per-sample KL value, differentiable: ([B, T] per-token terms zero off the mask, True) or
    ([B] per-sequence values, False) for cv at sequence level."""
    rho = batch.rho  # [B, T], zero off the mask (so expm1(-0) = 0 adds nothing there)
    if value == "k1":
        return rho, True
    if value == "k2":
        return 0.5 * rho ** 2, True
    if value == "k3":
        return rho + torch.expm1(-rho), True
    if level == "token":
        return rho + lam * torch.expm1(-rho), True
    r = seq_sum(rho)  # [B]
    return r + lam * torch.expm1(-r), False


def loo_mean(x: torch.Tensor, group: torch.Tensor | None, who: str) -> torch.Tensor:
    """[B] the leave-one-out baseline of x (klbench.estimators.baselines), for baseline='loo'."""
    return leave_one_out_mean(x, group, f"{who} with baseline='loo'")


def _truncate(w: torch.Tensor, live: torch.Tensor, max_weight: float | None) -> tuple[torch.Tensor, int | None]:
    """Truncated importance weights min(w, max_weight), and how many live entries were truncated."""
    if max_weight is None:
        return w, None
    n = int(((w > max_weight) & live).sum())
    return w.clamp(max=max_weight), n


class _Placement(Estimator):
    """Shared option checks of in_reward / in_loss."""

    choices: dict[str, tuple] = {}

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        for key, valid in self.choices.items():
            if self.options[key] not in valid:
                raise ValueError(f"estimator {self.name!r}: {key} must be one of {', '.join(map(repr, valid))}, "
                                 f"got {self.options[key]!r}")
        if self.value != "cv" and (self.lam != 1.0 or self.level != "token"):
            raise ValueError(f"estimator {self.name!r}: lam and level apply to value='cv' only (value={self.value!r} "
                             f"is fixed); got lam={self.lam!r}, level={self.level!r}")
        mw = self.max_weight
        if mw is not None and not (isinstance(mw, (int, float)) and not isinstance(mw, bool) and mw > 0):
            raise ValueError(f"estimator {self.name!r}: max_weight must be None or a positive number, got {mw!r}")

    def _per_token_needed(self, what: str) -> None:
        if self.value == "cv" and self.level == "sequence":
            raise ValueError(f"estimator {self.name!r}: {what} needs a per-token value, but value='cv' with "
                             "level='sequence' has none; use level='token' or another value")


@gradient
class InReward(_Placement):
    """in_reward: the value enters the reward, without gradient: REINFORCE L = sg(c) sum_t l_t.

    form="sequence":     L_i = sg(W_i (v_i - b_i)) sum_t l_t,  b_i = mean_{j != i, same prompt} W_j v_j (loo) or 0
    form="reward_to_go": L_i = sum_t sg(sum_{s>=t} W_<=s v_s - W_<=t b_i) l_t   (per-token values only)
    On-policy every W is exactly 1. max_weight=c truncates the weights at c, and
    `estimate(batch).n_clamped` counts the truncated ones (sequences for form=sequence, tokens for reward_to_go).

    Expected gradient, y ~ pi and also y ~ pi_old (untruncated weights): the score-function part of
    grad E_pi[v], i.e. grad E_pi[v] - E_pi[grad v]:
      value=k1:            grad kl_pi_ref (k1 in reward: seq / cumulative / loo)
      value=k3:            grad kl_pi_ref - grad partial_kl_ref_pi            -> none of the KL gradients
      value=cv, token:     grad kl_pi_ref - lam grad partial_kl_ref_pi        -> none (lam != 0)
      value=cv, sequence:  grad kl_pi_ref - lam grad kl_ref_pi                -> none (lam != 0)
      value=k2:            grad E_pi[k2] - grad partial_kl_pi_ref             -> none
    With truncation that fires: none of these (biased towards smaller steps on unlikely samples).

    kl_norm="before" (old name "fused") is not a surrogate of its own: the RL task puts v into the reward before
    the advantage, A(reward_coef r - beta v) (klbench.estimators.advantages), and `sequence_value` gives it v. It needs
    form="sequence", baseline="none" (the advantage is the baseline) and no max_weight. With task.advantage=rloo
    or dr_grpo it equals "after" up to the advantage's own factor; with grpo the group std divides the KL
    too, and the expected gradient is then no KL gradient (docs/rlvr.md).
    """

    name = "in_reward"
    off_policy = True
    defaults = InRewardOptions().model_dump()
    choices = literal_choices(InRewardOptions)

    def __init__(self, **options: Any) -> None:
        if "kl_norm" in options:  # kl_norm="fused": the old name of "before", for one release
            options["kl_norm"] = renamed("kl_norm", options["kl_norm"])
        super().__init__(**options)
        if self.form == "reward_to_go":
            self._per_token_needed("form='reward_to_go'")
        if self.kl_norm == "before" and (self.form, self.baseline, self.max_weight) != ("sequence", "none", None):
            raise ValueError(f"estimator {self.name!r}: kl_norm='before' puts the sequence value into the sequence "
                             "reward, whose advantage is its baseline: it needs form='sequence', baseline='none' "
                             f"and max_weight=None; got form={self.form!r}, baseline={self.baseline!r}, "
                             f"max_weight={self.max_weight!r}")

    def sequence_value(self, batch: KLBatch) -> torch.Tensor:
        """[B] the detached per-sequence value v that kl_norm='before' puts into the reward."""
        terms, per_token = value_terms(batch, self.value, self.lam, self.level)
        return (seq_sum(terms) if per_token else terms).detach()

    def compute(self, batch: KLBatch) -> Estimate:
        if self.kl_norm == "before":
            raise ValueError(f"estimator {self.name!r} with kl_norm='before' has no surrogate of its own: the RL task "
                             "puts sequence_value(batch) into the reward before task.advantage")
        terms, per_token = value_terms(batch, self.value, self.lam, self.level)
        terms = terms.detach()  # [B, T] or [B]: in the reward, no gradient through the value
        log_w = batch.log_w.detach()  # [B, T], exactly zero on-policy
        logp = batch.masked_logp  # [B, T]
        if self.form == "sequence":
            v = seq_sum(terms) if per_token else terms  # [B]
            w, n = _truncate(torch.exp(seq_sum(log_w)), torch.ones_like(v, dtype=torch.bool), self.max_weight)
            if batch.old_logp is None:  # on-policy: exactly the seq / loo surrogates, no multiplication by 1
                coef = v - loo_mean(v, batch.group, self.name) if self.baseline == "loo" else v
            else:
                base = loo_mean(w * v, batch.group, self.name) if self.baseline == "loo" else 0.0
                coef = w * (v - base)  # [B]: E_q[W b grad log pi] = 0 because b does not depend on y_i
            out = coef * seq_sum(logp)
        else:
            w, n = _truncate(torch.exp(log_w.cumsum(-1)), batch.mask, self.max_weight)  # [B, T]: W_<=t
            wv = terms if batch.old_logp is None else w * terms  # [B, T]
            go = reward_to_go(wv)  # [B, T]: sum_{s>=t} W_<=s v_s
            if self.baseline == "loo":
                b = loo_mean(seq_sum(wv), batch.group, self.name)  # [B]
                go = go - (b.unsqueeze(-1) if batch.old_logp is None else w * b.unsqueeze(-1))
            out = seq_sum(go * logp)
        return Estimate(out, n)


@gradient
class InLoss(_Placement):
    """in_loss: the value is autodiffed in the loss, optionally times an importance ratio.

    ratio="none":     L = v                                    (refuses off-policy samples)
    ratio="token":    L = sum_t w_t v_t                        (per-token values only)
    ratio="sequence": L = W v
    ratio_grad="detached" puts the ratio under sg (OpenRLHF's unbiased_gradient weight); "differentiable"
    keeps its gradient, which changes the gradient even where the ratio is 1 (TRL use_bias_correction_kl,
    token ratio). max_weight=c truncates the ratio at c, and `estimate(batch).n_clamped` counts the truncations.

    Expected gradient (untruncated). "@old": the prefix-fixed partial gradient with prefixes drawn from
    pi_old, sum_p reach_old(p) grad KL(.|p); on-policy "@old" is the plain partial gradient.
      ratio none (y ~ pi) or sequence+detached (y ~ pi or pi_old): E_pi[grad v]
          k1: zero; k2: grad partial_kl_pi_ref; k3: grad partial_kl_ref_pi;
          cv token: lam grad partial_kl_ref_pi; cv sequence: lam grad kl_ref_pi
      ratio token + detached (y ~ pi_old): the same per position, prefixes from pi_old:
          k1: zero; k2: grad partial_kl_pi_ref@old; k3: grad partial_kl_ref_pi@old; cv token: lam x the latter
      ratio token + differentiable: E[(v_t + dv_t/dl_t) grad l_t] per position:
          k1, k3, cv token (any lam): grad partial_kl_pi_ref@old;  k2: none of these
      ratio sequence + differentiable (y ~ pi or pi_old): grad E_pi[v], the whole gradient of the value's mean:
          k1, k3, cv (any level, lam): grad kl_pi_ref;  k2: none of these
    """

    name = "in_loss"
    off_policy = True  # with a ratio; ratio="none" refuses (supports_off_policy)
    defaults = InLossOptions().model_dump()
    choices = literal_choices(InLossOptions)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        if self.ratio == "token":
            self._per_token_needed("ratio='token'")
        if self.ratio == "none" and (self.ratio_grad != "detached" or self.max_weight is not None):
            raise ValueError(f"estimator {self.name!r}: ratio='none' has no ratio to differentiate or truncate; "
                             f"got ratio_grad={self.ratio_grad!r}, max_weight={self.max_weight!r}")

    def supports_off_policy(self) -> bool:
        return self.ratio != "none"

    def compute(self, batch: KLBatch) -> torch.Tensor | Estimate:
        terms, per_token = value_terms(batch, self.value, self.lam, self.level)  # differentiable
        if self.ratio == "none":
            return seq_sum(terms) if per_token else terms
        log_w = batch.log_w  # [B, T]: zero in value on-policy, but carries grad l_t
        if self.ratio_grad == "detached":
            log_w = log_w.detach()
        if self.ratio == "token":
            w, n = _truncate(torch.exp(log_w), batch.mask, self.max_weight)  # [B, T]
            out = seq_sum(w * terms)
        else:
            v = seq_sum(terms) if per_token else terms  # [B]
            w, n = _truncate(torch.exp(seq_sum(log_w)), torch.ones_like(v, dtype=torch.bool), self.max_weight)
            out = w * v
        return Estimate(out, n)
