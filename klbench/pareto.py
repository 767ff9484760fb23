"""Reward-vs-sequence-KL Pareto analysis of finished runs: non-dominated set, frontier share per
estimator, 2-D hypervolume, the plot, and the `klbench-pareto` command that recomputes all of it over
any set of MLflow runs (one sweep, several merged sweeps, or hand-picked runs).

Objectives: maximise `val/reward`, minimise `val/seq_kl` (sequence KL(pi || pi_ref) in nats, measured
with `rb` or exactly, never with the training estimator). No Hydra or Lightning here: the sweep
callback and the CLI both call these functions, and `mlflow` / `matplotlib` load only when used.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from klbench import runs, store

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from klbench.tabular import Frontier

REWARD, SEQ_KL = "val/reward", "val/seq_kl"
# the lead logs the flattened Hydra config with '.' separators; '/' is accepted for hand-logged runs
PARAM_KEYS = {"estimator": ("estimator.name", "estimator/name"), "beta": ("estimator.beta", "estimator/beta"),
              "lam": ("estimator.lam", "estimator/lam"), "seed": ("seed",)}
# Fixed, not data-dependent, so hypervolumes of different sweeps stay comparable: -1 is the lowest
# VADER compound score (the worst reward of the default task); 20 nats is about three times the KL of
# paper 001's RLHF policies (6.8 nats), whose frontier analysis singles out KL < 5. Points beyond it
# add nothing and are counted in the printed summary.
DEFAULT_REF_POINT = (-1.0, 20.0)
CSV_COLUMNS = ("run_id", "run_name", "estimator", "beta", "lam", "seed", "reward", "seq_kl", "on_frontier",
               "experiment")
SOURCES_TAG = "klbench.pareto.sources"  # marks runs made by --new-run, so later recomputations skip them
KL_LABEL = "sequence KL(pi || pi_ref) [nats]   (val/seq_kl)"


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
    lines = [f"{'estimator':<14} {'points':>6} {'on frontier':>11} {'share':>7}" + ("  95% CI (bootstrap over runs)"
                                                                                    if cis else "")]
    for lab, (n, nf) in summary["counts"].items():
        ci = f"  [{cis[lab][0]:.1%}, {cis[lab][1]:.1%}]" if cis else ""
        lines.append(f"{lab:<14} {n:>6} {nf:>11} {summary['share'][lab]:>7.1%}{ci}")
    lines.append(f"{'total':<14} {summary['n_points']:>6} {summary['n_frontier']:>11} "
                 f"{(1.0 if summary['n_frontier'] else 0.0):>7.1%}")
    ref_r, ref_k = summary["ref_point"]
    lines.append(f"hypervolume {summary['hypervolume']:.4g} (reference point: reward={ref_r:g}, "
                 f"seq KL={ref_k:g} nats; {summary['n_outside_ref']} point(s) outside it add nothing)")
    return "\n".join(lines)


# ---- plot and CSV ----

def plot_pareto(points: Any, path: str | Path, exact_frontier: Frontier | None = None,
                title: str = "Reward vs sequence KL", ref_point: tuple[float, float] | None = None) -> Path:
    """Scatter of all trials by estimator, frontier points ringed and joined by the attainment step line,
    optionally the exact optimal frontier (a klbench.tabular.Frontier) as a dashed curve."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone, renders with Agg

    recs, summary = summarize(points, ref_point)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    palette = [f"C{i}" for i in range(10)]
    for i, lab in enumerate(summary["counts"]):
        pts = [p for p in recs if str(p["estimator"]) == lab]
        n, nf = summary["counts"][lab]
        ax.scatter([p["seq_kl"] for p in pts], [p["reward"] for p in pts], s=28, alpha=0.8,
                   color=palette[i % len(palette)],
                   label=f"{lab}: {n} runs, {nf} on frontier ({summary['share'][lab]:.0%})")
    front = sorted((p["seq_kl"], p["reward"]) for p in recs if p["on_frontier"])
    if front:
        fk, fr = zip(*front)
        ax.scatter(fk, fr, s=110, facecolors="none", edgecolors="black", linewidths=1.2,
                   label="non-dominated (empirical frontier)")
        ax.step(fk, fr, where="post", color="black", linewidth=0.8, alpha=0.6)
    if exact_frontier is not None:
        order = np.argsort(np.asarray(exact_frontier.kls, dtype=float))
        ax.plot(np.asarray(exact_frontier.kls, dtype=float)[order],
                np.asarray(exact_frontier.rewards, dtype=float)[order],
                "k--", linewidth=1.2, label="exact optimum pi*_beta (tabular)")
    ax.set_xlabel(KL_LABEL)
    ax.set_ylabel("reward   (val/reward)")
    ax.set_title(f"{title}\nhypervolume {summary['hypervolume']:.4g} "
                 f"(ref: reward={summary['ref_point'][0]:g}, KL={summary['ref_point'][1]:g} nats)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def write_csv(recs: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for p in sorted(recs, key=lambda p: (str(p["estimator"]), p["seq_kl"])):
            w.writerow({c: ("" if p.get(c) is None else p.get(c)) for c in CSV_COLUMNS})
    return path


# ---- MLflow ----

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


class UnknownExperiment(ValueError):
    """An experiment name not in the tracking store; the message lists the ones that are."""


def estimator_label(params: dict) -> str:
    """The estimator name, with the value of a placement estimator: `in_reward:k3`, so that every cell of the
    kl_placement grid has its own frontier share and gap (MLflow metric names allow no parentheses)."""
    name = str(_param(params, "estimator"))
    value = next((params[k] for k in ("estimator.value", "estimator/value") if k in params), None)
    return f"{name}:{value}" if value not in (None, "", "None", "null") else name


def _param(params: dict, key: str):
    raw = next((params[k] for k in PARAM_KEYS[key] if k in params), None)
    if raw is None or raw in ("", "None", "null"):
        return None
    try:
        return int(raw) if key == "seed" else float(raw)
    except ValueError:
        return raw  # keep what was logged rather than guess


def _all_pages(fetch) -> list:
    """Every item of a paged MLflow search, `fetch(page_token)` returning one page."""
    items, token = [], None
    while True:
        page = fetch(token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def _search(client: MlflowClient, experiment_ids: list[str], filter_string: str = "") -> list:
    return _all_pages(lambda token: client.search_runs(experiment_ids, filter_string, max_results=1000,
                                                       page_token=token))


def _experiment_ids(client: MlflowClient, names: Sequence[str]) -> list[str]:
    ids, missing = [], []
    for name in names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            missing.append(name)
        else:
            ids.append(exp.experiment_id)
    if missing:
        known = sorted(e.name for e in _all_pages(lambda token: client.search_experiments(page_token=token)))
        raise UnknownExperiment(f"unknown experiment(s) {missing}; available: {known or 'none'}")
    return ids


def collect_runs(client: MlflowClient, experiment_names: Sequence[str] | None = None,
                 run_ids: Sequence[str] | None = None, parent_run_id: str | None = None,
                 noticed_by: str = "klbench-pareto") -> RunPoints:
    """Runs that FINISHED all their steps, with final `val/reward` and `val/seq_kl` and an `estimator.name`
    param, one dict each (its logged params under "params", for group_runs).

    `experiment_names` takes every run of those experiments; `parent_run_id` keeps only that sweep's
    children (searched in the parent's experiment unless experiment_names is given); `run_ids` adds
    runs by id. Other statuses, runs stopped before their max_steps, missing or non-finite metrics, a
    missing estimator name and sweep parent runs are skipped and recorded in `.skipped` (reason -> run
    ids). RUNNING runs whose process on this host is gone are first marked KILLED (klbench.runs.reap).
    """
    if not (experiment_names or run_ids or parent_run_id):
        raise ValueError("give experiment_names, run_ids or parent_run_id")
    found = []
    exp_ids = _experiment_ids(client, experiment_names) if experiment_names else []
    if parent_run_id:
        exp_ids = exp_ids or [client.get_run(parent_run_id).info.experiment_id]
    picked = [client.get_run(rid) for rid in run_ids or []]
    runs.reap(client, sorted(set(exp_ids) | {r.info.experiment_id for r in picked}), noticed_by)
    if parent_run_id:
        found += _search(client, exp_ids, f"tags.mlflow.parentRunId = '{parent_run_id}'")
    elif exp_ids:
        found += _search(client, exp_ids)
    found += [client.get_run(rid) for rid in run_ids or []]
    parents = {r.data.tags.get("mlflow.parentRunId") for r in found}
    exp_names: dict[str, str] = {}
    out, seen = RunPoints(), set()
    for run in found:
        rid = run.info.run_id
        if rid in seen:
            continue
        seen.add(rid)
        metrics, params = run.data.metrics, run.data.params
        if rid in parents:
            out.skip("sweep parent run", rid)
        elif SOURCES_TAG in run.data.tags:
            out.skip("pareto summary run", rid)
        elif run.info.status != "FINISHED":
            out.skip(f"status {run.info.status}", rid)
        elif not (done := runs.completed(run.data.tags))[0]:
            out.skip(done[1] if done[1].startswith("no ") else "stopped before max_steps", rid)
        elif missing := [m for m in (REWARD, SEQ_KL) if m not in metrics]:
            out.skip(f"missing metric {missing[0]}", rid)
        elif bad := [m for m in (REWARD, SEQ_KL) if not math.isfinite(metrics[m])]:
            out.skip(f"non-finite {bad[0]}", rid)
        elif _param(params, "estimator") is None:
            out.skip("missing param estimator.name", rid)
        else:
            eid = run.info.experiment_id
            if eid not in exp_names:
                exp_names[eid] = client.get_experiment(eid).name
            out.append({"run_id": rid, "run_name": run.info.run_name, "experiment": exp_names[eid],
                        "experiment_id": eid, "estimator": estimator_label(params),
                        "beta": _param(params, "beta"), "lam": _param(params, "lam"),
                        "seed": _param(params, "seed"), "reward": metrics[REWARD],
                        "seq_kl": metrics[SEQ_KL], "status": run.info.status, "params": dict(params)})
    return out


# Differ between the runs of one comparison without changing what they measure: the swept estimator
# and its options, the seed, and bookkeeping (where the run wrote, how it was logged, how it resumed).
NOT_COMPARED = ("estimator", "seed", "logger", "paths", "ckpt_path", "ckpt_allow_changes", "optimized_metrics",
                "task.probe_every", "task.probe")  # the probe measures at validations, on its own RNG stream


def _compared(key: str, vary: Sequence[str]) -> bool:
    return not any(key == p or key.startswith(p + ".") for p in (*NOT_COMPARED, *vary))


def group_runs(points: Sequence[dict], vary: Sequence[str] = ()) -> list[tuple[dict[str, str], list[dict]]]:
    """Splits points into groups of comparable runs: equal in every logged param except NOT_COMPARED and
    the keys in `vary` (and anything under them). Returns [(the values that set the group apart, its
    points)], largest group first; one group with {} when all are comparable."""
    keys = sorted({k for p in points for k in p.get("params", {}) if _compared(k, vary)})
    groups: dict[tuple, list[dict]] = {}
    for p in points:
        groups.setdefault(tuple(p.get("params", {}).get(k) for k in keys), []).append(p)
    differing = [i for i in range(len(keys)) if len({sig[i] for sig in groups}) > 1]
    return sorted((({keys[i]: sig[i] for i in differing}, pts) for sig, pts in groups.items()),
                  key=lambda g: -len(g[1]))


def describe_groups(groups: list[tuple[dict[str, str], list[dict]]]) -> str:
    keys = sorted({k for labels, _ in groups for k in labels})
    return f"{len(groups)} groups of runs that differ in {', '.join(keys)}: " + "; ".join(
        f"[{i + 1}] {len(pts)} runs with " + ", ".join(f"{k}={v}" for k, v in labels.items())
        for i, (labels, pts) in enumerate(groups))


def log_pareto(client: MlflowClient, run_id: str, points: Any, exact_frontier: Frontier | None = None,
               ref_point: tuple[float, float] | None = None, n_boot: int = 1000,
               out_dir: str | Path | None = None) -> dict:
    """Logs pareto.png, pareto.csv and the pareto/* metrics to `run_id` (a sweep's parent run); returns
    the summary (n_points, n_frontier, share, counts, hypervolume, ref_point, n_outside_ref).
    With `out_dir` (a sweep's folder), the two files are also kept there."""
    from mlflow.entities import Metric

    recs, summary = summarize(points, ref_point, n_boot=n_boot)
    if not recs:
        raise ValueError(f"no usable runs to put on a Pareto plot for run {run_id}")
    title = f"Pareto frontier of run {client.get_run(run_id).info.run_name}"
    with (contextlib.nullcontext(str(out_dir)) if out_dir is not None else tempfile.TemporaryDirectory()) as tmp:
        client.log_artifact(run_id, str(plot_pareto(recs, Path(tmp, "pareto.png"), exact_frontier, title,
                                                    summary["ref_point"])))
        client.log_artifact(run_id, str(write_csv(recs, Path(tmp, "pareto.csv"))))
    now = int(time.time() * 1000)
    values = {f"pareto/share/{lab}": share for lab, share in summary["share"].items()}
    for lab, (lo, hi) in summary.get("share_ci", {}).items():
        values.update({f"pareto/share_lo/{lab}": lo, f"pareto/share_hi/{lab}": hi})
    values.update({"pareto/hypervolume": summary["hypervolume"], "pareto/n_points": summary["n_points"],
                   "pareto/n_frontier": summary["n_frontier"]})
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()])
    # a tag, not a param: params are immutable and the frontier may be recomputed with another reference
    client.set_tag(run_id, "pareto.ref_point", "reward={:g},seq_kl={:g}".format(*summary["ref_point"]))
    return summary


# ---- klbench-pareto ----

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="klbench-pareto",
        description="Recompute the reward-vs-sequence-KL Pareto frontier over MLflow runs that finished all "
                    "their steps, one frontier per group of comparable runs; write pareto.png and pareto.csv, "
                    "print frontier share and hypervolume.")
    p.add_argument("--experiment", action="append", default=[], metavar="NAME",
                   help="MLflow experiment name; repeat to merge several sweeps")
    p.add_argument("--run-ids", nargs="+", default=[], metavar="RUN_ID", help="add these runs")
    p.add_argument("--parent", metavar="RUN_ID", help="only the child runs of this sweep parent run")
    p.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else the mlflow.db in $KLBENCH_OUTPUTS "
                                          "(default ./outputs), as for klbench runs")
    p.add_argument("--vary", action="append", default=[], metavar="KEY",
                   help="a config key (e.g. task.lr) whose values may differ within one frontier; by default "
                        "only the estimator, its options and the seed do")
    p.add_argument("--out", help="output folder (default: <outputs>/pareto/<timestamp>)")
    p.add_argument("--ref-reward", type=float, default=DEFAULT_REF_POINT[0],
                   help="hypervolume reference reward (default %(default)g, the lowest VADER score)")
    p.add_argument("--ref-kl", type=float, default=DEFAULT_REF_POINT[1],
                   help="hypervolume reference sequence KL in nats (default %(default)g)")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="bootstrap resamples of the runs for the frontier share's 95%% CI (0: none; default %(default)s)")
    dest = p.add_mutually_exclusive_group()
    dest.add_argument("--log-to", metavar="RUN_ID", help="also log the artifacts and pareto/* metrics to this run")
    dest.add_argument("--new-run", metavar="NAME", help="also log them to a new run with this name")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not (args.experiment or args.run_ids or args.parent):
        p.error("give at least one of --experiment, --run-ids, --parent")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = args.tracking_uri or store.tracking_uri()
    ref_point = (args.ref_reward, args.ref_kl)
    try:
        store.open_store(uri, create=False)  # never an empty new database that knows no experiment
        client = MlflowClient(tracking_uri=uri)
        if args.log_to:
            client.get_run(args.log_to)  # fail before any work on a mistyped run id
        found = collect_runs(client, args.experiment, args.run_ids, args.parent)
        print(f"tracking URI: {uri}\nruns: {found.describe()}")
        if not found:
            raise ValueError("no usable runs (FINISHED at their max_steps, with val/reward, val/seq_kl and "
                             "estimator.name)")
        groups = group_runs(found, args.vary)
        if len(groups) > 1:
            if args.log_to or args.new_run:
                raise ValueError(f"not logging one frontier for runs that are not comparable: "
                                 f"{describe_groups(groups)}. Pick runs of one group, or pass --vary KEY")
            print(f"not merged: {describe_groups(groups)}")
        out = Path(args.out or store.outputs_dir() / "pareto" / time.strftime("%Y%m%d-%H%M%S"))
        for i, (labels, pts) in enumerate(groups):
            where = out if len(groups) == 1 else out / f"group-{i + 1}"
            recs, summary = summarize(pts, ref_point, n_boot=args.bootstrap)
            what = ", ".join(sorted({r["experiment"] for r in recs}))
            if labels:
                what += " (" + ", ".join(f"{k}={v}" for k, v in labels.items()) + ")"
                print(f"\ngroup {i + 1}: {what}")
            png = plot_pareto(recs, where / "pareto.png", ref_point=ref_point, title="Pareto frontier of " + what)
            print(format_table(summary))
            print(f"wrote {png} and {write_csv(recs, where / 'pareto.csv')}")
        if args.log_to or args.new_run:
            run_id = args.log_to or _new_run(client, args, found)
            log_pareto(client, run_id, found, ref_point=ref_point, n_boot=args.bootstrap)
            if args.new_run:
                client.set_terminated(run_id)
            print(f"logged pareto.png, pareto.csv and pareto/* metrics to MLflow run {run_id}")
    except (ValueError, MlflowException, store.StoreError) as e:
        print(f"klbench-pareto: error: {e}", file=sys.stderr)
        return 1
    return 0


def _new_run(client: MlflowClient, args: argparse.Namespace, found: RunPoints) -> str:
    if args.parent:
        exp_id = client.get_run(args.parent).info.experiment_id
    else:
        exp_id = found[0]["experiment_id"] if not args.experiment else _experiment_ids(client, args.experiment[:1])[0]
    sources = " ".join(args.experiment + args.run_ids + ([f"parent={args.parent}"] if args.parent else []))
    return client.create_run(exp_id, run_name=args.new_run, tags={SOURCES_TAG: sources}).info.run_id


if __name__ == "__main__":
    sys.exit(main())
