"""Tables and figures of docs/placement.md ("Results") from the MLflow store of the placement runs.

    KLBENCH_OUTPUTS=outputs/placement/lm python scripts/placement_results.py lm --experiment placement-lm \
        --out docs/img/placement_lm.png
    KLBENCH_OUTPUTS=outputs/placement/tab python scripts/placement_results.py tabular \
        --experiment sweep-kl_placement-tabular --out docs/img/placement_tabular.png

lm: per (estimator cell, task.inner_steps), over seeds: final val/reward and val/seq_kl (mean and the range),
the step-to-step variability of train/grad_norm (std of the logged values, every task.log_every steps, and
the mean |difference| between consecutive logged values), the mean train/clip_frac, and runs that did not
finish. tabular: per cell and inner_steps, mean exact val/seq_kl, val/reward and val/frontier_gap.
"""
from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

from klbench.analysis.mlflow_io import (TRACKING_URI_HELP, UnknownExperiment, estimator_label, experiment_ids,
                                        open_client, search_runs)
from klbench.record.store import StoreError

DEFAULT_EXPERIMENT = {"lm": "sweep-kl_placement-embedded", "tabular": "sweep-kl_placement-tabular"}


def _runs(client, experiment: str):
    """The experiment's training runs (a sweep's trials or single klbench runs) that name an estimator."""
    try:
        ids = experiment_ids(client, [experiment])
    except UnknownExperiment as e:
        raise SystemExit(str(e)) from None
    return [r for r in search_runs(client, ids)
            if ("mlflow.parentRunId" in r.data.tags or "klbench.task" in r.data.tags)
            and "estimator.name" in r.data.params]


def _history(client, run_id: str, key: str) -> list[float]:
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def _cell(params: dict) -> str:
    return estimator_label(params)


def lm(client, experiment: str, out: str | None) -> None:
    groups: dict[tuple[str, int], list] = defaultdict(list)
    for r in _runs(client, experiment):
        groups[(_cell(r.data.params), int(r.data.params.get("task.inner_steps", 1)))].append(r)
    print("| cell | inner_steps | seeds finished | final val/reward | final val/seq_kl | grad-norm std | "
          "grad-norm mean abs step change | mean clip_frac |")
    print("|---|---|---|---|---|---|---|---|")
    points = []
    for (cell, k), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        done = [r for r in runs if r.info.status == "FINISHED"]
        rew = [r.data.metrics["val/reward"] for r in done]
        kl = [r.data.metrics["val/seq_kl"] for r in done]
        gstd, gdiff, clip = [], [], []
        for r in done:
            g = _history(client, r.info.run_id, "train/grad_norm")
            gstd.append(statistics.pstdev(g))
            gdiff.append(sum(abs(a - b) for a, b in zip(g[1:], g)) / max(len(g) - 1, 1))
            c = _history(client, r.info.run_id, "train/clip_frac")
            if c:
                clip.append(sum(c) / len(c))
            points.append((cell, k, r.data.metrics["val/seq_kl"], r.data.metrics["val/reward"]))
        if not done:
            print(f"| {cell} | {k} | 0 ({len(runs)} not finished) | - | - | - | - | - |")
            continue
        seeds = ",".join(sorted(r.data.params["seed"] for r in done))
        bad = len(runs) - len(done)

        def fmt(v):
            return f"{statistics.mean(v):.3f} [{min(v):.3f}, {max(v):.3f}]" if v else "-"
        print(f"| {cell} | {k} | {len(done)} ({seeds})" + (f", {bad} not finished" if bad else "") +
              f" | {fmt(rew)} | {fmt(kl)} | {statistics.mean(gstd):.3f} | {statistics.mean(gdiff):.3f} | "
              + (f"{statistics.mean(clip):.3f}" if clip else "-") + " |")
    if out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        cells = sorted({p[0] for p in points})
        colors = dict(zip(cells, plt.cm.tab10.colors))
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for cell, k, kl, rew in points:
            ax.scatter(kl, rew, color=colors[cell], marker="o" if k == 1 else "^", s=40,
                       label=f"{cell}, inner_steps={k}")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax.set_xscale("log")
        ax.set_xlabel("final val/seq_kl: KL(pi || pi_ref) per sequence [nats] (rb estimate)")
        ax.set_ylabel("final val/reward (VADER)")
        ax.set_title("Embedded LM, 120 steps, beta 0.05: o inner_steps=1, ^ inner_steps=4")
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        print(f"wrote {out}")


def tabular(client, experiment: str, out: str | None = None) -> None:
    groups: dict[tuple[str, int], list] = defaultdict(list)
    for r in _runs(client, experiment):
        if r.info.status == "FINISHED" and "val/frontier_gap" in r.data.metrics:
            groups[(_cell(r.data.params), int(r.data.params.get("task.inner_steps", 1)))].append(r)
    print("| cell | inner_steps | runs | exact KL(pi‖pi_ref) | exact KL(pi_ref‖pi) | exact reward | gap to frontier |")
    print("|---|---|---|---|---|---|---|")
    for (cell, k), runs in sorted(groups.items()):
        m = {key: statistics.mean(r.data.metrics[key] for r in runs)
             for key in ("val/seq_kl", "val/kl_ref_pi", "val/reward", "val/frontier_gap")}
        assert all(math.isfinite(v) for v in m.values())
        print(f"| {cell} | {k} | {len(runs)} | {m['val/seq_kl']:.3f} | {m['val/kl_ref_pi']:.3f} | "
              f"{m['val/reward']:.3f} | {m['val/frontier_gap']:.4f} |")
    if out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from klbench.config.compose import compose
        from klbench.sweep.exact import exact_frontier
        frontier = exact_frontier(compose(["experiment=tabular"]))  # built as the sweep callback builds it
        cells = sorted({c for c, _ in groups})
        colors = dict(zip(cells, plt.cm.tab10.colors))
        ks = sorted({k for _, k in groups})
        fig, axes = plt.subplots(1, len(ks), figsize=(5.5 * len(ks), 4.2), sharey=True, squeeze=False)
        for ax, k in zip(axes[0], ks):
            ax.plot(frontier.kls, frontier.rewards, "k--", lw=1, label="exact frontier")
            for (cell, kk), runs in sorted(groups.items()):
                if kk == k:
                    ax.scatter([r.data.metrics["val/seq_kl"] for r in runs], [r.data.metrics["val/reward"] for r in runs],
                               color=colors[cell], s=30, label=cell)
            ax.set_xlim(0, 1.1 * max(r.data.metrics["val/seq_kl"] for rs in groups.values() for r in rs))
            ax.set_title(f"tabular, inner_steps={k}")
            ax.set_xlabel("exact KL(pi || pi_ref) [nats]")
        axes[0][0].set_ylabel("exact reward")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out, dpi=110)
        print(f"wrote {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=["lm", "tabular"])
    p.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
    p.add_argument("--experiment", default=None,
                   help="MLflow experiment (default: " + ", ".join(f"{k}: {v}" for k, v in DEFAULT_EXPERIMENT.items())
                   + ")")
    p.add_argument("--out", default=None, help="where to write the figure (none by default)")
    a = p.parse_args()
    try:
        client, _ = open_client(a.tracking_uri)
    except StoreError as e:
        raise SystemExit(str(e)) from None
    experiment = a.experiment or DEFAULT_EXPERIMENT[a.kind]
    lm(client, experiment, a.out) if a.kind == "lm" else tabular(client, experiment, a.out)


if __name__ == "__main__":
    main()
