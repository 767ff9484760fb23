"""An autoregressive tabular model small enough to enumerate: exact KLs, exact gradients, and the exact
moments of any estimator or surrogate evaluated on every sequence (the job the audit and the tests build on).

A policy is a logit table `theta` [P, K]: one row of next-token logits per prefix. Prefixes are all
token tuples of length 0..T-1 that contain no EOS. A sequence ends at EOS (which is itself a
response token) or after T tokens; positions after EOS are padding and masked out.

Sampling (klbench.estimators.sampling): with a `Sampling` (temperature, top-k, top-p), samples come from
pi_s = the table processed row by row as generate() processes logits, batches are built by `target_batch`
for a KL target, and the exact target KLs and their gradients come from `target_tables` (docs/sampling.md).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from klbench.estimators import KLBatch
from klbench.estimators.sampling import Sampling, target_batch, target_pair, token_logprob

DTYPE = torch.float64
# batch(..., sampling, target=RAW): samples from pi_s, the batch holds the untempered logits and log-probs, and the
# loss does its own scoring (dividing by the temperature where a library does): audit_targets
RAW = "raw"


@dataclass
class RawBatch(KLBatch):
    """A KLBatch of untempered logits [B, T, K] with the sampled tokens [B, T], for losses that score them."""

    tokens: torch.Tensor | None = None
Surrogate = Callable[[KLBatch], torch.Tensor]


class TabularModel:
    """Enumerates prefixes and complete sequences over vocabulary K and horizon T, and holds pi_ref."""

    def __init__(self, K: int, T: int, ref_logits: torch.Tensor | None = None, eos: int | None = None, seed: int = 0,
                 ref_scale: float = 1.0):
        if K < 2 or T < 1:
            raise ValueError(f"tabular model needs K >= 2 and T >= 1, got K={K}, T={T}")
        if eos is not None and not 0 <= eos < K:
            raise ValueError(f"eos must be a token id in [0, {K}), got {eos}")
        self.K, self.T, self.eos = K, T, eos
        body = [v for v in range(K) if v != eos]
        self.prefixes = [p for t in range(T) for p in itertools.product(body, repeat=t)]
        self.prefix_id = {p: i for i, p in enumerate(self.prefixes)}
        seqs = [p + (v,) for p in self.prefixes for v in range(K) if v == eos or len(p) == T - 1]
        self.N, self.P = len(seqs), len(self.prefixes)
        self.tokens = torch.zeros(self.N, T, dtype=torch.long)  # [N, T], 0 on padding
        self.seq_prefix = torch.zeros(self.N, T, dtype=torch.long)  # [N, T] prefix row used at each position
        self.mask = torch.zeros(self.N, T, dtype=torch.bool)  # [N, T]
        for n, y in enumerate(seqs):
            self.tokens[n, : len(y)] = torch.tensor(y)
            self.seq_prefix[n, : len(y)] = torch.tensor([self.prefix_id[y[:t]] for t in range(len(y))])
            self.mask[n, : len(y)] = True
        # every prefix as the (prefix row, token) steps that reach it, for reach probabilities: [P, T] each
        self.path_rows = torch.zeros(self.P, T, dtype=torch.long)
        self.path_tokens = torch.zeros(self.P, T, dtype=torch.long)
        self.path_mask = torch.zeros(self.P, T, dtype=torch.bool)
        for i, p in enumerate(self.prefixes):
            self.path_rows[i, : len(p)] = torch.tensor([self.prefix_id[p[:t]] for t in range(len(p))], dtype=torch.long)
            self.path_tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            self.path_mask[i, : len(p)] = True
        gen = torch.Generator().manual_seed(seed)
        self.ref_logits = (ref_scale * torch.randn(self.P, K, generator=gen, dtype=DTYPE) if ref_logits is None
                           else ref_logits.to(DTYPE))
        if self.ref_logits.shape != (self.P, K):
            raise ValueError(f"ref_logits must be [P, K] = [{self.P}, {K}], got {tuple(self.ref_logits.shape)}")

    def random_policy(self, seed: int, scale: float = 1.0) -> torch.Tensor:
        """A random policy table [P, K], float64 (requires_grad is the caller's choice)."""
        gen = torch.Generator().manual_seed(seed)
        return scale * torch.randn(self.P, self.K, generator=gen, dtype=DTYPE)

    # ---- exact quantities, differentiable in theta ----

    def seq_logprob(self, table: torch.Tensor) -> torch.Tensor:
        """[N] log probability of every complete sequence under a logit table [P, K]."""
        logp = torch.log_softmax(table, -1)[self.seq_prefix].gather(-1, self.tokens.unsqueeze(-1)).squeeze(-1)
        return torch.where(self.mask, logp, torch.zeros((), dtype=logp.dtype)).sum(-1)

    def seq_prob(self, table: torch.Tensor) -> torch.Tensor:
        """[N] probability of every complete sequence, as a product of token probabilities: a table with cut
        tokens (-inf, or sampling.excluded's finite minimum) gives exact zeros, where a sum of log-probs would
        overflow to -inf + -inf."""
        p = torch.softmax(table, -1)[self.seq_prefix].gather(-1, self.tokens.unsqueeze(-1)).squeeze(-1)  # [N, T]
        return torch.where(self.mask, p, torch.ones((), dtype=p.dtype)).prod(-1)

    def kl_pi_ref(self, theta: torch.Tensor) -> torch.Tensor:
        """KL(pi || pi_ref) over whole sequences."""
        return self.pair_kl(theta, self.ref_logits)

    def kl_ref_pi(self, theta: torch.Tensor) -> torch.Tensor:
        """KL(pi_ref || pi) over whole sequences."""
        return self.pair_kl(self.ref_logits, theta)

    def reach(self, theta: torch.Tensor) -> torch.Tensor:
        """[P] probability under pi that a sampled response passes through each prefix (differentiable)."""
        probs = torch.softmax(theta, -1)[self.path_rows, self.path_tokens]  # [P, T]: each step of the prefix
        return torch.where(self.path_mask, probs, torch.ones((), dtype=probs.dtype)).prod(-1)

    def pair_kl(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Sequence-level KL(p || q) of two logit tables [P, K], by the chain rule sum_prefix reach_p * KL(.|prefix):
        finite where tokens are cut from both (their probability is exactly 0 and their log-ratio finite)."""
        return (self.reach(p) * _token_kl(p, q)).sum()

    def partial_kl_pi_ref(self, theta: torch.Tensor, behaviour: torch.Tensor | None = None) -> torch.Tensor:
        """sum_p sg(reach(p)) KL(pi(.|p) || pi_ref(.|p)): its gradient is the token-level partial one.
        Prefixes are drawn from pi, or from the behaviour table [P, K] if given (the "@old" partial)."""
        return self._partial(theta, self.ref_logits, behaviour, 0)

    def partial_kl_ref_pi(self, theta: torch.Tensor, behaviour: torch.Tensor | None = None) -> torch.Tensor:
        """sum_p sg(reach(p)) KL(pi_ref(.|p) || pi(.|p)), prefixes drawn from pi (or behaviour), held fixed."""
        return self._partial(theta, self.ref_logits, behaviour, 1)

    def exact_gradients(self, theta: torch.Tensor, behaviour: torch.Tensor | None = None,
                        sampling: Sampling | None = None, target: str = "sampler") -> dict[str, torch.Tensor]:
        """The candidate expected gradients [P, K] that the audit compares against. With a behaviour table
        (samples from pi_old), also the partial gradients whose prefixes come from pi_old ("...@old").
        With a sampling, the candidates of the target's pair instead (target_gradients)."""
        if sampling is not None:
            _no_behaviour(behaviour)
            return self.target_gradients(theta, sampling, target)
        fns = [("kl_pi_ref", self.kl_pi_ref), ("kl_ref_pi", self.kl_ref_pi),
               ("partial_kl_pi_ref", self.partial_kl_pi_ref), ("partial_kl_ref_pi", self.partial_kl_ref_pi)]
        if behaviour is not None:
            old = behaviour.detach()
            fns += [("partial_kl_pi_ref@old", lambda t: self.partial_kl_pi_ref(t, old)),
                    ("partial_kl_ref_pi@old", lambda t: self.partial_kl_ref_pi(t, old))]
        return _gradients(fns, theta)

    # ---- sampling from pi_s, and the KL targets (klbench.estimators.sampling) ----

    def sampler_table(self, theta: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """[P, K] the logits pi_s draws from: every prefix's row processed as generate() processes logits
        (-inf on cut tokens). Detached: the sampler is where samples come from, not a term of a loss."""
        return sampling.process(theta.detach())

    def target_tables(self, theta: torch.Tensor, sampling: Sampling, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The two logit tables [P, K] that the target's KL compares (target_pair, row by row), differentiable in
        theta; cut tokens carry sampling.excluded's finite minimum. target=model: (theta, pi_ref)."""
        return target_pair(theta, self.ref_logits, sampling, target)

    def target_kl(self, theta: torch.Tensor, sampling: Sampling, target: str) -> torch.Tensor:
        """The exact KL the target regularises: KL(pi_s || pi_ref,T), KL(pi || pi_ref), KL(pi_T || pi_ref,T) or
        KL(pi_T || pi_ref) over whole sequences."""
        return self.pair_kl(*self.target_tables(theta, sampling, target))

    def target_gradients(self, theta: torch.Tensor, sampling: Sampling, target: str) -> dict[str, torch.Tensor]:
        """exact_gradients for the target's pair (p, q) = target_tables(theta): kl_pi_ref = grad KL(p || q),
        kl_ref_pi = grad KL(q || p), the partials with prefixes drawn from p (held fixed) and, where the samples
        do not come from p (target=model at T != 1, tempered targets under truncation), "@old": the partials with
        prefixes drawn from the sampler pi_s. The truncation set is held fixed (piecewise constant in theta)."""
        sampler = self.sampler_table(theta, sampling)
        pair = lambda t: self.target_tables(t, sampling, target)  # noqa: E731
        fns = [("kl_pi_ref", lambda t: self.pair_kl(*pair(t))),
               ("kl_ref_pi", lambda t: self.pair_kl(*pair(t)[::-1]))]
        starts = [("", None)]
        if not torch.allclose(torch.softmax(pair(theta.detach())[0], -1), torch.softmax(sampler, -1), rtol=0,
                              atol=1e-12):
            starts.append(("@old", sampler))
        for suffix, src in starts:
            fns += [(f"partial_kl_pi_ref{suffix}", lambda t, s=src: self._partial(*pair(t), s, 0)),
                    (f"partial_kl_ref_pi{suffix}", lambda t, s=src: self._partial(*pair(t), s, 1))]
        return _gradients(fns, theta)

    def _partial(self, p: torch.Tensor, q: torch.Tensor, src: torch.Tensor | None, direction: int) -> torch.Tensor:
        """sum_prefix sg(reach(prefix)) KL(p || q) (direction 0) or KL(q || p) (1) at that prefix; prefixes
        drawn from p, or from the table src."""
        reach = self.reach((p if src is None else src).detach()).detach()
        return (reach * (_token_kl(p, q) if direction == 0 else _token_kl(q, p))).sum()

    # ---- estimators evaluated on every sequence (or every n-tuple of one prompt) ----

    def batch(self, tables: torch.Tensor, rows: torch.Tensor, owner: torch.Tensor | None = None,
              group: torch.Tensor | None = None, behaviour: torch.Tensor | None = None,
              sampling: Sampling | None = None, target: str = "sampler") -> KLBatch:
        """KLBatch for sequences `rows` [B]; row b reads policy table `tables[owner[b]]` ([M, P, K] tables).
        With a behaviour table [P, K] the batch carries old_logp, the log-probs under pi_old. With a sampling,
        the batch of the KL target, built by klbench.estimators.sampling.target_batch as LM runs build theirs."""
        if tables.dim() == 2:
            tables, owner = tables.unsqueeze(0), torch.zeros_like(rows)
        pre = self.seq_prefix[rows]  # [B, T]
        logits = tables[owner.unsqueeze(-1), pre]  # [B, T, K]
        ref_logits = self.ref_logits[pre]  # [B, T, K]
        if sampling is not None and target == RAW:  # the loss scores the raw logits itself, as a library does
            _no_behaviour(behaviour)
            tok = self.tokens[rows]  # [B, T]
            return RawBatch(token_logprob(logits, tok), token_logprob(ref_logits, tok), self.mask[rows], logits,
                            ref_logits, group=group, tokens=tok)
        if sampling is not None:
            _no_behaviour(behaviour)
            # the exact per-position KL in one block: [B, T, K] is small here (see TabularPolicy.score)
            return target_batch(logits, ref_logits, self.tokens[rows], self.mask[rows], sampling, target,
                                group=group, chunk_rows=max(1, rows.numel() * self.T))
        tok = self.tokens[rows].unsqueeze(-1)  # [B, T, 1]
        logp = torch.log_softmax(logits, -1).gather(-1, tok).squeeze(-1)
        ref_logp = torch.log_softmax(ref_logits, -1).gather(-1, tok).squeeze(-1)
        old_logp = None
        if behaviour is not None:
            old_logp = torch.log_softmax(behaviour.detach()[pre], -1).gather(-1, tok).squeeze(-1)  # [B, T]
        return KLBatch(logp, ref_logp, self.mask[rows], logits, ref_logits, group=group, old_logp=old_logp)

    def sample_probs(self, theta: torch.Tensor, behaviour: torch.Tensor | None = None,
                     sampling: Sampling | None = None) -> torch.Tensor:
        """[N] the probability that one sample is each sequence: under pi, the behaviour table, or pi_s."""
        if sampling is not None:
            _no_behaviour(behaviour)
            return self.seq_prob(self.sampler_table(theta, sampling))
        return self.seq_logprob((theta if behaviour is None else behaviour).detach()).exp()

    def _tuples(self, p: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All n-tuples of sequences [M, n] with probability > 0 under the sequence probabilities p [N], and
        those probabilities [M] (a truncated sampler never draws the others: they are left out, not scored)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if self.N ** n > 2_000_000:
            raise ValueError(f"{self.N}^{n} tuples is too many to enumerate; use a smaller K, T or n")
        idx = torch.cartesian_prod(*[torch.arange(self.N)] * n).reshape(-1, n)  # [M, n]
        w = p.detach()[idx].prod(-1)  # [M]
        live = w > 0
        return idx[live], w[live]

    def gradient_moments(self, surrogate: Surrogate, theta: torch.Tensor, n: int = 1,
                         behaviour: torch.Tensor | None = None, sampling: Sampling | None = None,
                         target: str = "sampler", reward: torch.Tensor | None = None) -> "Moments":
        """Exact mean [P, K] and trace of covariance of the gradient sample grad (1/n) sum_i L_i, where the
        n samples of one prompt are drawn i.i.d. from pi, or from the behaviour table pi_old [P, K] if given
        (the batch then carries old_logp), or from pi_s if a sampling is given (the batch is then the target's,
        target_batch). Per-tuple gradients come from one backward pass through per-tuple copies of theta. With a
        reward table [N], the surrogate is called as surrogate(batch, rewards [B]): a reward term (an advantage
        over the group) enters the gradient with the KL's."""
        idx, w = self._tuples(self.sample_probs(theta, behaviour, sampling), n)
        M = idx.shape[0]
        copies = theta.detach().expand(M, -1, -1).clone().requires_grad_()  # [M, P, K]
        owner = torch.arange(M).repeat_interleave(n)  # [M * n]
        batch = self.batch(copies, idx.reshape(-1), owner, group=owner, behaviour=behaviour, sampling=sampling,
                           target=target)
        surr = _as_tensor(surrogate(batch) if reward is None else surrogate(batch, reward.to(DTYPE)[idx.reshape(-1)]),
                          M * n)
        if surr.requires_grad:
            g = torch.autograd.grad(surr.sum() / n, copies)[0].reshape(M, -1)  # [M, P*K]
        else:  # a loss computed under no_grad (skyrl-train 0.3.1's KL loss): backward gives the optimiser nothing
            g = torch.zeros(M, theta.numel(), dtype=theta.dtype)
        mean = (w.unsqueeze(-1) * g).sum(0)
        trace = (w * (g ** 2).sum(-1)).sum() - (mean ** 2).sum()
        return Moments(mean.reshape(theta.shape), float(trace))

    def value_moments(self, value_fn: Surrogate, theta: torch.Tensor, n: int = 1,
                      behaviour: torch.Tensor | None = None, sampling: Sampling | None = None,
                      target: str = "sampler") -> "Moments":
        """Exact mean and variance of the batch-mean estimate (1/n) sum_i v_i over n i.i.d. samples
        (from pi, the behaviour table, or pi_s with the target's batch, as in gradient_moments)."""
        idx, w = self._tuples(self.sample_probs(theta, behaviour, sampling), n)
        owner = torch.arange(idx.shape[0]).repeat_interleave(n)
        batch = self.batch(theta.detach(), idx.reshape(-1), owner, group=owner, behaviour=behaviour,
                           sampling=sampling, target=target)
        v = _as_tensor(value_fn(batch), idx.numel())
        est = v.reshape(-1, n).mean(-1)  # [M]
        mean = (w * est).sum()
        return Moments(mean, float((w * (est - mean) ** 2).sum()))

    def expected_reward(self, theta: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
        """E_pi[r] for a reward table [N] (differentiable in theta)."""
        return (self.seq_logprob(theta).exp() * reward.to(DTYPE)).sum()


@dataclass
class Moments:
    mean: torch.Tensor
    trace: float  # trace of the covariance (gradients) or the variance (values)

def _token_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[P] per-row KL(p || q) of two logit tables [P, K]; a token p gives probability exactly 0 adds 0."""
    lp, lq = torch.log_softmax(p, -1), torch.log_softmax(q, -1)
    return torch.where(lp.exp() > 0, lp.exp() * (lp - lq), torch.zeros((), dtype=lp.dtype)).sum(-1)


def _gradients(fns: list, theta: torch.Tensor) -> dict[str, torch.Tensor]:
    """{name: grad_theta fn(theta)} [P, K] each, plus "zero"."""
    out = {}
    for name, fn in fns:
        t = theta.detach().clone().requires_grad_()
        out[name] = torch.autograd.grad(fn(t), t)[0]
    out["zero"] = torch.zeros_like(theta)
    return out


def _no_behaviour(behaviour) -> None:
    if behaviour is not None:
        raise ValueError("a behaviour table and a sampling together are not supported: the sampling's pi_s is "
                         "the behaviour policy (target=model) or the sampled policy itself")


def _as_tensor(out, size: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != (size,):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"a surrogate must return one value per sequence, shape ({size},); got {shape}. "
                         "Return the per-sequence loss before any batch mean.")
    return out
