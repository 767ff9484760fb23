"""Issue 44's claims about rollout corrections, put to the installed code and the exact mismatch axis
(docs/verdicts.md, after the verdicts of klbench/exact/verdicts.py; `klbench-audit --verdicts docs/verdicts.md`).
Each claim's verdict and consequence are chosen by what the code and the audit found, so a new release flips them."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from klbench.exact.mismatch import AXIS, audit_mismatch, distance
from klbench.libraries.base import LibraryMissing, line_in, line_of

TOL = 1e-5
HEAD = "## Rollout corrections under the training-inference mismatch (issue 44)"


@dataclass
class Claim:
    title: str
    source: str
    claim: str
    rows: list[tuple[str, str]] = field(default_factory=list)  # (conditions, what was found)
    holds: bool | None = None  # None: not decidable here (the reason is the last row)
    consequence: str = ""


def _cell(report, truth: str) -> str:
    d = distance(report, truth)
    return report.match if d <= TOL else f"{report.match} (off {d:.2g} from {truth})"


def _setting(lib: str, name: str):
    from klbench.libraries.mismatch import LOADERS
    return next(s for s in LOADERS[lib]() if s.name == name)


def trl_ratio_not_on_kl() -> Claim:
    c = Claim("TRL's vLLM importance-sampling ratio corrects the policy gradient, not the KL", "TRL 1.16, issue 44",
              "The vLLM importance-sampling ratio multiplies the policy-gradient term only; beta * per_token_kl is "
              "added after it, uncorrected.")
    from trl import GRPOTrainer
    applied = line_of(GRPOTrainer._compute_loss, 'per_token_loss * inputs["importance_sampling_ratio"]')
    kl = line_of(GRPOTrainer._compute_loss, "per_token_loss + self.beta * per_token_kl")
    order = int(kl.rsplit(":", 1)[1]) > int(applied.rsplit(":", 1)[1])
    c.rows.append(("installed code", f"ratio applied at `{applied}`, KL added at `{kl}`"))
    m = AXIS["noise 0.1"]
    s = _setting("trl", "trl.grpo.vllm_is.sequence_truncate")
    pg = audit_mismatch(s.terms["pg"], m, "pg", tol=TOL)
    klr = audit_mismatch(s.terms["kl_loss"], m, tol=TOL)
    c.rows += [(f"`{s.name}`, {m.describe()}: policy-gradient term", _cell(pg, "pg")),
               (f"`{s.name}`, {m.describe()}: KL term", _cell(klr, "kl_pi_ref"))]
    c.holds = order and pg.match == "pg" and klr.match not in ("kl_pi_ref", "kl_ref_pi")
    k2 = (" Its gradient is that of k2 on pi_s's samples with pi_s held fixed (`k2@old`): "
          "E_{pi_s}[sum_t (1/2)(log pi - log pi_ref)^2], which is not a KL, so a GRPO run with beta > 0 under a "
          "mismatch minimises that, not a KL") if klr.match == "k2@old" else ""
    c.consequence = ("the sequence-level ratio makes the PG term exact under the mismatch, and the KL term follows "
                     "no KL gradient." + k2 if c.holds else "the KL term is corrected too in this release")
    return c


def verl_bypass_feeds_rollout_logprobs() -> Claim:
    c = Claim("verl's bypass mode charges the inference engine's log-probs in the KL-in-reward", "verl 0.9.1, issue 44",
              "In bypass mode old_log_probs := rollout_log_probs, and the KL in the reward is computed on "
              "old_log_probs: the reward's KL is the sampler's, not the trainer's.")
    from verl.trainer.ppo import rollout_corr_helper as rch
    sub = line_of(rch.apply_bypass_mode, 'batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]')
    read = line_in("verl", "trainer/ppo/ray_trainer.py", 'data.batch["old_log_probs"], data.batch["ref_log_prob"]')
    c.rows.append(("installed code", f"substitution `{sub}`; apply_kl_penalty reads old_log_probs `{read}`"))
    m = AXIS["noise 0.1"]
    found = {}
    for name in ("verl.rollout_corr.bypass_pg_is", "verl.rollout_corr.decoupled_seq_is"):
        s = _setting("verl", name)
        found[name] = audit_mismatch(s.terms["kl_reward"], m, tol=TOL)
        c.rows.append((f"`{name}`, {m.describe()}: k1 KL in the reward", _cell(found[name], "kl_pi_ref")))
    c.holds = (found["verl.rollout_corr.bypass_pg_is"].match != "kl_pi_ref"
               and found["verl.rollout_corr.decoupled_seq_is"].match == "kl_pi_ref")
    named = found["verl.rollout_corr.bypass_pg_is"].match == "kl_pi_ref_minus_kl_pi_s"
    c.consequence = ("with the same sequence-level IS the decoupled mode's reward KL follows grad KL(pi || pi_ref) "
                     "exactly and the bypass mode's does not: the sampler's k1 enters the reward" +
                     (", and the term follows grad KL(pi || pi_ref) - grad KL(pi || pi_s) with pi_s held fixed "
                      "(`kl_pi_ref_minus_kl_pi_s`): descending it raises KL(pi || pi_s), pushing the trainer away "
                      "from its own sampler" if named else "") +
                     "; use the decoupled mode when the KL matters" if c.holds else
                     "bypass mode's KL in the reward follows grad KL(pi || pi_ref) here")
    return c


def trl_top_p_ratio_is_kept_mass() -> Claim:
    c = Claim("top-p truncation scales the vLLM ratio by the kept mass", "TRL #6789",
              "With a top-p sampler, the per-token ratio pi / pi_s is the mass pi's top-p set keeps (< 1), not 1, "
              "so the correction shrinks every token's gradient by it.")
    from klbench.exact.tabular import default_instances
    from klbench.estimators.sampling import Sampling
    s = _setting("trl", "trl.grpo.vllm_is.token_truncate")
    from trl import GRPOTrainer
    from klbench.libraries.mismatch import _trl_ratio_block
    code, _ = _trl_ratio_block(GRPOTrainer)
    worst = 0.0
    trainer = s.terms["pg"].__defaults__[0]
    for model, theta in default_instances():
        sampler = Sampling(top_p=0.9).process(theta)
        keep_mass = (torch.softmax(theta, -1) * torch.isfinite(sampler)).sum(-1)  # [P] Z of each prefix
        live = model.seq_prob(sampler) > 0
        tok = model.tokens[live].unsqueeze(-1)
        pre, mask = model.seq_prefix[live], model.mask[live]
        lp = torch.log_softmax(theta, -1)[pre].gather(-1, tok).squeeze(-1).masked_fill(~mask, 0)
        ls = torch.log_softmax(sampler, -1)[pre].gather(-1, tok).squeeze(-1).masked_fill(~mask, 0)
        ns = {"self": trainer, "torch": torch, "math": __import__("math"), "tool_mask": None,
              "completion_mask": mask.long(), "old_per_token_logps": lp, "sampling_per_token_logps": ls}
        exec(code, ns)
        ratio = ns["vllm_importance_sampling_ratio"]
        worst = max(worst, float((ratio - keep_mass[pre])[mask].abs().max()))
    c.rows.append(("TRL's own ratio (token_truncate), sampler top-p 0.9, every sequence of the three instances",
                   f"max |ratio - kept mass Z_t| = {worst:.1e}"))
    m = AXIS["sampler top-p 0.9"]
    pg = audit_mismatch(s.terms["pg"], m, "pg", tol=TOL)
    c.rows.append((f"`{s.name}`, {m.describe()}: policy-gradient term", _cell(pg, "pg")))
    c.holds = worst < 1e-9
    c.consequence = ("the ratio is exactly Z_t: the correction multiplies each token's gradient by the kept mass "
                     "and cannot restore the cut tokens (no weight exists for tokens pi_s never draws), so the "
                     "corrected PG is biased under top-p" if c.holds else
                     "the ratio is not the kept mass in this release")
    return c


def skyrl_no_grad_fixed() -> Claim:
    c = Claim("SkyRL's KL loss has a gradient again in skyrl 0.4.0", "SkyRL #1340 / #1353",
              "skyrl-train 0.3.1's compute_approx_kl runs under @torch.no_grad, so its KL loss moves nothing; the "
              "newer release fixes it.")
    from klbench.libraries import load
    from klbench.exact.tabular import audit
    try:
        old = load("skyrl_train").settings["skyrl_train.k3"]
        c.rows.append(("skyrl-train 0.3.1 (`skyrl_train.k3`, installed here)", audit(old.loss, tol=TOL).match))
    except LibraryMissing as e:
        c.rows.append(("skyrl-train 0.3.1", f"not installed: {e}"))
    venv = Path(os.environ.get("KLBENCH_VERSIONS_DIR", Path.home() / ".cache" / "klbench" / "versions"))
    py = venv / "skyrl-0.4.0" / "bin" / "python"
    if not py.exists():
        c.rows.append(("skyrl 0.4.0", "not run: `python scripts/audit_versions.py skyrl==0.4.0` builds its venv"))
        return c
    r = subprocess.run([str(py), "-m", "klbench.libraries.versions", "skyrl"], capture_output=True, text=True,
                       timeout=600, cwd=Path(__file__).resolve().parents[2])
    cells = json.loads(r.stdout.strip().splitlines()[-1])["cells"] if r.returncode == 0 else []
    for cell in cells:
        if cell["setting"] == "skyrl.k3":
            c.rows.append((f"skyrl 0.4.0 `skyrl.k3` ({cell['policy']}-policy; {cell['note']}, `{cell['source']}`)",
                           cell["match"]))
    on = next((x["match"] for x in cells if x["setting"] == "skyrl.k3" and x["policy"] == "on"), None)
    c.holds = None if on is None else on != "zero"
    c.consequence = ("0.4.0's compute_approx_kl has no @torch.no_grad: its k3 KL loss has a gradient again (the "
                     "verdict names which: k3 autodiffed is not the gradient of KL(pi || pi_ref))" if c.holds else
                     "the KL loss still has no gradient" if c.holds is False else "the skyrl venv did not run")
    return c


def verl_topk_clamp() -> Claim:
    c = Claim("verl's top-k log-prob clamp is active in most steps", "verl #7855",
              "In top-k distillation the clamp of student and teacher top-k log-probs at log_prob_min_clamp fires "
              "in most steps.")
    where = line_in("verl", "trainer/distillation/fsdp/losses.py", "student_topk_log_probs.clamp_min(")
    c.rows.append(("installed code", f"`{where}`: clamp_min(log_prob_min_clamp) on both top-k log-prob sets"))
    c.rows.append(("exact?", "how often it fires is a property of a real vocabulary's tail (the k-th log-prob below "
                             "the clamp), which the tabular model (3-4 tokens) does not have: not decidable here"))
    return c


CLAIMS = (trl_ratio_not_on_kl, verl_bypass_feeds_rollout_logprobs, trl_top_p_ratio_is_kept_mass, skyrl_no_grad_fixed,
          verl_topk_clamp)


def run() -> list[Claim]:
    out = []
    for fn in CLAIMS:
        try:
            out.append(fn())
        except (LibraryMissing, ImportError) as e:  # a library that is not installed: one line
            out.append(Claim(fn.__name__, "", "", [("not run", str(e).splitlines()[0])]))
    return out


def markdown(claims: list[Claim]) -> list[str]:
    lines = [HEAD, "",
             "On the exact mismatch axis (docs/mismatch.md; `noise 0.1`: sampler logits = theta + 0.1 N(0, 1)), from "
             "the installed code.", ""]
    for c in claims:
        verdict = {True: "holds", False: "does not hold", None: "not decided here"}[c.holds]
        lines += [f"### {c.title} ({c.source})", "", f"**Claim.** {c.claim}", "", "| conditions | found |", "|---|---|"]
        lines += [f"| {a} | {b} |" for a, b in c.rows]
        lines += ["", f"**Verdict (installed code, exact): {verdict}.** {c.consequence}".rstrip(), ""]
    return lines
