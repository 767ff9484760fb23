"""Reward-vs-sequence-KL Pareto analysis, the maths only: non-dominated set, frontier share per estimator
(with a bootstrap CI over runs), 2-D hypervolume, the printed table, and which runs are comparable.

Objectives: maximise `val/reward`, minimise `val/seq_kl` (sequence KL(pi || pi_ref) in nats, measured
with `rb` or exactly, never with the training estimator). Points are plain dicts (or a DataFrame, or a
dict of columns), so this runs on numbers from anywhere: numpy only, no MLflow, plotting or Hydra.
Reading runs from MLflow is klbench.analysis.mlflow_io; the plot is klbench.analysis.plots.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from klbench.record.experiments import BOOKKEEPING

REWARD, SEQ_KL = "val/reward", "val/seq_kl"
# Fixed, not data-dependent, so hypervolumes of different sweeps stay comparable: -1 is the lowest
# VADER compound score (the worst reward of the default task); 20 nats is about three times the KL of
# paper 001's RLHF policies (6.8 nats), whose frontier analysis singles out KL < 5. Points beyond it
# add nothing and are counted in the printed summary.
DEFAULT_REF_POINT = (-1.0, 20.0)


# ---- the frontier itself ----

def non_dominated(rewards: Sequence[float], kls: Sequence[float]) -> np.ndarray:
    """Boolean mask of the points no other point dominates (reward >= and kl <= with one strict).

    Ties: exact duplicates do not dominate each other, so every copy of a frontier point is on the
    frontier and counts towards its estimator's share (seeds that land on the same point are all
    credited, independent of input order). Of two points with the same kl, only the higher reward
    survives; of two with the same reward, only the lower kl. NaN or infinite values are rejected.
    """
    r, k = np.asarray(rewards, dtype=float), np.asarray(kls, dtype=float)
    if r.shape != k.shape or r.ndim != 1:
        raise ValueError(f"rewards and kls must be 1-D and of equal length, got {r.shape} and {k.shape}")
    if not (np.isfinite(r).all() and np.isfinite(k).all()):
        raise ValueError("rewards and kls must be finite; drop diverged runs first (collect_runs does)")
    mask = np.zeros(len(r), dtype=bool)
    order = np.lexsort((-r, k))  # kl ascending, best reward first within a kl
    best_lower_kl = -math.inf  # best reward among points with strictly smaller kl
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and k[order[j]] == k[order[i]]:
            j += 1
        group = order[i:j]
        top = r[group[0]]
        if top > best_lower_kl:
            mask[group[r[group] == top]] = True
        best_lower_kl = max(best_lower_kl, top)
        i = j
    return mask


def frontier_share(labels: Sequence[str], mask: Sequence[bool]) -> dict[str, float]:
    """Fraction of the frontier points that each label owns; every label appears, 0.0 if it owns none."""
    labels, mask = list(labels), np.asarray(mask, dtype=bool)
    if len(labels) != len(mask):
        raise ValueError(f"{len(labels)} labels for {len(mask)} mask entries")
    total = int(mask.sum())
    return {lab: (sum(1 for l, m in zip(labels, mask) if l == lab and m) / total if total else 0.0)
            for lab in sorted(set(labels))}


def frontier_share_ci(labels: Sequence[str], rewards: Sequence[float], kls: Sequence[float], n_boot: int = 1000,
                      level: float = 0.95, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Bootstrap CI of each label's frontier share over runs: every resample redraws, with replacement and
    within each label, as many runs as the label has (seeds and betas alike), then recomputes the frontier.
    A run drawn twice counts twice, as seeds landing on the same point do. Percentile intervals."""
    labels = [str(l) for l in labels]
    r, k = np.asarray(rewards, dtype=float), np.asarray(kls, dtype=float)
    if not labels:
        return {}
    names = sorted(set(labels))
    members = {lab: np.array([i for i, l in enumerate(labels) if l == lab]) for lab in names}
    rng = np.random.default_rng(seed)
    shares = np.zeros((n_boot, len(names)))
    for b in range(n_boot):
        idx = np.concatenate([rng.choice(members[lab], size=len(members[lab])) for lab in names])
        mask = non_dominated(r[idx], k[idx])
        total = mask.sum()
        own = [labels[i] for i in idx[mask]]
        shares[b] = [own.count(lab) / total if total else 0.0 for lab in names]
    a = (1 - level) / 2
    lo, hi = np.quantile(shares, a, axis=0), np.quantile(shares, 1 - a, axis=0)
    return {lab: (float(lo[j]), float(hi[j])) for j, lab in enumerate(names)}


def attainment(rewards: np.ndarray, kls: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The empirical frontier as a step function: at each grid KL, the best reward among the points with a
    KL at most that; -inf where there is none. [G]"""
    order = np.argsort(kls, kind="stable")
    best = np.maximum.accumulate(rewards[order])  # [N] best reward up to each kl, kl ascending
    at = np.searchsorted(kls[order], grid, side="right") - 1  # [G] last point with kl <= grid
    return np.where(at >= 0, best[np.clip(at, 0, None)], -np.inf)


def frontier_band(labels: Sequence[str], rewards: Sequence[float], kls: Sequence[float], grid: Sequence[float],
                  n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap band of the empirical frontier (attainment), pointwise on `grid`: resampled as
    frontier_share_ci does (with replacement, within each label), percentile interval at each grid KL.
    (lo, hi), each [G]; -inf where more than the interval's tail of the resamples has no run at that KL."""
    labels = [str(l) for l in labels]
    r, k, g = (np.asarray(x, dtype=float) for x in (rewards, kls, grid))
    if not len(labels) or n_boot < 1:
        raise ValueError(f"a frontier band needs runs and n_boot >= 1, got {len(labels)} runs, n_boot={n_boot}")
    members = [np.array([i for i, l in enumerate(labels) if l == lab]) for lab in sorted(set(labels))]
    rng = np.random.default_rng(seed)
    curves = np.empty((n_boot, len(g)))  # [n_boot, G]
    for b in range(n_boot):
        idx = np.concatenate([rng.choice(m, size=len(m)) for m in members])
        curves[b] = attainment(r[idx], k[idx], g)
    a = (1 - level) / 2
    # quantiles of values that may be -inf: by sorting (np.quantile would interpolate inf - inf)
    ordered = np.sort(curves, axis=0)
    lo = ordered[int(np.floor(a * (n_boot - 1)))]
    hi = ordered[int(np.ceil((1 - a) * (n_boot - 1)))]
    return lo, hi


def hypervolume(rewards: Sequence[float], kls: Sequence[float],
                ref_point: tuple[float, float] = DEFAULT_REF_POINT) -> float:
    """Area (reward x nats) dominated by the points and bounded by ref_point = (ref_reward, ref_kl).

    Only points strictly better than the reference on both axes count; the rest add nothing. Larger
    is better; compare values only under the same reference point.
    """
    ref_r, ref_k = ref_point
    r, k = np.asarray(rewards, dtype=float), np.asarray(kls, dtype=float)
    keep = (r > ref_r) & (k < ref_k)
    r, k = r[keep], k[keep]
    if len(r) == 0:
        return 0.0
    front = non_dominated(r, k)
    order = np.argsort(k[front], kind="stable")
    fk, fr = k[front][order], r[front][order]  # along the frontier reward rises with kl
    widths = np.diff(np.append(fk, ref_k))
    return float((widths * (fr - ref_r)).sum())


# ---- points: list of dicts, a DataFrame, or a dict of columns ----

def _records(points: Any) -> list[dict]:
    if hasattr(points, "to_dict") and not isinstance(points, Mapping):  # pandas DataFrame
        return points.to_dict("records")
    if isinstance(points, Mapping):  # columns: {"estimator": [...], "reward": [...], "seq_kl": [...]}
        cols = {key: list(v) for key, v in points.items()}
        return [dict(zip(cols, row)) for row in zip(*cols.values())]
    return [dict(p) for p in points]


def summarize(points: Any, ref_point: tuple[float, float] | None = None, n_boot: int = 0,
              seed: int = 0) -> tuple[list[dict], dict]:
    """Adds `on_frontier` to every point and returns (points, summary); with n_boot > 0 the summary also
    holds `share_ci`, each label's 95% bootstrap CI of its frontier share (frontier_share_ci)."""
    recs = _records(points)
    ref_point = tuple(ref_point or DEFAULT_REF_POINT)
    rewards, kls = [p["reward"] for p in recs], [p["seq_kl"] for p in recs]
    labels = [str(p["estimator"]) for p in recs]
    mask = non_dominated(rewards, kls)
    for p, m in zip(recs, mask):
        p["on_frontier"] = bool(m)
    counts = {lab: (labels.count(lab), sum(1 for l, m in zip(labels, mask) if l == lab and m))
              for lab in sorted(set(labels))}
    outside = sum(1 for r, k in zip(rewards, kls) if not (r > ref_point[0] and k < ref_point[1]))
    summary = {"n_points": len(recs), "n_frontier": int(mask.sum()), "share": frontier_share(labels, mask),
               "counts": counts, "hypervolume": hypervolume(rewards, kls, ref_point),
               "ref_point": ref_point, "n_outside_ref": outside}
    if n_boot > 0 and recs:
        summary["share_ci"] = frontier_share_ci(labels, rewards, kls, n_boot=n_boot, seed=seed)
    return recs, summary


def format_table(summary: dict) -> str:
    cis = summary.get("share_ci")
    # one header word group per number column, two spaces apart, each number right-aligned under its header
    w = max([14, *map(len, summary["counts"])])  # the estimator column fits its longest label
    row = "{:<%d}  {:>6}  {:>15}  {:>17}{}" % w
    lines = [row.format("estimator", "points", "frontier points", "share of frontier",
                        "  95% CI (bootstrap over runs)" if cis else "")]
    for lab, (n, nf) in summary["counts"].items():
        ci = f"  [{cis[lab][0]:.1%}, {cis[lab][1]:.1%}]" if cis else ""
        lines.append(row.format(lab, n, nf, f"{summary['share'][lab]:.1%}", ci))
    lines.append(row.format("total", summary["n_points"], summary["n_frontier"],
                            f"{(1.0 if summary['n_frontier'] else 0.0):.1%}", ""))
    ref_r, ref_k = summary["ref_point"]
    lines.append(f"hypervolume {summary['hypervolume']:.4g} (reference point: reward={ref_r:g}, "
                 f"seq KL={ref_k:g} nats; {summary['n_outside_ref']} point(s) outside it add nothing)")
    return "\n".join(lines)


# ---- which runs share one frontier ----

class RunPoints(list):
    """The usable runs (one dict each) plus `skipped`: reason -> run ids, so nothing vanishes silently."""

    def __init__(self):
        super().__init__()
        self.skipped: dict[str, list[str]] = {}

    def skip(self, reason: str, run_id: str) -> None:
        self.skipped.setdefault(reason, []).append(run_id)

    @property
    def n_skipped(self) -> int:
        return sum(len(v) for v in self.skipped.values())

    def describe(self) -> str:
        why = ", ".join(f"{len(ids)} {reason}" for reason, ids in sorted(self.skipped.items()))
        return f"{len(self)} used, {self.n_skipped} skipped" + (f" ({why})" if why else "")


# Bookkeeping (klbench.record.experiments.BOOKKEEPING): where a run wrote, how it was logged, how it resumed.
# Runs since issue 21 log it as tags, older ones as params. Runs that differ in nothing else ran the same thing.
# Differ between the runs of one comparison without changing what they measure: the swept estimator
# and its options, the seed, and bookkeeping.
NOT_COMPARED = ("estimator", "seed", *BOOKKEEPING,
                "task.probe_every", "task.probe")  # the probe measures at validations, on its own RNG stream


# params a run derives from its config (klbench.models.policies.sampling_params) -> the keys they follow: a key that
# may vary lets what it sets vary too (a sweep over task.temperature has runs of different `sampling.used`)
DERIVED = {"sampling.used": ("task.temperature", "task.top_k", "task.top_p", "model.generation_config", "model"),
           "sampling.kl_target": ("task.kl_target",),
           # what a language-model run uses (klbench.tasks.uses.shown_uses): the model's files and options
           "used.stop_ids": ("model",), "used.chat_template": ("model", "dataset"),
           "used.trainable_params": ("model",), "used.lora_rank": ("model",), "used.lora_modules": ("model",),
           "used.generation_config.unapplied": ("model",)}


def with_derived(vary: Sequence[str]) -> list[str]:
    """`vary` and the derived params (DERIVED) that follow a key in it, above it or under it (`task` covers
    task.temperature; model.lora.r is one of `model`'s)."""
    def covers(v: str, key: str) -> bool:
        return key == v or key.startswith(v + ".") or v.startswith(key + ".")
    return [*vary, *(d for d, sources in DERIVED.items() if any(covers(v, s) for v in vary for s in sources))]


def _compared(key: str, vary: Sequence[str]) -> bool:
    return not any(key == p or key.startswith(p + ".") for p in (*NOT_COMPARED, *vary))


def group_runs(points: Sequence[dict], vary: Sequence[str] = ()) -> list[tuple[dict[str, str], list[dict]]]:
    """Splits points into groups of comparable runs: equal in every logged param except NOT_COMPARED and
    the keys in `vary` (and anything under them). Returns [(the values that set the group apart, its
    points)], largest group first; one group with {} when all are comparable."""
    vary = with_derived(vary)
    keys = sorted({k for p in points for k in p.get("params", {}) if _compared(k, vary)})
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault(tuple(p.get("params", {}).get(k) for k in keys), []).append(p)
    differing = [i for i in range(len(keys)) if len({sig[i] for sig in groups}) > 1]
    return sorted((({keys[i]: sig[i] for i in differing}, pts) for sig, pts in groups.items()),
                  key=lambda g: -len(g[1]))


def _ran(key: str) -> bool:
    return not any(key == b or key.startswith(b + ".") for b in BOOKKEEPING)


def one_per_trial(points: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): of the runs of one sweep (same "parent") that ran the same trial, equal in every
    param but BOOKKEEPING, only the newest ("start_time") is kept. A sweep that lost track of a trial may
    have trained it twice; it is one trial, and one point on the frontier. Runs without a parent are all
    kept: running the same config again by hand is a repeat, not a duplicate."""
    newest: dict[tuple, dict] = {}
    kept, dropped = [], []
    for p in points:
        if not p.get("parent"):
            kept.append(p)
            continue
        key = (p["parent"], tuple(sorted((k, v) for k, v in p.get("params", {}).items() if _ran(k))))
        old = newest.get(key)
        if old is None or (p.get("start_time") or 0) > (old.get("start_time") or 0):
            newest[key] = p
            if old is not None:
                dropped.append(old)
        else:
            dropped.append(p)
    kept += list(newest.values())
    order = {id(p): i for i, p in enumerate(points)}
    return sorted(kept, key=lambda p: order[id(p)]), dropped


def describe_groups(groups: list[tuple[dict[str, str], list[dict]]]) -> str:
    keys = sorted({k for labels, _ in groups for k in labels})
    return f"{len(groups)} groups of runs that differ in {', '.join(keys)}: " + "; ".join(
        f"[{i + 1}] {len(pts)} runs with " + ", ".join(f"{k}={v}" for k, v in labels.items())
        for i, (labels, pts) in enumerate(groups))
