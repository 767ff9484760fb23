"""Gradient estimators from the 2026 on-policy distillation (OPD) work, on a KLBatch whose pi_ref is the teacher
(they apply to RL's pi_ref as well: the math does not know which). Each docstring states the surrogate and its
expected gradient over y ~ pi; tests/test_opd_estimators.py checks each statement exactly on the tabular model.

  vopd        the exact per-token KL kappa_t as a detached baseline of the score term (vOPD, arXiv 2605.07865)
  topk_tail   exact KL over the policy's top-k tokens plus a score-function estimate of the tail (NeMo-RL #3608)
  topk_trunc  the KL summed over a top-k set only, autodiffed (arXiv 2603.25562): biased on purpose, a pitfall

All three assume y ~ pi (they refuse KLBatch.old_logp != logp) and need the full next-token logits.
"""
from __future__ import annotations

import torch

from klbench.estimators.base import GRADIENT_ESTIMATORS, Estimator, register, reward_to_go, seq_sum
from klbench.estimators.batch import KLBatch
from klbench.estimators.options import TopKTailOptions, TopKTruncOptions, VOPDOptions

gradient = register(GRADIENT_ESTIMATORS)


@gradient
class VOPD(Estimator):
    """vopd: the score term with the exact per-position KL as its baseline; kappa_t depends on y_<t only, so
    subtracting it changes no expectation and removes the part of rho_t that the prefix already predicts.

    form="reward_to_go" (default): L = sum_t sg(sum_{s>=t} rho_s - kappa_t) l_t. Expected gradient: grad kl_pi_ref
        (= grad KL(student || teacher) in distillation). Equivalently the sequence-level score term sg(rho) sum_t l_t
        with the baseline b_t = sum_{s<t} rho_s + kappa_t, a function of y_<t.
    form="token": L = sum_t sg(rho_t - kappa_t) l_t, the token-level OPD advantage -rho_t (tinker-cookbook's
        kl_discount_factor 0) with the baseline. Expected gradient: grad partial_kl_pi_ref (prefix held fixed).
    """

    name = "vopd"
    reads_kappa = True
    defaults = VOPDOptions().model_dump()

    def compute(self, batch: KLBatch) -> torch.Tensor:
        kappa = batch.kappa.detach()  # [B, T], 0 off the mask
        rho = batch.rho.detach()  # [B, T]
        score = reward_to_go(rho) if self.form == "reward_to_go" else rho  # [B, T]
        return seq_sum((score - kappa) * batch.masked_logp)


def _head(batch: KLBatch, k: int, by: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi [B, T, V] differentiable, log pi_ref [B, T, V], head [B, T, V] bool): the k most likely tokens
    of pi (by="policy") or of pi_ref (by="teacher") at each position, chosen on detached values."""
    V = batch.logits.shape[-1]
    if k > V:
        raise ValueError(f"estimator option k={k} exceeds the vocabulary size V={V}: k must be <= V")
    logp = torch.log_softmax(batch.logits.to(batch.logp.dtype), -1)  # [B, T, V]
    logq = torch.log_softmax(batch.ref_logits.detach().to(batch.logp.dtype), -1)  # [B, T, V]
    rank_by = logp.detach() if by == "policy" else logq
    idx = rank_by.topk(k, -1).indices  # [B, T, k]
    head = torch.zeros_like(logq, dtype=torch.bool).scatter_(-1, idx, True)  # [B, T, V]
    return logp, logq, head


def _sampled_in_head(batch: KLBatch, logp_all: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """[B, T] whether the sampled token y_t is in the head. KLBatch carries log pi(y_t), not y_t: the sampled token is
    the one whose log-prob in logp_all is nearest batch.logp. Nearest, not equal: a run's batch computes log pi(y_t)
    as gather - logsumexp, logp_all is a log_softmax, and the two differ in the last bits (an exact comparison once
    counted the k-th head token as tail, biasing topk_tail on every run's scoring path)."""
    gap = (logp_all.detach() - batch.logp.detach().unsqueeze(-1)).abs()  # [B, T, V]
    return head.gather(-1, gap.argmin(-1, keepdim=True)).squeeze(-1)  # [B, T]


@gradient
class TopKTail(Estimator):
    """topk_tail: per position, the KL over the policy's k most likely tokens H_t exactly (autodiffed) plus the
    tail's mass by the sampled token, inside rb's structure (path-wise part + future-only score term):

        khat_t = sum_{v in H_t} pi(v) (log pi(v) - log pi_ref(v)) + 1[y_t not in H_t] rho_t   (E[khat_t|y_<t] = kappa_t)
        L = sum_t [ head_t + 1[y_t not in H_t] sg(rho_t + 1) l_t ] + sum_t sg(sum_{s>t} khat_s) l_t

    The tail's path-wise gradient sum_{v not in H} pi(v) (rho(v) + 1) grad log pi(v) is estimated by its one
    sample, so the estimator is unbiased for any k. Expected gradient (y ~ pi): grad kl_pi_ref. At k = V it is
    rb exactly; at smaller k it trades rb's full-vocabulary sum for variance. k > V is refused.
    """

    name = "topk_tail"
    reads_logits = True
    defaults = TopKTailOptions().model_dump()

    def compute(self, batch: KLBatch) -> torch.Tensor:
        logp, logq, head = _head(batch, self.k, "policy")
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        head_kl = torch.where(head, logp.exp() * (logp - logq), zero).sum(-1)  # [B, T], differentiable
        head_kl = torch.where(batch.mask, head_kl, zero)
        tail = batch.mask & ~_sampled_in_head(batch, logp, head)  # [B, T]
        rho = batch.rho.detach()  # [B, T]
        tail_path = torch.where(tail, (rho + 1) * batch.masked_logp, zero)  # score-function estimate of the tail
        khat = head_kl.detach() + torch.where(tail, rho, zero)  # [B, T], unbiased for kappa_t
        future = reward_to_go(khat) - khat  # [B, T]: sum_{s>t} khat_s
        return seq_sum(head_kl + tail_path) + seq_sum(future * batch.masked_logp)


@gradient
class TopKTrunc(Estimator):
    """topk_trunc: PITFALL (biased on purpose, like naive_mc). The reverse KL summed over a top-k set only and
    autodiffed, prefix held fixed: L = sum_t sum_{v in H_t} pi(v) (log pi(v) - log pi_ref(v)), H_t the k most
    likely tokens of the teacher pi_ref (head="teacher", the default) or of pi (head="policy"); no renormalisation.

    Expected gradient: E_y[sum_t grad_t trunc_t(y_<t)], the prefix-fixed gradient of the truncated KL. It is
    grad partial_kl_pi_ref at k = V and follows no KL gradient below V: it misses the tail's mass and (as every
    prefix-fixed loss) the score term. Its bias against grad kl_pi_ref is measured exactly in
    docs/opd-estimators.md. k > V is refused.
    """

    name = "topk_trunc"
    reads_logits = True
    defaults = TopKTruncOptions().model_dump()

    def compute(self, batch: KLBatch) -> torch.Tensor:
        logp, logq, head = _head(batch, self.k, self.head)
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        trunc = torch.where(head, logp.exp() * (logp - logq), zero).sum(-1)  # [B, T]
        return seq_sum(torch.where(batch.mask, trunc, zero))
