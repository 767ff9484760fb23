"""An autoregressive tabular model small enough to enumerate: exact KLs, exact gradients, exact
estimator moments, the exact reward+KL optimum and its Pareto frontier, and the loss audit.

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
from typing import Callable, Sequence, Union

import torch

from klbench.estimators import KLBatch
from klbench.estimators.sampling import KL_TARGETS, Sampling, target_batch, target_pair, token_logprob

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

    # ---- reward + beta * KL: exact optimum and Pareto frontier ----

    def optimal_seq_logprob(self, reward: torch.Tensor, beta: float) -> torch.Tensor:
        """[N] log pi*_beta(y), pi*_beta ∝ pi_ref exp(r / beta): the maximiser of E[r] - beta KL(pi || pi_ref)."""
        if beta <= 0:
            raise ValueError(f"beta must be > 0 for the closed-form optimum, got {beta}")
        s = self.seq_logprob(self.ref_logits) + reward.to(DTYPE) / beta
        return s - torch.logsumexp(s, 0)

    def table_from_seq_logprob(self, seq_logprob: torch.Tensor) -> torch.Tensor:
        """The autoregressive logit table [P, K] whose sequence distribution is exp(seq_logprob)."""
        mass = torch.zeros(self.P, self.K, dtype=DTYPE)  # mass of sequences through (prefix, next token)
        p = seq_logprob.exp().unsqueeze(-1).expand(-1, self.T)  # [N, T]
        mass.index_put_((self.seq_prefix[self.mask], self.tokens[self.mask]), p[self.mask], accumulate=True)
        return mass.log()

    def expected_reward(self, theta: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
        return (self.seq_logprob(theta).exp() * reward.to(DTYPE)).sum()

    def pareto_frontier(self, reward: torch.Tensor, betas: torch.Tensor | None = None) -> "Frontier":
        """Exact reward-vs-kl_pi_ref frontier traced by pi*_beta over a beta grid (log-spaced by default)."""
        betas = torch.logspace(-3, 3, 400, dtype=DTYPE) if betas is None else betas.to(DTYPE)
        lr = self.seq_logprob(self.ref_logits)
        rewards, kls = [], []
        for beta in betas.tolist():
            ls = self.optimal_seq_logprob(reward, beta)
            rewards.append(float((ls.exp() * reward).sum()))
            kls.append(float((ls.exp() * (ls - lr)).sum()))
        return Frontier(betas, torch.tensor(rewards, dtype=DTYPE), torch.tensor(kls, dtype=DTYPE))


def rl_frontier(K: int, T: int, eos: int | None, ref_seed: int, ref_scale: float, reward_seed: int,
                reward_scale: float) -> "Frontier":
    """The exact frontier of RL on the tabular model and reward with these settings (model.* and reward.* of
    `model=tabular reward=tabular`), built as klbench.models.policies and klbench.rewards.reward build them:
    what klbench-pareto draws for runs it knows only by their logged params."""
    model = TabularModel(K, T, eos=eos, seed=ref_seed, ref_scale=ref_scale)
    return model.pareto_frontier(TabularReward(model, seed=reward_seed, scale=reward_scale).table)


@dataclass
class Moments:
    mean: torch.Tensor
    trace: float  # trace of the covariance (gradients) or the variance (values)


@dataclass
class Frontier:
    """Exact Pareto frontier: for each beta, the optimum's reward and kl_pi_ref (KL grows as beta falls)."""

    betas: torch.Tensor
    rewards: torch.Tensor
    kls: torch.Tensor

    def best_reward_at(self, kl: float) -> float:
        """Highest reward any policy reaches with kl_pi_ref <= kl (linear interpolation on the frontier)."""
        order = torch.argsort(self.kls)
        k, r = self.kls[order], self.rewards[order]
        if kl <= k[0]:
            return float(r[0])
        if kl >= k[-1]:
            return float(r[-1])
        j = int(torch.searchsorted(k, torch.tensor(kl, dtype=DTYPE)))
        f = (kl - k[j - 1]) / (k[j] - k[j - 1])
        return float(r[j - 1] + f * (r[j] - r[j - 1]))

    def reward_gap(self, reward: float, kl: float) -> float:
        """How much reward a policy at (reward, kl) leaves on the table versus the exact frontier (>= 0)."""
        return self.best_reward_at(kl) - reward


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


# ---- the audit: which exact gradient does an arbitrary loss follow? ----

CANDIDATES = ("kl_pi_ref", "kl_ref_pi", "partial_kl_pi_ref", "partial_kl_ref_pi", "zero")
# with a behaviour policy: the partial gradients whose prefixes are drawn from pi_old (what per-token
# importance ratios give), between the on-policy partials and zero
OLD_CANDIDATES = ("partial_kl_pi_ref@old", "partial_kl_ref_pi@old")
Behaviour = Union[float, Callable[[TabularModel, torch.Tensor], torch.Tensor], Sequence[torch.Tensor], None]


@dataclass
class AuditRow:
    candidate: str
    cosine: float  # mean over instances (nan for zero)
    rel_error: float  # max over instances of |E[g] - g_c| / |g_c| (|E[g]| / |grad kl_pi_ref| for zero)
    scale: float  # least-squares s in E[g] ≈ s g_c, mean over instances


@dataclass
class AuditReport:
    rows: list[AuditRow]
    match: str  # a candidate name, "<scale> x <candidate>", or "none of the above"
    off_policy: bool = False  # samples were drawn from a behaviour policy pi_old != pi
    sampling: str = ""  # the sampling and KL target audited ("" at plain sampling); "@old" is then pi_s

    def __str__(self) -> str:
        width = max(20, *(len(r.candidate) for r in self.rows))
        lines = [f"samples from pi_s ({self.sampling}); candidates of the target's pair"] if self.sampling else []
        if self.off_policy:
            lines.append("samples from a behaviour policy pi_old != pi (KLBatch.old_logp set)" if not self.sampling
                         else "the samples do not come from the target's policy: \"@old\" = prefixes from pi_s")
        lines.append(f"{'candidate':<{width}} {'cosine':>8} {'rel_error':>10} {'scale':>8}")
        for r in self.rows:
            lines.append(f"{r.candidate:<{width}} {r.cosine:>8.4f} {r.rel_error:>10.2e} {r.scale:>8.4f}")
        lines.append(f"expected gradient matches: {self.match}")
        return "\n".join(lines)


def default_instances() -> list[tuple[TabularModel, torch.Tensor]]:
    """Three instances, two with EOS, where the four KL gradients all differ visibly."""
    out = []
    for seed, (K, T, eos) in enumerate([(3, 3, None), (4, 3, 0), (3, 4, 0)]):
        model = TabularModel(K, T, eos=eos, seed=100 + seed)
        out.append((model, model.random_policy(seed=200 + seed)))
    return out


def fixed_length_instances() -> list:
    """Three instances without EOS: every response has T tokens (the conditions of arguments made per token)."""
    out = []
    for seed, (K, T) in enumerate([(3, 3), (4, 3), (3, 4)]):
        model = TabularModel(K, T, eos=None, seed=700 + seed)
        out.append((model, model.random_policy(seed=800 + seed)))
    return out


def near_reference_instances(scale: float = 0.05) -> list:
    """pi = pi_ref + a small perturbation of the logits (variable lengths): where first-order arguments live."""
    out = []
    for model, _ in default_instances():
        out.append((model, model.ref_logits + model.random_policy(seed=900 + model.K, scale=scale)))
    return out


def behaviour_tables(instances: list[tuple[TabularModel, torch.Tensor]], behaviour: Behaviour) -> list:
    """One behaviour table [P, K] (or None) per instance. behaviour: None (on-policy); a float s, for
    pi_old = theta + s * N(0, 1) with a fixed seed per instance; a callable (model, theta) -> table; or a
    list of tables, one per instance."""
    if behaviour is None:
        return [None] * len(instances)
    if isinstance(behaviour, (int, float)) and not isinstance(behaviour, bool):
        if not behaviour > 0:
            raise ValueError(f"behaviour as a float is the scale of pi_old's logit perturbation: > 0, got {behaviour}")
        return [theta.detach() + model.random_policy(seed=300 + i, scale=float(behaviour))
                for i, (model, theta) in enumerate(instances)]
    tables = [behaviour(m, th) for m, th in instances] if callable(behaviour) else list(behaviour)
    if len(tables) != len(instances):
        raise ValueError(f"behaviour: {len(tables)} tables for {len(instances)} instances")
    for (m, _), t in zip(instances, tables):
        if not isinstance(t, torch.Tensor) or t.shape != (m.P, m.K):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"behaviour table must be [P, K] = [{m.P}, {m.K}] logits, got {got}")
    return [t.detach().to(DTYPE) for t in tables]


def audit(surrogate_fn: Surrogate, instances: list[tuple[TabularModel, torch.Tensor]] | None = None,
          n: int = 1, tol: float = 1e-6, behaviour: Behaviour = None, sampling: Sampling | None = None,
          target: str = "sampler") -> AuditReport:
    """Report which exact gradient the expectation of `surrogate_fn(batch) -> Tensor[B]` follows.

    The loss is evaluated on every sequence (every n-tuple of one prompt if n > 1, with `group` set),
    weighted by its exact probability under pi, so the answer has no sampling noise. With `behaviour`
    (see behaviour_tables; e.g. behaviour=0.5) the samples come from pi_old instead, the batch carries
    old_logp, and the candidates include the partial gradients with prefixes from pi_old ("@old").
    With `sampling` (and a KL `target`, klbench.estimators.sampling) the samples come from pi_s, the batch is
    the target's, and the candidates are the target pair's (TabularModel.target_gradients; "@old": prefixes
    from pi_s where the samples do not come from the target's policy).
    """
    instances = default_instances() if instances is None else instances
    olds = behaviour_tables(instances, behaviour)
    means = [model.gradient_moments(surrogate_fn, theta, n=n, behaviour=old, sampling=sampling,
                                    target=target).mean.flatten() for (model, theta), old in zip(instances, olds)]
    return _compare(means, instances, olds, behaviour is not None, sampling, target, tol)


def audit_targets(surrogate_fn: Surrogate, sampling: Sampling, instances: list | None = None, n: int = 1,
                  tol: float = 1e-6) -> dict[str, AuditReport]:
    """For a loss that scores the raw logits itself (as a library does: dividing the policy's, the reference's or
    the old policy's logits by the temperature, or not), with samples from pi_s: which exact gradient its
    expectation follows, against the candidates of every KL target that can be defined under this sampling
    (`model` is left out under truncation, where check_target refuses it). The batch (target RAW) holds the
    untempered logits [B, T, K] and log-probs, on-policy (old_logp None: the library scores pi_old as pi)."""
    instances = default_instances() if instances is None else instances
    means = [model.gradient_moments(surrogate_fn, theta, n=n, sampling=sampling, target=RAW).mean.flatten()
             for model, theta in instances]
    targets = [t for t in KL_TARGETS if not (t == "model" and sampling.truncates)]
    return {t: _compare(means, instances, [None] * len(instances), False, sampling, t, tol) for t in targets}


def _compare(means: list, instances: list, olds: list, off_policy: bool, sampling: Sampling | None, target: str,
             tol: float) -> AuditReport:
    """The AuditReport of the expected gradients `means` (one [P*K] per instance) against the exact candidates."""
    exacts = [{k: v.flatten() for k, v in m.exact_gradients(th, behaviour=old, sampling=sampling,
                                                            target=target).items()}
              for (m, th), old in zip(instances, olds)]
    has_old = all(c in e for e in exacts for c in OLD_CANDIDATES)
    candidates = CANDIDATES if not has_old else CANDIDATES[:4] + OLD_CANDIDATES + ("zero",)
    per = {c: [] for c in candidates}
    for mean, exact in zip(means, exacts):
        ref_norm = exact["kl_pi_ref"].norm()
        for c in candidates:
            g = exact[c]
            if c == "zero":
                per[c].append((float("nan"), float(mean.norm() / ref_norm), 0.0))
                continue
            cos = float(mean @ g / (mean.norm() * g.norm() + 1e-300))
            scale = float(mean @ g / (g @ g))
            per[c].append((cos, float((mean - g).norm() / g.norm()), scale))
    rows = [AuditRow(c, sum(v[0] for v in vals) / len(vals), max(v[1] for v in vals),
                     sum(v[2] for v in vals) / len(vals)) for c, vals in per.items()]
    described = f"{sampling.describe()}, task.kl_target={target}" if sampling is not None else ""
    return AuditReport(rows, _verdict(rows, per, tol), off_policy=off_policy or has_old, sampling=described)


def _verdict(rows: list[AuditRow], per: dict, tol: float) -> str:
    for r in rows:
        if r.rel_error <= tol:
            return r.candidate
    for r in rows:  # proportional: cosine 1 on every instance with one common scale
        if r.candidate != "zero" and all(abs(v[0] - 1) <= tol and abs(v[2] - r.scale) <= tol * max(1, abs(r.scale))
                                         for v in per[r.candidate]):
            return f"{r.scale:.6g} x {r.candidate}"
    return "none of the above"


class TabularReward:
    """A reward table r [N] over the tabular model's sequences: r(y) = scale * N(0, 1), fixed by seed."""

    def __init__(self, model: TabularModel, seed: int = 1, scale: float = 1.0):
        gen = torch.Generator().manual_seed(seed)
        self.table = scale * torch.randn(model.N, generator=gen, dtype=DTYPE)  # [N]

    def __call__(self, ro) -> torch.Tensor:
        """[B] the rewards of a rollout of klbench.models.policies.TabularPolicy, by its sequence ids."""
        return self.table[ro.seq_ids.cpu()]
