"""Exact tables of the OPD estimators (klbench/estimators/opd.py) on the tabular model, for docs/opd-estimators.md:

    python scripts/opd_estimators.py

For the RL instances (klbench.exact.tabular.default_instances) and the distillation instances of
tests/test_opd_estimators.py (a peaked teacher as pi_ref, a flatter student), each estimator's exact expected
gradient against grad kl_pi_ref (largest relative error over the three instances, and what the audit says it
follows) and its exact gradient variance (trace of the covariance, one sample) as a ratio to rb's, per instance.
No sampling: every number is an enumeration."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from klbench.estimators import gradient_estimator  # noqa: E402
from klbench.exact.tabular import audit, default_instances  # noqa: E402
from test_opd_estimators import distill_instances  # noqa: E402

ROWS = [("rb", {}), ("cumulative", {}), ("token", {}), ("vopd", {}), ("vopd", {"form": "token"}),
        ("topk_tail", {"k": 1}), ("topk_tail", {"k": 2}), ("topk_trunc", {"k": 1}), ("topk_trunc", {"k": 2}),
        ("topk_trunc", {"k": 1, "head": "policy"})]


def label(name: str, opts: dict) -> str:
    return f"`{name}`" + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


def table(instances: list) -> list[str]:
    lines = ["| estimator | follows (audit) | rel. error vs grad kl_pi_ref | rel. error vs grad partial_kl_pi_ref "
             "| tr Cov / rb's, per instance |", "|---|---|---|---|---|"]
    rb = [m.gradient_moments(gradient_estimator("rb"), th).trace for m, th in instances]
    for name, opts in ROWS:
        est = gradient_estimator(name, **opts)
        report = audit(est, instances=instances, tol=1e-9)
        err = {r.candidate: r.rel_error for r in report.rows}
        ratios = [m.gradient_moments(est, th).trace / r for (m, th), r in zip(instances, rb)]
        lines.append(f"| {label(name, opts)} | {report.match} | {err['kl_pi_ref']:.3g} "
                     f"| {err['partial_kl_pi_ref']:.3g} "
                     f"| {', '.join(f'{x:.3f}' for x in ratios)} |")
    return lines


def main() -> None:
    for title, instances in (("RL instances (random pi_ref)", default_instances()),
                             ("distillation instances (peaked teacher as pi_ref)", distill_instances())):
        print(f"### {title}\n")
        print("\n".join(table(instances)) + "\n")


if __name__ == "__main__":
    main()
