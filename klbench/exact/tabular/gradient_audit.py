"""The audit: which exact gradient does an arbitrary KL loss follow in expectation?

    report = audit(my_loss)                  # my_loss(batch: KLBatch) -> Tensor[B], one loss per sequence
    print(report); report.match              # "kl_pi_ref", "0.5 x kl_ref_pi", "none of the above", ...
    audit_targets(my_loss, sampling)         # a loss that scores the raw logits itself: every KL target's verdict

The loss runs on every sequence of small tabular models (klbench.exact.tabular.model), each weighted by its exact
probability, so the expected gradient has no sampling noise; it is compared with the exact candidates
(TabularModel.exact_gradients, target_gradients).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch

from klbench.estimators.sampling import KL_TARGETS, Sampling
from klbench.exact.tabular.model import DTYPE, RAW, Surrogate, TabularModel


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
        for c in candidates:
            per[c].append(stats(mean, exact[c], exact["kl_pi_ref"]))
    rows = [AuditRow(c, sum(v[0] for v in vals) / len(vals), max(v[1] for v in vals),
                     sum(v[2] for v in vals) / len(vals)) for c, vals in per.items()]
    described = f"{sampling.describe()}, task.kl_target={target}" if sampling is not None else ""
    return AuditReport(rows, _verdict(rows, per, tol), off_policy=off_policy or has_old, sampling=described)


def stats(mean: torch.Tensor, g: torch.Tensor, norm_by: torch.Tensor) -> tuple[float, float, float, float]:
    """(cosine, relative error, least-squares scale s, scaled relative error) of one instance's expected gradient
    `mean` [P*K] against a candidate g [P*K]. The scaled relative error |mean - s g| / |s g| is what a
    "<s> x <candidate>" verdict claims to be small; the cosine is not a substitute (1 - cos ~ err^2 / 2: a cosine
    within 1e-5 of 1 admits a relative error of 4.5e-3). For the zero candidate g = 0: (nan, |mean| / |norm_by|,
    0, inf), where norm_by is the truth's gradient."""
    if not bool(g.any()):
        return float("nan"), float(mean.norm() / norm_by.norm()), 0.0, float("inf")
    scale = float(mean @ g / (g @ g))
    cos = float(mean @ g / (mean.norm() * g.norm() + 1e-300))
    scaled = float((mean - scale * g).norm() / (abs(scale) * g.norm() + 1e-300))
    return cos, float((mean - g).norm() / g.norm()), scale, scaled


def _verdict(rows: list[AuditRow], per: dict, tol: float) -> str:
    """The first candidate within `tol` relative error; else the first candidate that `s x candidate` matches within
    `tol` scaled relative error on every instance, with one common scale s; else "none of the above"."""
    for r in rows:
        if r.rel_error <= tol:
            return r.candidate
    for r in rows:  # proportional: E[g] = s g_c on every instance, s common
        if r.candidate != "zero" and r.scale != 0 and all(
                v[3] <= tol and abs(v[2] - r.scale) <= tol * max(1, abs(r.scale)) for v in per[r.candidate]):
            return f"{r.scale:.6g} x {r.candidate}"
    return "none of the above"
