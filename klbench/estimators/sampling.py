"""How rollouts sample, and which KL a run regularises and measures (task.temperature, top_k, top_p, kl_target).

    Sampling(temperature=0.7, top_p=0.9).process(logits)   # [..., V] the logits the sampler draws from
    target_pair(logits, ref_logits, sampling, "sampler")    # ([..., V], [..., V]) the two distributions compared
    target_batch(logits, ref_logits, tokens, mask, sampling, target, ...) -> KLBatch

The sampler pi_s draws from pi's logits divided by the temperature T, then cut to the top-k tokens, then to the
smallest set holding top-p of the mass: transformers' warpers, in generate()'s order, with their arithmetic
(`process`), so that klbench's rollouts and generate(do_sample=True, temperature, top_k, top_p) draw the same
tokens. pi_s is not pi. Every estimator is a statement about y ~ pi for a pair (pi, pi_ref); which pair a run
compares is its KL target, named explicitly:

  sampler          KL(pi_s || pi_ref,T): the sampler's own distribution against the reference at the same
                   temperature over the whole vocabulary (finite: pi_ref,T covers whatever pi_s keeps). y ~ pi_s
                   exactly, so mc, rb and every gradient built on k1 (seq, cumulative, loo, rb, token's partial)
                   keep their T = 1 claims with (pi_s, pi_ref,T) in place of (pi, pi_ref). Under truncation k3
                   (cv, naive_cv, value=k3 placements) is biased by E_{pi_s}[sum_t (Z_t - 1)], Z_t the reference
                   mass on the kept tokens: check_target warns. The truncation set is held fixed in the gradient
                   (it is piecewise constant in the logits). A reference restricted to the kept set instead would
                   charge nothing for a policy that keeps one token per step (docs/sampling.md).
  model            KL(pi || pi_ref) of the untempered models; y ~ pi_s is a behaviour policy, so the batch
                   carries old_logp = log pi_s(y) and only the off-policy estimators (KLBatch.old_logp) serve.
                   Exact for a temperature alone (pi_s covers pi). Under truncation pi_s does not cover pi and
                   no importance weight can fix that: refused (check_target).
  tempered         KL(pi_T || pi_ref,T), both divided by T over the full vocabulary: how TRL and verl score.
                   Equal to `sampler` without truncation; with truncation the samples come from pi_s != pi_T
                   and every estimator is biased (the bias is measured exactly on tabular, docs/sampling.md).
  tempered_vs_raw  KL(pi_T || pi_ref): the policy scored at T against the untempered reference
                   (tinker-cookbook #689). A KL, but of pi_T and pi_ref, whose optimum is not pi_ref's tempered
                   neighbour; under truncation biased as `tempered`.

At T = 1 without truncation the four targets are one pair and `target_batch` passes the logits through
untouched (no copy), so plain runs score exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from klbench.estimators.batch import KLBatch
from klbench.estimators.vocab_exact import token_logprob, token_scores
# the names and rules the config schema reads too, without torch
from klbench.estimators.targets import KL_TARGETS, is_plain, truncated_model_target, truncates


def excluded(dtype: torch.dtype) -> float:
    """The logit a scored distribution gives the tokens the sampler cut. Finite, unlike the sampler's -inf: its
    exp is exactly 0, and the exact per-position KL's p * (log p - log q) stays 0 there instead of 0 * nan."""
    return torch.finfo(dtype).min


@dataclass(frozen=True)
class Sampling:
    """temperature > 0; top_k: 0 keeps every token; top_p in (0, 1], 1 keeps every token."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"task.temperature must be a finite number > 0, got {t!r} (temperature 0, greedy "
                             "decoding, is a point mass: no KL estimator is defined on it)")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"task.top_k must be an integer >= 0 (0: no top-k cut), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"task.top_p must be in (0, 1] (1: no top-p cut), got {p!r}")

    @property
    def truncates(self) -> bool:
        return truncates(self.top_k, self.top_p)

    @property
    def is_plain(self) -> bool:
        """Temperature 1, nothing cut: pi_s = pi."""
        return is_plain(self.temperature, self.top_k, self.top_p)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] float32 (float64 stays) logits of pi_s, -inf on cut tokens: transformers' Temperature,
        TopK and TopP warpers in generate()'s order, with their arithmetic (min_tokens_to_keep = 1)."""
        scores = logits.float() if logits.dtype != torch.float64 else logits
        if self.temperature != 1:
            scores = scores / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1]))[0][..., -1:]  # [..., 1]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=False)  # [..., V]
            cut = sorted_scores.softmax(-1).cumsum(-1) <= (1 - self.top_p)  # [..., V] the low tail
            cut[..., -1:] = False  # the most likely token is always kept
            scores = scores.masked_fill(cut.scatter(-1, order, cut), -float("inf"))
        return scores

    def keep(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] bool: the tokens pi_s can draw (all True without truncation)."""
        return torch.isfinite(self.process(logits.detach()))

    def describe(self) -> str:
        parts = [f"temperature={self.temperature:g}"]
        parts += [f"top_k={self.top_k}"] if self.top_k else []
        parts += [f"top_p={self.top_p:g}"] if self.top_p < 1 else []
        return ", ".join(parts)


def check_target(sampling: Sampling, target: str) -> str | None:
    """ValueError for a target that cannot be estimated at all under this sampling; else a one-line warning where
    estimators are biased for it here (None otherwise): every estimator (tempered targets under truncation), or
    those built on k3 (`sampler` under truncation)."""
    if target not in KL_TARGETS:
        raise ValueError(f"task.kl_target={target!r} is unknown; valid: {', '.join(KL_TARGETS)}")
    if target == "model" and sampling.truncates:
        raise ValueError(truncated_model_target(sampling.describe()))
    if target == "sampler" and sampling.truncates:
        return (f"task.kl_target=sampler with {sampling.describe()}: k3 (value cv, naive_cv, in_reward/in_loss "
                f"value=k3) is biased here, by the reference mass outside the kept tokens; mc, rb and the k1 "
                f"gradients (seq, cumulative, loo, rb) stay exact (docs/sampling.md)")
    if target in ("tempered", "tempered_vs_raw") and sampling.truncates:
        return (f"task.kl_target={target} with {sampling.describe()}: the samples come from the truncated "
                f"sampler, not from the tempered policy this target scores, so every estimator is biased "
                f"(as in TRL/verl with a truncating vLLM sampler; docs/sampling.md measures it)")
    return None


def target_pair(logits: torch.Tensor, ref_logits: torch.Tensor, sampling: Sampling,
                target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the two distributions the target's KL compares, [..., V] each (the input tensors themselves
    at plain sampling). Differentiable in `logits`; cut tokens get `excluded(dtype)`."""
    if sampling.is_plain or target == "model":
        return logits, ref_logits
    t = sampling.temperature
    up = (lambda x: x.float()) if logits.dtype != torch.float64 else (lambda x: x)
    pol, ref = up(logits) / t, up(ref_logits)
    if target == "tempered_vs_raw":
        return pol, ref
    ref = ref / t
    if target == "sampler" and sampling.truncates:  # the policy as sampled; the reference keeps its whole vocabulary
        pol = pol.masked_fill(~sampling.keep(logits), excluded(pol.dtype))  # the cut held fixed: piecewise constant
    return pol, ref


def target_batch(logits: torch.Tensor, ref_logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                 sampling: Sampling, target: str, group: torch.Tensor | None = None,
                 behaviour_logp: torch.Tensor | None = None, chunk_rows: int | None = None,
                 with_token_kl: bool = False, donate_ref: bool = False) -> KLBatch:
    """The KLBatch of `target` for responses `tokens` [B, T] drawn by `sampling` from `logits` [B, T, V].

    behaviour_logp [B, T]: the log-probs of the policy that drew `tokens` as the sampler reported them (a rollout
    engine's own, task.behaviour=sampler): the batch carries them as old_logp at every temperature, T = 1 included,
    and the off-policy estimators correct for every gap between the engine and the scorer. Without them,
    target=model off plain sampling recomputes old_logp = log pi_s(y) from these logits (task.behaviour=scorer),
    and every other batch is on-policy.
    with_token_kl: also the exact per-position KL (KLBatch.token_kl), with logp in one pass (token_scores), for an
    estimator that differentiates it (Estimator.kappa_gradient); else KLBatch.kappa computes it on first use.
    donate_ref: ref_logits are the caller's to give up (LMPolicy's, computed for this batch): kappa's backward
    writes the gradient into them instead of a [B, T, V] of its own (token_scores), so nothing may read them, or
    the batch's ref_logits, after backward; and the batch's graph is backpropagated once (a second backward would
    read the first one's gradient as the reference's logits).
    """
    check_target(sampling, target)
    if behaviour_logp is not None and behaviour_logp.shape != mask.shape:
        raise ValueError(f"the behaviour log-probs have shape {tuple(behaviour_logp.shape)}, the batch's mask "
                         f"{tuple(mask.shape)}: one log-prob per response token is needed")
    pol, ref = target_pair(logits, ref_logits, sampling, target)
    token_kl = None
    if with_token_kl:
        logp, token_kl = token_scores(pol, ref, tokens, mask, donate=donate_ref)
    else:
        logp = token_logprob(pol, tokens)
    ref_logp = token_logprob(ref, tokens)
    old = None
    if behaviour_logp is not None or (target == "model" and not sampling.is_plain):
        old = behaviour_logp if behaviour_logp is not None else \
            token_logprob(sampling.process(logits.detach()), tokens)
        old = torch.where(mask, old.to(logp.dtype), logp.detach())  # padding: any finite value that says on-policy
    return KLBatch(logp, ref_logp, mask, pol, ref, group=group, chunk_rows=chunk_rows, old_logp=old,
                   token_kl=token_kl)
