"""The training-inference mismatch on the exact tabular model (docs/mismatch.md).

A rollout engine samples from pi_s, the trainer scores pi; they differ. Here pi_s is the trainer's table theta
perturbed in a controlled, enumerable way (a `Mismatch`), and the sampler's own log-probs travel with the samples as
a vLLM rollout's do: the audit's batch carries them as `KLBatch.old_logp` (exact, float64), while the trainer's own
recomputation of the rollout policy is `logp.detach()` (same weights, the trainer's arithmetic).

Two terms of a loss are audited separately, each against its own exact candidates:
  KL term: tabular's candidates with pi_s as the behaviour table (kl_pi_ref, kl_ref_pi, the partials, and
           "@old" = the partials with prefixes drawn from pi_s), and the two that name what the libraries' terms
           follow under a mismatch (sampler_kl_gradients): kl_pi_ref_minus_kl_pi_s (the engine's log-probs
           charged in the reward) and k2@old (k2 on pi_s's samples: a KL in the loss with no mismatch weight).
  PG term: the loss is called as loss(batch, reward [B]) with the reward table's R(y) and minimised, so minus its
           expected gradient is compared with the candidates
           pg = grad E_pi[R] (what a full correction gives), token_is_pg = E_{pi_s}[sum_t w_t R grad log pi_t]
           with w_t = pi / pi_s per token (a per-token correction: prefixes and continuations stay pi_s's), and
           uncorrected_pg = E_{pi_s}[R grad log pi(y)] (no correction). With no mismatch the three coincide.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from klbench.estimators.sampling import Sampling
from klbench.exact.tabular import (DTYPE, AuditReport, AuditRow, TabularModel, TabularReward, behaviour_tables,
                                   default_instances)
from klbench.exact.tabular.gradient_audit import _verdict, stats

KINDS = {
    "noise": "sampler logits = theta + size * N(0, 1) (kernel and rounding noise; 2^-8 is bf16's half-ulp at |x| = 1)",
    "temperature": "sampler logits = theta / size, the trainer scores theta (a temperature on one side only)",
    "top_p": "sampler = top-p(size) of theta, renormalised over the kept tokens (cuts support)",
    "stale": "sampler = theta taken size steps back along the exact gradient of E[R] - 0.1 KL (lr 0.5)",
}
STALE_LR, STALE_BETA = 0.5, 0.1
PG_CANDIDATES = ("pg", "token_is_pg", "uncorrected_pg")


@dataclass(frozen=True)
class Mismatch:
    kind: str
    size: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mismatch kind {self.kind!r} is unknown; valid: {', '.join(KINDS)}")
        ok = {"noise": self.size > 0, "temperature": self.size > 0, "top_p": 0 < self.size <= 1,
              "stale": float(self.size).is_integer() and self.size >= 1}[self.kind]
        if not ok:
            raise ValueError(f"mismatch {self.kind} size must be {_SIZES[self.kind]}, got {self.size!r}")

    @property
    def keeps_support(self) -> bool:
        """True when pi_s gives every token pi gives a positive probability (importance weights exist)."""
        return self.kind != "top_p"

    def describe(self) -> str:
        return {"noise": f"logit noise {self.size:g}", "temperature": f"sampler-only T {self.size:g}",
                "top_p": f"sampler top-p {self.size:g}", "stale": f"{int(self.size)} steps stale"}[self.kind]

    def sampler_table(self, model, theta: torch.Tensor) -> torch.Tensor:
        """[P, K] logits of pi_s (-inf on cut tokens), detached. Only the tabular model has the exact truth."""
        if not isinstance(model, TabularModel):
            raise ValueError(f"mismatch {self.describe()!r} needs the exact tabular model (model=tabular); "
                             f"{type(model).__name__} has no exact truth to audit against")
        th = theta.detach().to(DTYPE)
        if self.kind == "noise":
            return th + model.random_policy(seed=600 + model.P, scale=self.size)
        if self.kind == "temperature":
            return th / self.size
        if self.kind == "top_p":
            return Sampling(top_p=self.size).process(th)
        return _stale(model, th, int(self.size))


_SIZES = {"noise": "> 0", "temperature": "> 0", "top_p": "in (0, 1]", "stale": "an integer >= 1 (steps)"}

# the axis every library setting is audited on (docs/mismatch.md)
AXIS = {
    "bf16 noise": Mismatch("noise", 2.0 ** -8),
    "noise 0.1": Mismatch("noise", 0.1),
    "sampler T 0.8": Mismatch("temperature", 0.8),
    "sampler top-p 0.9": Mismatch("top_p", 0.9),
    "2 steps stale": Mismatch("stale", 2),
}


def _stale(model: TabularModel, theta: torch.Tensor, k: int) -> torch.Tensor:
    """theta as it was k steps ago under exact gradient ascent on E[R] - beta KL(pi || pi_ref) (one step back
    per step, along the gradient at the later point: the same weights a lagging sampler would hold)."""
    reward = TabularReward(model, seed=1).table
    t = theta.clone()
    for _ in range(k):
        x = t.clone().requires_grad_()
        obj = model.expected_reward(x, reward) - STALE_BETA * model.kl_pi_ref(x)
        t = t - STALE_LR * torch.autograd.grad(obj, x)[0]
    return t


def pg_gradients(model: TabularModel, theta: torch.Tensor, sampler: torch.Tensor,
                 reward: torch.Tensor) -> dict[str, torch.Tensor]:
    """The exact PG candidates [P, K] (module docstring) for samples from the sampler table [P, K]."""
    ps_seq = model.seq_prob(sampler)  # [N] exact zeros through cut tokens
    live = ps_seq > 0
    tok = model.tokens.unsqueeze(-1)

    def token_probs(table):  # [N, T] pi(y_t | y_<t), 1 on padding
        p = torch.softmax(table, -1)[model.seq_prefix].gather(-1, tok).squeeze(-1)
        return torch.where(model.mask, p, torch.ones((), dtype=p.dtype))

    ps_tok = token_probs(sampler).detach()
    r = reward.to(DTYPE)

    def token_is(t):  # sum_n P_s(n) R(n) sum_t pi(y_t) / pi_s(y_t): its gradient is the per-token IS PG
        ratio = torch.where(model.mask & live[:, None], token_probs(t) / torch.where(live[:, None], ps_tok, 1.0), 0.0)
        return (ps_seq * r * ratio.sum(-1)).sum()

    fns = {"pg": lambda t: model.expected_reward(t, r),
           "token_is_pg": token_is,
           "uncorrected_pg": lambda t: (torch.where(live, ps_seq * r * model.seq_logprob(t), 0.0)).sum()}
    out = {}
    for name, fn in fns.items():
        x = theta.detach().clone().requires_grad_()
        out[name] = torch.autograd.grad(fn(x), x)[0]
    out["zero"] = torch.zeros_like(theta)
    return out


def sampler_kl_gradients(model: TabularModel, theta: torch.Tensor, sampler: torch.Tensor) -> dict[str, torch.Tensor]:
    """The two exact KL-term candidates [P, K] that name what the libraries' terms do under a mismatch, pi_s (the
    sampler table [P, K]) held fixed:

      kl_pi_ref_minus_kl_pi_s = grad KL(pi || pi_ref) - grad KL(pi || pi_s): the engine's log-probs charged in the
          reward, c(y) = sum_t log pi_s(y_t) - log pi_ref(y_t), through a PG loss with the exact sequence weight
          pi(y) / pi_s(y): E_{pi_s}[w c grad log pi(y)] = E_pi[c grad log pi(y)] = grad E_pi[c] with c fixed
          = grad KL(pi || pi_ref) - grad KL(pi || pi_s) (E_pi[grad log pi] = 0). Descending it raises
          KL(pi || pi_s): the trainer is pushed away from its own sampler. Left out where pi_s cuts support
          (KL(pi || pi_s) is infinite there).
      k2@old = grad E_{pi_s}[sum_t (1/2)(log pi(y_t) - log pi_ref(y_t))^2]: k2 on pi_s's samples, what a KL in the
          loss whose gradient is (log pi - log pi_ref) grad log pi per token follows (TRL's k3 with its bias
          correction, verl's low_var_kl+), with no weight for the mismatch. Not a KL: at pi_s = pi it is the
          prefix-fixed partial_kl_pi_ref, otherwise neither pi_s's prefixes nor its tokens are corrected.
    """
    sampler = sampler.detach().to(DTYPE)
    ps_seq = model.seq_prob(sampler)  # [N] exact zeros through cut tokens
    live = ps_seq > 0
    tok = model.tokens.unsqueeze(-1)

    def token_logp(table):  # [N, T] log pi(y_t | y_<t), 0 on padding
        lp = torch.log_softmax(table, -1)[model.seq_prefix].gather(-1, tok).squeeze(-1)
        return torch.where(model.mask, lp, torch.zeros((), dtype=lp.dtype))

    ref = token_logp(model.ref_logits)  # [N, T]

    def k2(t):
        half_sq = 0.5 * (token_logp(t) - ref) ** 2  # [N, T]
        return torch.where(live, ps_seq * half_sq.sum(-1), torch.zeros((), dtype=DTYPE)).sum()

    fns = [("k2@old", k2)]
    if bool(torch.isfinite(sampler).all()):
        fns.insert(0, ("kl_pi_ref_minus_kl_pi_s", lambda t: model.kl_pi_ref(t) - model.pair_kl(t, sampler)))
    out = {}
    for name, fn in fns:
        x = theta.detach().clone().requires_grad_()
        out[name] = torch.autograd.grad(fn(x), x)[0]
    return out


def audit_mismatch(loss: Callable, mismatch: Mismatch | None, term: str = "kl", instances: list | None = None,
                   tol: float = 1e-6, n: int = 1) -> AuditReport:
    """Which exact gradient the expectation of `loss` follows with samples from pi_s = mismatch(theta), the batch
    carrying the sampler's log-probs as old_logp. term "kl": loss(batch) -> [B], tabular's candidates; term "pg":
    loss(batch, reward [B]) -> [B], the PG candidates. mismatch None: no mismatch, and still old_logp = the
    sampler's (= pi's) log-probs, as a rollout engine sends them. n: samples per prompt (loo needs 2)."""
    if term not in ("kl", "pg"):
        raise ValueError(f"term must be 'kl' or 'pg', got {term!r}")
    instances = default_instances() if instances is None else instances
    olds = behaviour_tables(instances, lambda m, th: th.detach().clone() if mismatch is None
                            else mismatch.sampler_table(m, th))
    means, exacts = [], []
    for (model, theta), old in zip(instances, olds):
        reward = TabularReward(model, seed=1).table if term == "pg" else None
        fn = loss if term == "kl" else (lambda b, r: -loss(b, r))  # a PG loss is minimised: -grad is the ascent
        means.append(model.gradient_moments(fn, theta, n=n, behaviour=old, reward=reward).mean.flatten())
        ex = (pg_gradients(model, theta, old, reward) if term == "pg" else
              {**model.exact_gradients(theta, behaviour=old), **sampler_kl_gradients(model, theta, old)})
        exacts.append({k: v.flatten() for k, v in ex.items()})
    candidates = [c for c in exacts[0] if c != "zero"] + ["zero"]
    norm_key = "pg" if term == "pg" else "kl_pi_ref"
    per = {c: [stats(mean, exact[c], exact[norm_key]) for mean, exact in zip(means, exacts)] for c in candidates}
    rows = [AuditRow(c, sum(v[0] for v in vals) / len(vals), max(v[1] for v in vals),
                     sum(v[2] for v in vals) / len(vals)) for c, vals in per.items()]
    return AuditReport(rows, _verdict(rows, per, tol), off_policy=mismatch is not None,
                       sampling="" if mismatch is None else mismatch.describe())


def distance(report: AuditReport, candidate: str) -> float:
    """The report's relative error against one candidate: how far off a term is from what it should follow."""
    return next(r.rel_error for r in report.rows if r.candidate == candidate)
