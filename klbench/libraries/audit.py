"""Runs every library setting through klbench.exact.tabular.audit, on-policy and under a behaviour policy,
and renders the results as a text table or a markdown page."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from klbench.estimators.sampling import Sampling
from klbench.exact.tabular import audit, audit_targets
from klbench.libraries import ALL, PINNED, LibraryMissing, Setting, load
from klbench.libraries.base import ClampRecorder

BEHAVIOUR = 0.5  # pi_old = theta + 0.5 N(0, 1), as in docs/placement.md
TOL = 1e-5  # OpenRLHF and AReaL compute in float32: 1e-6 would reject their exact matches on rounding
# the sampling axis: each setting with Setting.scored is audited on-policy with samples from these samplers, its
# library scoring the raw logits as it does, against every KL target's candidates (docs/sampling.md)
SAMPLINGS = {"T = 0.7": Sampling(0.7), "T = 0.7, top-p 0.9": Sampling(0.7, top_p=0.9)}


@dataclass
class Cell:
    library: str
    version: str
    setting: str
    policy: str  # "on" or "off"
    match: str  # the audit's verdict, or "raised ...", or "skipped: ..."
    rel_errors: dict[str, float] = field(default_factory=dict)
    clamps: list[str] = field(default_factory=list)  # file:line of library clamps that changed a value
    source: str = ""
    aggregation: str = ""
    note: str = ""
    transcription: str = ""  # klbench's worked example of the same setting (klbench.exact.examples), if any
    transcription_match: str = ""  # what that transcription audits as under the same policy
    task: str = "rl"  # Setting.task: "rl" (pi_ref a reference) or "distill" (pi = student, pi_ref = teacher)
    sampled: dict[str, str] = field(default_factory=dict)  # SAMPLINGS label -> verdict (on-policy cells only)
    divides_by_t: str = ""  # Setting.divides_by_t


# klbench's own worked examples of these settings (klbench/exact/examples.py) and the samples per prompt they
# need: audited next to the library's code, so the page shows where the transcription and the code disagree
TRANSCRIPTIONS = {
    "trl.grpo": ("grpo_k3_bias_corrected_loss", 1),
    "trl.grpo.no_bias_correction": ("grpo_k3_loss", 1),
    "trl.rloo.no_clip": ("rloo_k1_in_reward_loss", 2),
    "verl.kl_penalty.mse": ("k2_mse_loss", 1),
    "openrlhf.k3.unbiased": ("openrlhf_unbiased_gradient_loss", 1),
}


def _finite(loss):
    def checked(batch):
        out = loss(batch)
        if isinstance(out, torch.Tensor) and not torch.isfinite(out).all():
            raise FloatingPointError(f"the library returned non-finite values ({int((~torch.isfinite(out)).sum())} "
                                     f"of {out.numel()})")
        return out
    return checked


def run_setting(library: str, version: str, s: Setting) -> list[Cell]:
    cells = []
    for policy, behaviour in (("on", None), ("off", BEHAVIOUR)):
        rec = ClampRecorder()
        cell = Cell(library, version, s.name, policy, "", source=s.source, aggregation=s.aggregation, note=s.note,
                    task=s.task)
        if s.name in TRANSCRIPTIONS:
            cell.transcription, cell.transcription_match = _transcription(s.name, behaviour)
        try:
            with rec.active():
                report = audit(_finite(s.loss), tol=TOL, behaviour=behaviour)
            cell.match = report.match
            cell.rel_errors = {r.candidate: r.rel_error for r in report.rows}
        except Exception as e:  # a library failure is this cell's result, not the audit's crash
            cell.match = f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        cell.clamps = sorted(rec.fired)
        cells.append(cell)
    cells[0].divides_by_t = s.divides_by_t
    if s.scored is not None:
        cells[0].sampled = {label: sampled_verdict(s.scored, sampling) for label, sampling in SAMPLINGS.items()}
    return cells


def sampled_verdict(scored, sampling: Sampling) -> str:
    """Which exact gradient a library's own scoring follows with samples from `sampling`: 'candidate of target'
    for each KL target it matches (targets giving the same verdict joined by '='), or 'none of the above', or
    the library's error."""
    rec = ClampRecorder()
    try:
        with rec.active():
            reports = audit_targets(_finite(functools.partial(scored, sampling=sampling)), sampling, tol=TOL)
    except Exception as e:
        return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    by_match: dict[str, list[str]] = {}
    for target, r in reports.items():
        if r.match != "none of the above":
            by_match.setdefault(r.match, []).append(target)
    clamp = f" (clamp fired: {', '.join(sorted(rec.fired))})" if rec.fired else ""
    if not by_match:
        return "none of the above" + clamp
    # zero is zero against every target's pair: no target to name
    return "; ".join(m if m == "zero" else f"{m} of {' = '.join(ts)}" for m, ts in by_match.items()) + clamp


def _transcription(setting: str, behaviour) -> tuple[str, str]:
    from klbench.exact import examples

    name, n = TRANSCRIPTIONS[setting]
    return f"examples.{name}", audit(getattr(examples, name), n=n, tol=TOL, behaviour=behaviour).match


def resolve(names: list[str]) -> list[tuple[str, str | None]]:
    """(library, setting or None) for each name: a library name, or a setting like 'trl.grpo'."""
    out = []
    for n in names:
        lib = n.split(".")[0]
        if lib not in ALL:
            raise ValueError(f"unknown library {lib!r} in {n!r}; known: {', '.join(ALL)}")
        out.append((lib, None if n == lib else n))
    return out


def run(names: list[str]) -> list[Cell]:
    """Audit the named libraries / settings; absent libraries come back as one 'skipped' cell each."""
    cells = []
    for lib_name, setting in resolve(names):
        try:
            lib = load(lib_name)
        except LibraryMissing as e:
            cells.append(Cell(lib_name, PINNED.get(lib_name, "-"), setting or "*", "-", f"skipped: {e}"))
            continue
        if setting is not None and setting not in lib.settings:
            raise ValueError(f"unknown setting {setting!r}; valid: {', '.join(lib.settings)}")
        for s in lib.settings.values():
            if setting is None or s.name == setting:
                cells.extend(run_setting(lib_name, lib.version, s))
    return cells


def _errors(c: Cell) -> str:
    return " ".join(f"{k}={v:.2g}" for k, v in c.rel_errors.items() if k != "zero")


def text_table(cells: list[Cell]) -> str:
    w = max([len(c.setting) for c in cells] + [10])
    lines = [f"{'library':<18} {'setting':<{w}} {'policy':<6} {'match':<34} clamp fired / rel_error"]
    for c in cells:
        lib = f"{c.library} {c.version}"
        clamp = ("clamp " + ",".join(c.clamps)) if c.clamps else "no clamp"
        tail = f"{clamp}; {_errors(c)}" if c.rel_errors else ""
        lines.append(f"{lib:<18} {c.setting:<{w}} {c.policy:<6} {c.match:<34} {tail}")
        if c.transcription:
            lines.append(f"{'':<18} {'  klbench ' + c.transcription:<{w}} {c.policy:<6} {c.transcription_match}")
        for label, verdict in c.sampled.items():
            lines.append(f"{'':<18} {'  at ' + label:<{w}} {c.policy:<6} {verdict}")
    return "\n".join(lines)


def markdown(cells: list[Cell], seconds: float) -> str:
    head = ["# What the libraries' own KL code follows (generated)", "",
            "Generated by `klbench-audit --all --markdown docs/libraries.md`; do not edit by hand. Each setting",
            "is the installed library's own function (klbench/libraries/), audited with",
            "`klbench.exact.tabular.audit` on the exact tabular model: on-policy, and off-policy with samples from",
            f"pi_old = theta + {BEHAVIOUR} N(0, 1) (`KLBatch.old_logp` set), tolerance {TOL:g}. \"match\" names the",
            "candidate expected gradient (see docs/estimators.md); rel_error is the largest relative error over",
            "the three instances against each candidate. \"clamp\" lists library clamps that changed a value.",
            f"Audit run time: {seconds:.1f} s.", "",
            "Where klbench's own worked example of a setting (klbench/exact/examples.py, a transcription of the",
            "math, not the library's code) audits differently from the library's code, both are shown.", "",
            "Every setting also trains as an estimator (`estimator=library estimator.setting=<setting>`; RL settings",
            "with `task=rl`, distillation settings with `task=distill`); what TRL's default GRPO KL and verl's",
            "`low_var_kl` do to the reward-KL frontier, against `rb`, is in",
            "[library-estimators.md](library-estimators.md).", "",
            "Two sections are made by other commands and kept when this page is regenerated: \"Under a",
            "training-inference mismatch\" (`--mismatch docs/mismatch.md`: each rollout correction's KL and",
            "policy-gradient verdicts when the sampler is not the trainer, [mismatch.md](mismatch.md)) and \"Versions",
            "over time\" (`python scripts/audit_versions.py`: the same settings on older TRL and verl releases).", "",
            "## RL: a KL penalty against the reference pi_ref", ""]
    table = ["| library | setting | on-policy | off-policy | clamp fired | code (file:line) | aggregation | options |",
             "|---|---|---|---|---|---|---|---|"]
    distill_head = ["", "## On-policy distillation: pi = the student, pi_ref = the teacher", "",
                    "The same audit, read with pi = student and pi_ref = teacher: `kl_pi_ref` is the gradient of",
                    "KL(student || teacher) over whole sequences, `kl_ref_pi` of KL(teacher || student), and the",
                    "`partial_` forms hold the sampled prefixes fixed (each position's distribution matched to the",
                    "teacher's, no credit for steering later prefixes). Samples come from the student (on-policy) or",
                    "from an older student (off-policy).", ""]
    rows = {"rl": [], "distill": []}
    missing, seen = [], {}
    for c in cells:
        seen.setdefault((c.library, c.setting), []).append(c)
    for (lib, setting), cs in seen.items():
        if cs[0].policy == "-":
            missing.append(f"| {lib} {cs[0].version} | {setting} | {cs[0].match} |")
            continue
        on, off = cs[0], cs[1]
        clamp = "; ".join(f"{p}: {','.join(c.clamps)}" for p, c in (("on", on), ("off", off)) if c.clamps) or "no"
        out = rows[on.task]
        out.append(f"| {lib} {on.version} | `{setting}` | {_md_match(on)} | {_md_match(off)} | {clamp} | "
                   f"`{on.source}` | {on.aggregation} | {on.note} |")
        if on.transcription:
            differs = "; **differs from the library**" if (on.transcription_match, off.transcription_match) != (
                on.match, off.match) else ""
            out.append(f"| klbench | `{on.transcription}` (transcription of `{setting}`{differs}) | "
                       f"{_md_match_str(on.transcription_match)} | {_md_match_str(off.transcription_match)} "
                       f"| | `klbench/exact/examples.py` | | |")
    body = head + table + rows["rl"]
    if rows["distill"]:
        body += distill_head + table + rows["distill"]
    body += _sampling_section(seen)
    if missing:
        body += ["", "## Not audited here", "", "Libraries (or settings) that did not run, each with the reason:",
                 "not installed, another version, an import that fails (its last line and the pip line), or",
                 "a library that cannot be installed on this platform (klbench/libraries/unavailable.py).", "",
                 "| library | setting | reason |", "|---|---|---|"] + missing
    detail = ["", "## Relative errors", "", "| setting | policy | relative error against each candidate |",
              "|---|---|---|"]
    detail += [f"| `{c.setting}` | {c.policy} | {_errors(c)} |" for c in cells if c.rel_errors]
    return "\n".join(body + detail) + "\n"


def _sampling_section(seen: dict) -> list[str]:
    rows, where = [], {}
    for (lib, setting), cs in seen.items():
        on = cs[0]
        if on.policy == "-" or not (on.sampled or on.divides_by_t):
            continue
        verdicts = [_md_match_str(on.sampled[k]) if k in on.sampled else "not called" for k in SAMPLINGS]
        short, _, detail = on.divides_by_t.partition(": ")  # "policy, reference and old: <where, file:line>"
        rows.append(f"| {lib} {on.version} | `{setting}` | {' | '.join(verdicts)} | {short} |")
        where.setdefault(f"{lib} {on.version}", set()).add(on.divides_by_t)
    if not rows:
        return []
    notes = ["", "Where each library divides by the temperature, read from the installed package:", ""]
    notes += [f"- {lib}: {d}" for lib, ds in where.items() for d in sorted(ds)]
    labels = list(SAMPLINGS)
    return ["", "## At a temperature, and under top-p truncation", "",
            "The same settings with samples from a sampler at temperature 0.7, and at 0.7 with top-p 0.9 (pi_s,",
            "`klbench.estimators.sampling.Sampling`), on-policy, each library scoring the untempered logits its own",
            "way (`klbench.exact.tabular.audit_targets`). The verdict names the candidate and the KL target whose",
            "pair it is (docs/sampling.md): `sampler` KL(pi_s || pi_ref,T), `model` KL(pi || pi_ref) (not defined",
            "under truncation), `tempered` KL(pi_T || pi_ref,T), `tempered_vs_raw` KL(pi_T || pi_ref); at a",
            "temperature alone `sampler` and `tempered` are one pair. \"not called\": the adapter cannot call the",
            "library's scoring; the last column says where the library divides by T.", "",
            f"| library | setting | {' | '.join(labels)} | divides by T: policy / reference / old |",
            "|---|---|" + "---|" * len(labels) + "---|"] + rows + notes


def _md_match(c: Cell) -> str:
    return _md_match_str(c.match)


def _md_match_str(m: str) -> str:
    return f"**{m}**" if m.startswith("none of the above") else m
