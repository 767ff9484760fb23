"""The token-level versus sequence-level KL result of on-policy distillation, the maths only.

    bands = aggregate(curves)            # per estimator: steps [S], values [n_seeds, S]
    rows = summary_rows(bands, steps)    # mean, std, min, max, ratio to token, per step
    format_markdown(rows)                # estimators down, steps across

A Curve is one run's val/seq_kl history; where it comes from is klbench.analysis.mlflow_io.curve_from_run,
the plot is klbench.analysis.plots.plot_bands, the files klbench.analysis.artifacts.write_report. Numpy only.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

METRIC = "val/seq_kl"  # rb on fresh student samples (LM) or exact (tabular): never the training estimator
# plot and table order; other estimators follow
ORDER = ("token", "seq", "cumulative", "loo", "rb", "vopd", "topk_tail", "topk_trunc")
BASELINE = "token"


@dataclass
class Curve:
    """One run's validation history."""
    run_id: str
    estimator: str
    seed: int | None
    steps: np.ndarray  # [S] optimiser steps, ascending
    values: np.ndarray  # [S] val/seq_kl in nats
    max_steps: int | None = None
    start_time: int = 0


@dataclass
class Band:
    """One estimator's runs on the steps they all validated at."""
    steps: np.ndarray  # [S]
    values: np.ndarray  # [n_runs, S]
    seeds: list = field(default_factory=list)

    def mean(self) -> np.ndarray:
        return self.values.mean(0)

    def std(self) -> np.ndarray:  # over seeds, ddof=1 (0 with a single seed)
        return self.values.std(0, ddof=1) if len(self.values) > 1 else np.zeros(len(self.steps))


def aggregate(curves: Sequence[Curve]) -> dict[str, Band]:
    """Per estimator, the runs' values on the steps common to all of them (ordered as ORDER)."""
    by_est: dict[str, list[Curve]] = {}
    for c in curves:
        by_est.setdefault(c.estimator, []).append(c)
    bands = {}
    for est in sorted(by_est, key=_order_key):
        runs = sorted(by_est[est], key=lambda c: (c.seed is None, c.seed, c.run_id))
        steps = runs[0].steps
        for c in runs[1:]:
            steps = np.intersect1d(steps, c.steps)
        if len(steps) == 0:
            log.warning("estimator %s: its runs share no validation step; left out", est)
            continue
        values = np.stack([c.values[np.searchsorted(c.steps, steps)] for c in runs])  # [n, S]
        bands[est] = Band(steps, values, [c.seed for c in runs])
    return bands


def _order_key(est: str) -> tuple[int, str]:
    return (ORDER.index(est) if est in ORDER else len(ORDER), est)


def newest_per_seed(curves: Sequence[Curve]) -> tuple[list[Curve], list[str]]:
    """The newest curve of each (estimator, seed), and the run ids of the older repeats: from a whole
    experiment several sweeps may repeat one, and a recomputation reports one comparison."""
    newest: dict[tuple, Curve] = {}
    older = []
    for c in sorted(curves, key=lambda c: c.start_time):
        key = (c.estimator, c.seed)
        if key in newest:
            older.append(newest[key].run_id)
        newest[key] = c
    return list(newest.values()), older


def pick_steps(steps: np.ndarray, n: int = 6) -> list[int]:
    """About n steps spread over the run: the first, the first validation after it (where a gap opens
    while KL is high), and the rest evenly up to the last."""
    steps = np.asarray(steps)
    if len(steps) <= n:
        return [int(s) for s in steps]
    idx = np.unique(np.concatenate([[0, 1], np.round(np.linspace(1, len(steps) - 1, n - 1)).astype(int)]))
    return [int(steps[i]) for i in idx]


def common_steps(bands: dict[str, Band]) -> np.ndarray:
    out = None
    for b in bands.values():
        out = b.steps if out is None else np.intersect1d(out, b.steps)
    return np.array([], dtype=int) if out is None else out


def ratio_to(band: Band, base: Band) -> tuple[np.ndarray, np.ndarray]:
    """(steps both validated at, band's mean / base's mean there)."""
    steps = np.intersect1d(band.steps, base.steps)
    return steps, band.mean()[np.searchsorted(band.steps, steps)] / base.mean()[np.searchsorted(base.steps, steps)]


def summary_rows(bands: dict[str, Band], steps: Sequence[int], baseline: str = BASELINE) -> list[dict]:
    """One row per (estimator, step): n, mean, std, min, max over seeds and mean / baseline's mean."""
    rows = []
    base = bands.get(baseline)
    for est, b in bands.items():
        mean, std = b.mean(), b.std()
        for s in steps:
            if s not in b.steps:
                continue
            i = int(np.searchsorted(b.steps, s))
            ratio = math.nan
            if base is not None and s in base.steps:
                ratio = float(mean[i] / base.mean()[int(np.searchsorted(base.steps, s))])
            rows.append({"estimator": est, "step": int(s), "n": len(b.values), "mean": float(mean[i]),
                         "std": float(std[i]), "min": float(b.values[:, i].min()),
                         "max": float(b.values[:, i].max()), f"ratio_to_{baseline}": ratio})
    return rows


def format_markdown(rows: list[dict], baseline: str = BASELINE) -> str:
    """Estimators down, steps across: `mean ± std (ratio to baseline)`."""
    steps = sorted({r["step"] for r in rows})
    ests = list(dict.fromkeys(r["estimator"] for r in rows))
    cell = {(r["estimator"], r["step"]): r for r in rows}
    lines = ["| estimator | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps)]
    for est in ests:
        n = next(r["n"] for r in rows if r["estimator"] == est)
        cells = []
        for s in steps:
            r = cell.get((est, s))
            if r is None:
                cells.append("-")
                continue
            ratio = r[f"ratio_to_{baseline}"]
            cells.append(f"{r['mean']:.3f} ± {r['std']:.3f}" + ("" if math.isnan(ratio) else f" ({ratio:.2f}x)"))
        lines.append(f"| {est} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
