"""The figures: the reward-vs-KL Pareto scatter of a sweep, and the distillation curves per estimator.

Drawn on matplotlib's `Figure` object, never through pyplot and never with `matplotlib.use`: the
caller's backend (a notebook's, a GUI's) stays as it was, and savefig renders PNGs with Agg anyway.
matplotlib loads only when a plot is drawn.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from klbench.analysis.distill_curves import BASELINE, Band, ratio_to
from klbench.analysis.frontier import summarize

if TYPE_CHECKING:
    from klbench.exact.tabular import Frontier

KL_LABEL = "sequence KL(pi || pi_ref) [nats]   (val/seq_kl)"
COLORS = {"token": "tab:red", "seq": "tab:orange", "cumulative": "tab:olive", "loo": "tab:blue", "rb": "tab:green"}


def plot_pareto(points: Any, path: str | Path, exact_frontier: Frontier | None = None,
                title: str = "Reward vs sequence KL", ref_point: tuple[float, float] | None = None) -> Path:
    """Scatter of all trials by estimator, frontier points ringed and joined by the attainment step line,
    optionally the exact optimal frontier (a klbench.exact.tabular.Frontier) as a dashed curve."""
    from matplotlib.figure import Figure

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
    ax.set_ylabel(f"reward   ({reward_metric(recs)})")
    ax.set_title(f"{title}\nhypervolume {summary['hypervolume']:.4g} "
                 f"(ref: reward={summary['ref_point'][0]:g}, KL={summary['ref_point'][1]:g} nats)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_bands(bands: dict[str, Band], path: Path, title: str = "", log_y: bool | None = None,
               baseline: str = BASELINE) -> Path:
    """Left: mean val/seq_kl per estimator with its min-max band over seeds. Right: mean / baseline's mean.

    log_y=None picks a log axis when the means span more than a factor 10.
    """
    from matplotlib.figure import Figure

    means = np.concatenate([b.mean() for b in bands.values()])
    if log_y is None:
        log_y = bool(means.min() > 0 and means.max() / means.min() > 10)
    fig = Figure(figsize=(10, 3.8))
    ax, ax_r = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    base = bands.get(baseline)
    for est, b in bands.items():
        color = COLORS.get(est)
        ax.plot(b.steps, b.mean(), marker="o", ms=3, color=color, label=f"{est} (n={len(b.values)})")
        ax.fill_between(b.steps, b.values.min(0), b.values.max(0), color=color, alpha=0.15, lw=0)
        if base is not None:
            ax_r.plot(*ratio_to(b, base), marker="o", ms=3, color=color, label=est)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("sequence KL(student || teacher) [nats]")
    ax.set_title(title or "on-policy distillation: val/seq_kl (mean, min-max over seeds)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax_r.axhline(1.0, color="grey", lw=0.8)
    ax_r.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax_r.set_xlabel("optimiser step")
    ax_r.set_ylabel(f"mean KL / {baseline}'s mean KL")
    ax_r.set_title(f"ratio to {baseline} at the same step (dashed: 0.5x)", fontsize=9)
    ax_r.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path


def reward_metric(points) -> str:
    """The metric on the reward axis of these points (klbench.analysis.mlflow_io.collect_runs: val/reward unless
    the frontier was asked for another, e.g. val/accuracy)."""
    return next((p["reward_metric"] for p in points if p.get("reward_metric")), "val/reward")
