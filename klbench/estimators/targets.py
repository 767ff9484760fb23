"""The KL targets and the sampling rules, declared once and without torch: read by klbench.estimators.sampling
(Sampling, check_target: the rollouts and the scoring) and by klbench.config.schema (before torch is imported).

    KL_TARGETS["model"]                       # what task.kl_target=model compares, in words
    is_plain(1.0, 0, 1.0)                     # True: pi_s = pi, every target is one pair
    truncated_model_target("top_k=5")         # the one line that refuses kl_target=model under truncation

Which KL each target names, and which estimators serve it: klbench/estimators/sampling.py and docs/sampling.md.
"""
from __future__ import annotations

# task.kl_target: the pair of distributions whose KL a run regularises and reports
KL_TARGETS = {
    "sampler": "KL(pi_s || pi_ref,T): the sampler's distribution against the reference at its temperature",
    "model": "KL(pi || pi_ref) of the untempered models, pi_s a behaviour policy (importance weights)",
    "tempered": "KL(pi_T || pi_ref,T): both divided by the temperature, full vocabulary (TRL, verl)",
    "tempered_vs_raw": "KL(pi_T || pi_ref): the tempered policy against the raw reference (tinker-cookbook #689)",
}


def truncates(top_k: int, top_p: float) -> bool:
    """Whether the sampler cuts tokens (top_k 0 and top_p 1 cut nothing)."""
    return top_k > 0 or top_p < 1


def is_plain(temperature: float, top_k: int, top_p: float) -> bool:
    """Temperature 1, nothing cut: the sampler pi_s is the policy pi."""
    return temperature == 1 and not truncates(top_k, top_p)


def truncated_model_target(sampling: str) -> str:
    """The refusal of kl_target=model under a truncating sampler (`sampling` says which: "top_k=5")."""
    return (f"task.kl_target=model with {sampling}: the truncated sampler never draws the tokens it cuts, so no "
            "importance weight recovers KL(pi || pi_ref); use task.kl_target=sampler, or sample without truncation "
            "(task.top_k=0 task.top_p=1)")
