"""Regenerates the sweep figures and tables of docs/sweeps.md from an MLflow store.

    python scripts/sweep_figures.py tabular --experiment sweep-rl_beta-tabular --out docs/img/pareto_tabular.png
    python scripts/sweep_figures.py embedded --experiment sweep-estimators_grid-embedded --out docs/img/pareto_embedded.png

Unlike `klbench-pareto`, it draws the exact frontier for tabular sweeps and reports each
estimator's distance to it. The store is $MLFLOW_TRACKING_URI, else outputs/mlflow.db under
$KLBENCH_OUTPUTS or the current folder (klbench.record.store.tracking_uri, as for klbench runs).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from statistics import mean, median


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", choices=["tabular", "embedded"], help="the model the sweeps ran on")
    p.add_argument("--experiment", action="append", required=True, help="MLflow experiment; repeat to merge")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args()

    from klbench.analysis.frontier import format_table, summarize
    from klbench.analysis.mlflow_io import collect_runs, open_client
    from klbench.analysis.plots import plot_pareto
    client, _ = open_client()
    runs = collect_runs(client, args.experiment)
    print(f"runs: {runs.describe()}")
    frontier = tabular_frontier() if args.model == "tabular" else None
    recs, summary = summarize(runs)
    title = args.title or f"{args.model}: {', '.join(args.experiment)}"
    plot_pareto(recs, args.out, exact_frontier=frontier, title=title)
    print(format_table(summary))
    if frontier is not None:
        gap_table(recs, frontier)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KB)")


def gap_table(recs: list[dict], frontier) -> None:
    """Reward each estimator's runs leave below the exact frontier at their own KL. Runs past the
    frontier's end (the KL of the single best sequence, beta -> 0) have settled on a worse mode."""
    end = float(frontier.kls.max())
    print(f"\nreward below the exact frontier; 'past end': runs with KL > {end:.2f} nats, where the frontier ends")
    w = max([12, *(len(r["estimator"]) for r in recs)])
    print(f"{'estimator':<{w}} {'runs':>4} {'mean gap':>9} {'median':>7} {'max':>6} {'past end':>9} {'mean gap, rest':>15}")
    for est in sorted({r["estimator"] for r in recs}):
        mine = [r for r in recs if r["estimator"] == est]
        gaps = [frontier.reward_gap(r["reward"], r["seq_kl"]) for r in mine]
        rest = [g for g, r in zip(gaps, mine) if r["seq_kl"] <= end]
        print(f"{est:<{w}} {len(gaps):>4} {mean(gaps):>9.3f} {median(gaps):>7.3f} {max(gaps):>6.3f} "
              f"{len(gaps) - len(rest):>9} {(f'{mean(rest):.3f}' if rest else '-'):>15}")


def tabular_frontier():
    """The exact frontier of the default tabular experiment, built as the sweep callback builds it."""
    from klbench.sweep.exact import exact_frontier
    from klbench.config.compose import compose
    return exact_frontier(compose(["experiment=tabular"]))


if __name__ == "__main__":
    main()
