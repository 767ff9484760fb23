"""Print the placement grid of docs/placement.md: the audit's verdict for every (value x placement) cell, with
samples from pi (on-policy) and from a behaviour policy pi_old (off-policy), on the audit's three default
tabular instances (exact enumeration, no sampling).

    python scripts/placement_grid.py            # its run time: docs/placement.md

Off-policy: pi_old = theta + 0.5 * N(0, 1) per instance (klbench.exact.tabular.behaviour_tables(..., 0.5)). An
estimator that refuses old_logp != logp is audited with old_logp withheld (what it would do if it were fed
pi_old's samples anyway), and marked so.

    python scripts/placement_grid.py --targets   # the KL-target axis instead (docs/placement.md, docs/sampling.md)

The target axis: samples from pi_s, batches from klbench.estimators.sampling.target_batch, the candidates those of
the target's pair (TabularModel.target_gradients), at the settings of TARGET_COLUMNS.
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from klbench.estimators import gradient_estimator
from klbench.estimators.sampling import Sampling
from klbench.exact.tabular import audit

CELLS = [  # (cell, estimator, options, n, known name)
    ("k1 in reward", "in_reward", {"value": "k1"}, 1, "`seq`; RLOO/TRL RLOOTrainer KL"),
    ("k1 in reward, reward-to-go", "in_reward", {"value": "k1", "form": "reward_to_go"}, 1, "`cumulative`; PPO per-token KL reward"),
    ("k1 in reward, loo baseline", "in_reward", {"value": "k1", "baseline": "loo"}, 2, "`loo`"),
    ("k2 in reward", "in_reward", {"value": "k2"}, 1, ""),
    ("k3 in reward", "in_reward", {"value": "k3"}, 1, ""),
    ("k1 in loss", "in_loss", {"value": "k1", "ratio": "none"}, 1, "`naive_mc`"),
    ("k2 in loss", "in_loss", {"value": "k2", "ratio": "none"}, 1, "`token` (same gradient); verl mse"),
    ("k3 in loss", "in_loss", {"value": "k3", "ratio": "none"}, 1, "`naive_cv`; GRPO, verl low_var_kl"),
    ("k1 in loss x sg(w_t)", "in_loss", {"value": "k1"}, 1, "in_loss default ratio"),
    ("k2 in loss x sg(w_t)", "in_loss", {"value": "k2"}, 1, "OpenRLHF unbiased_gradient (gradient)"),
    ("k3 in loss x sg(w_t)", "in_loss", {"value": "k3"}, 1, ""),
    ("k1 in loss x w_t", "in_loss", {"value": "k1", "ratio_grad": "differentiable"}, 1, ""),
    ("k3 in loss x w_t", "in_loss", {"value": "k3", "ratio_grad": "differentiable"}, 1, "TRL use_bias_correction_kl"),
    ("k1 in loss x W", "in_loss", {"value": "k1", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, ""),
    ("k3 in loss x W", "in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, ""),
    ("k3 in loss x sg(W)", "in_loss", {"value": "k3", "ratio": "sequence"}, 1, ""),
    ("rb (exact per-position KL)", "rb", {}, 1, "`rb`"),
    ("k1 in reward-to-go minus kappa_t", "vopd", {}, 1, "`vopd` (vOPD)"),
    ("k1 in per-token reward minus kappa_t", "vopd", {"form": "token"}, 1, "`vopd` form=token"),
    ("exact top-k head + tail sample", "topk_tail", {"k": 2}, 1, "`topk_tail` (NeMo-RL #3608)"),
    ("teacher top-k truncated KL in loss", "topk_trunc", {"k": 2}, 1, "`topk_trunc` (pitfall)"),
]


def verdicts(name: str, opts: dict, n: int) -> tuple[str, str]:
    est = gradient_estimator(name, **opts)
    on = audit(est, n=n).match
    if est.supports_off_policy():
        off = audit(est, n=n, behaviour=0.5).match
    else:
        off = audit(lambda b: est(replace(b, old_logp=None)), n=n, behaviour=0.5).match + " (refuses old_logp)"
    return on, off


# (column title, sampling, target): the sampler's own KL at a temperature and under truncation, the model's KL
# with pi_s as the behaviour policy, and a tempered target under truncation (TRL/verl with a truncating sampler)
TARGET_COLUMNS = [("sampler, T=0.7", Sampling(temperature=0.7), "sampler"),
                  ("sampler, T=0.7 top_p=0.9", Sampling(temperature=0.7, top_p=0.9), "sampler"),
                  ("model, T=0.7", Sampling(temperature=0.7), "model"),
                  ("tempered, T=0.7 top_p=0.9", Sampling(temperature=0.7, top_p=0.9), "tempered")]


def target_verdict(name: str, opts: dict, n: int, sampling: Sampling, target: str) -> str:
    """The audit's verdict for the target's pair; "refuses" where the estimator refuses the target's batch."""
    try:
        return audit(gradient_estimator(name, **opts), n=n, sampling=sampling, target=target).match
    except ValueError as e:
        if "assumes y ~ pi" not in str(e):
            raise
        return "refuses (on-policy only)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", action="store_true", help="the KL-target axis instead of on/off-policy")
    targets = parser.parse_args().targets
    torch.set_num_threads(1)
    if targets:
        print("| cell | klbench | " + " | ".join(c for c, _, _ in TARGET_COLUMNS) + " |")
        print("|---|---|" + "---|" * len(TARGET_COLUMNS))
    else:
        print("| cell | klbench | known as | on-policy (y ~ pi) | off-policy (y ~ pi_old) |")
        print("|---|---|---|---|---|")
    for cell, name, opts, n, known in CELLS:
        args = ", ".join(f"{k}={v}" for k, v in opts.items())
        if targets:
            cols = [target_verdict(name, opts, n, s, t) for _, s, t in TARGET_COLUMNS]
            print(f"| {cell} | `{name}({args})` | " + " | ".join(cols) + " |")
            continue
        on, off = verdicts(name, opts, n)
        print(f"| {cell} | `{name}({args})` | {known} | {on} | {off} |")


if __name__ == "__main__":
    main()
