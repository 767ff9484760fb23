"""Verdicts on open proposals about KL terms (docs/verdicts.md, `klbench-audit --verdicts docs/verdicts.md`).

Each verdict is a claim from a pull request or a post, the setting that puts it to the test (a klbench estimator
with options, a small surrogate written here from the proposal's formula, or the installed library's own code
when the library ships the setting), and the exact tabular audit of that setting: on-policy and off-policy
(samples from pi_old = theta + 0.5 N(0, 1)), on instances with variable-length sequences (EOS) and, where a
claim was argued under other conditions, under those too. The consequence line is chosen by what the exact
audit found, so a change in the math or a library flips it instead of leaving a stale sentence.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from klbench.estimators import KLBatch, gradient_estimator
from klbench.estimators.base import seq_sum
from klbench.exact.tabular import (audit, behaviour_tables, default_instances, fixed_length_instances,
                                   near_reference_instances)

BEHAVIOUR = 0.5
TOL = 1e-6


def k3_token_reward(batch: KLBatch) -> torch.Tensor:
    """[B] per-token k3 as each token's own (detached) cost, no future terms: sum_t sg(k3_t) l_t."""
    rho = batch.rho.detach()
    return seq_sum(torch.where(batch.mask, torch.expm1(-rho) + rho, torch.zeros((), dtype=rho.dtype)) *
                   batch.masked_logp)


def k1_token_reward():
    """per-token k1 as each token's own cost: sum_t sg(rho_t) l_t, which is klbench's `token`."""
    return gradient_estimator("token")


@dataclass
class Case:
    label: str  # the conditions
    loss: Callable[[KLBatch], torch.Tensor]
    n: int = 1
    instances: Callable[[], list] = default_instances
    off_policy: bool = True  # also audit with samples from pi_old
    compare_to: Callable[[KLBatch], torch.Tensor] | None = None  # a second loss: relative gap of the means


@dataclass
class Verdict:
    title: str
    source: str  # where the claim was made
    claim: str
    cases: list[Case]
    holds: Callable[[list[dict]], bool]  # from the case results
    if_holds: str
    if_fails: str
    results: list[dict] = field(default_factory=list)


def _gap(case: Case, behaviour) -> tuple[float, float]:
    """(max over instances of |E[g_loss] - E[g_compare_to]| / |E[g_compare_to]|, max of |E[g_loss]| /
    |E[g_compare_to]|), exact."""
    insts = case.instances()
    olds = behaviour_tables(insts, behaviour)
    worst, size = 0.0, 0.0
    for (model, theta), old in zip(insts, olds):
        a = model.gradient_moments(case.loss, theta, n=case.n, behaviour=old).mean
        b = model.gradient_moments(case.compare_to, theta, n=case.n, behaviour=old).mean
        worst, size = max(worst, float((a - b).norm() / b.norm())), max(size, float(a.norm() / b.norm()))
    return worst, size


def _as_fed(loss: Callable) -> tuple[Callable, str]:
    """An estimator that refuses pi_old's samples is fed them without old_logp, as a library without a ratio
    would be (docs/placement.md does the same), and the cell says so."""
    if hasattr(loss, "supports_off_policy") and not loss.supports_off_policy():
        return (lambda b: loss(replace(b, old_logp=None))), " (no ratio: pi_old's samples as they come)"
    return loss, ""


def run_case(case: Case) -> dict:
    out = {"label": case.label}
    for policy, behaviour in (("on", None), ("off", BEHAVIOUR)):
        if policy == "off" and not case.off_policy:
            out[policy] = "-"
            continue
        if case.compare_to is not None:
            fed = Case(case.label, _as_fed(case.loss)[0], case.n, case.instances,
                       compare_to=_as_fed(case.compare_to)[0])
            gap, size = _gap(fed, behaviour if policy == "off" else None)
            out[policy] = f"relative gap {gap:.3g} (norm ratio {size:.3g})"
        else:
            loss, how = _as_fed(case.loss) if policy == "off" else (case.loss, "")
            report = audit(loss, instances=case.instances(), n=case.n, tol=TOL, behaviour=behaviour)
            out[policy] = report.match + how
            out[policy + "_errors"] = {r.candidate: r.rel_error for r in report.rows}
    return out


def _difference(a: Callable, b: Callable) -> Callable:
    """[B] a - b: a surrogate whose expected gradient is the difference of theirs (each fed as _as_fed feeds it)."""
    fa, fb = _as_fed(a)[0], _as_fed(b)[0]
    return lambda batch: fa(batch) - fb(batch)


def _in_reward(**o) -> Callable:
    return gradient_estimator("in_reward", **o)


def _in_loss(**o) -> Callable:
    return gradient_estimator("in_loss", **o)


def verdicts(library_cells: dict | None = None) -> list[Verdict]:
    """The four verdicts. library_cells: {setting: (on, off)} of installed-library audits to quote (TRL)."""
    lib = library_cells or {}
    out = [
        Verdict(
            "k3 in RLOO's reward", "TRL PR #7096",
            "RLOOTrainer can put k3 instead of k1 in the reward (the sequence KL subtracted from the reward, "
            "leave-one-out baseline) and still follow the gradient of KL(pi || pi_ref).",
            [Case("RLOO: sequence-level score term, LOO baseline, 2 samples per prompt, variable lengths",
                  _in_reward(value="k3", baseline="loo"), n=2),
             Case("the same, against grad kl_pi_ref - grad partial_kl_ref_pi (k1 in the reward minus k3 in the loss)",
                  _in_reward(value="k3", baseline="loo"), n=2, compare_to=_difference(
                      _in_reward(value="k1", baseline="loo"), gradient_estimator("naive_cv"))),
             Case("the same with k1 (TRL's current reward), for contrast", _in_reward(value="k1", baseline="loo"),
                  n=2)],
            lambda r: r[0]["on"] == "kl_pi_ref",
            "k3 may replace k1 in RLOO's reward.",
            "k3 in the reward is biased: its expected gradient is grad kl_pi_ref - grad partial_kl_ref_pi on-policy "
            "(the detached reward drops E[grad k3]; relative gap 0 above), so a run with it does not minimise "
            "KL(pi || pi_ref); keep k1."),
        Verdict(
            "k2 in the loss is unbiased", "SkyRL PR #1445",
            "k2 = (log pi - log pi_ref)^2 / 2 autodiffed in the loss gives an unbiased gradient of KL(pi || pi_ref).",
            [Case("k2 in the loss, no ratio, variable lengths", _in_loss(value="k2", ratio="none")),
             Case("k2 in the loss, no ratio, fixed length", _in_loss(value="k2", ratio="none"),
                  instances=fixed_length_instances),
             Case("k2 in the loss x sg(per-token ratio) (off-policy correction)", _in_loss(value="k2"))],
            lambda r: r[0]["on"] == "kl_pi_ref",
            "k2 in the loss is an unbiased KL gradient.",
            "unbiased only for the prefix-fixed gradient (partial_kl_pi_ref): it ignores how a token changes the "
            "KL of later positions, at fixed length too, and off-policy it needs the per-token ratio to keep even "
            "that; for grad KL(pi || pi_ref) use k1 in the reward or rb."),
        Verdict(
            "k1 and k3 in the reward have identical expected gradients", "a 2026 blog post on reverse-KL "
            "minimisation (the \"+1\" argument: k3 = k1 + (r - 1) with E_pi[r] = 1)",
            "Since E_pi[pi_ref / pi] = 1, the extra r - 1 of k3 has mean zero, so k1 and k3 in the reward give the "
            "same expected gradient.",
            [Case("the blog's conditions: per-token reward (each token's own k, no future terms), fixed length; "
                  "gap between k3's and k1's expected gradients", k3_token_reward, instances=fixed_length_instances,
                  compare_to=k1_token_reward()),
             Case("the blog's conditions: k3 against k1 minus the prefix-fixed grad KL(pi_ref || pi) (`token` "
                  "minus k3 in the loss)", k3_token_reward, instances=fixed_length_instances,
                  compare_to=_difference(k1_token_reward(), gradient_estimator("naive_cv"))),
             Case("the same, pi near pi_ref (logits pi_ref + 0.05 N(0, 1)), variable lengths", k3_token_reward,
                  instances=near_reference_instances, compare_to=k1_token_reward()),
             Case("the usual conditions: sequence-level score function, variable lengths; gap k3 vs k1",
                  _in_reward(value="k3"), compare_to=_in_reward(value="k1")),
             Case("the usual conditions, k3 in the reward: what it follows", _in_reward(value="k3"))],
            lambda r: float(r[0]["on"].split()[2]) < 1e-6,  # identical under the blog's own conditions
            "k1 and k3 are interchangeable in the reward.",
            "the mean of r - 1 is zero but the mean of (r - 1) grad log pi is not: it is -grad of the prefix-fixed "
            "KL(pi_ref || pi) (relative gap 0 in the second row), even under the blog's own conditions. The claim "
            "holds only where pi = pi_ref at every prefix (r = 1): in RL the first step from pi = pi_ref, in "
            "distillation never (the student starts away from the teacher); near pi_ref the two terms cancel and "
            "k3's per-token gradient is a small fraction of k1's (norm ratio above), and under the usual "
            "sequence-level conditions k3 follows no KL gradient."),
        Verdict(
            "the per-token ratio for TRL's bias correction under sequence-level IS", "TRL #7188",
            "With importance_sampling_level=\"sequence\", the k3 bias correction (use_bias_correction_kl) should "
            "use the per-token ratio pi / pi_old rather than the sequence-level one.",
            [Case("k3 x differentiable per-token ratio (the proposal), variable lengths",
                  _in_loss(value="k3", ratio="token", ratio_grad="differentiable"))],
            lambda r: r[0]["on"] == "partial_kl_pi_ref" and r[0]["off"] == "partial_kl_pi_ref@old",
            "the per-token ratio gives the KL term the prefix-fixed gradient of KL(pi || pi_ref) on- and off-policy "
            "(as token-level IS does), where TRL's sequence-level ratio follows none: adopt it (the full "
            "grad KL(pi || pi_ref) still needs k1 in the reward or rb).",
            "the per-token ratio does not fix the KL term under sequence-level IS."),
    ]
    seq = lib.get("trl.grpo.sequence_is")
    if seq is not None:  # the installed TRL's own code at sequence level, quoted beside the proposal
        out[3].results_prefix = [{"label": "TRL 1.16.0's own _compute_loss, importance_sampling_level=sequence "
                                  "(installed code, docs/libraries.md)", "on": seq[0], "off": seq[1]}]
    return out


def run(library_cells: dict | None = None) -> list[Verdict]:
    vs = verdicts(library_cells)
    for v in vs:
        v.results = getattr(v, "results_prefix", []) + [run_case(c) for c in v.cases]
    return vs


def markdown(vs: list[Verdict], seconds: float) -> str:
    lines = ["# Verdicts on open proposals (generated)", "",
             "Generated by `klbench-audit --verdicts docs/verdicts.md`; do not edit by hand. Each claim is put to the",
             "exact tabular audit (`klbench.exact.tabular.audit`, klbench/exact/verdicts.py): the expected gradient",
             "of the setting, by enumeration, against the candidates of docs/estimators.md, on-policy and off-policy",
             f"(samples from pi_old = theta + {BEHAVIOUR} N(0, 1)), on instances with variable-length sequences",
             "(two of three end at EOS) unless a row says otherwise. \"relative gap\" rows compare two settings'",
             "expected gradients directly (max over instances of |E[g_a] - E[g_b]| / |E[g_b]|; 0 means identical).",
             f"Run time: {seconds:.1f} s.", ""]
    for v in vs:
        ok = v.holds(v.results[len(v.results) - len(v.cases):])
        lines += [f"## {v.title} ({v.source})", "", f"**Claim.** {v.claim}", "",
                  "| conditions | on-policy | off-policy |", "|---|---|---|"]
        lines += [f"| {r['label']} | {r['on']} | {r['off']} |" for r in v.results]
        lines += ["", f"**Verdict: {'holds' if ok else 'does not hold'}.** {v.if_holds if ok else v.if_fails}", ""]
    return "\n".join(lines)
