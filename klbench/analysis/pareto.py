"""`klbench-pareto`: recomputes the reward-vs-sequence-KL Pareto frontier over any set of MLflow runs (one
sweep, several merged sweeps, or hand-picked runs), one frontier per group of comparable runs: writes
pareto.png and pareto.csv, prints frontier share and hypervolume, and optionally logs them to a run.

The maths is klbench.analysis.frontier, the MLflow queries klbench.analysis.mlflow_io, the files klbench.analysis.artifacts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from klbench.console.messages import display_uri, mlflow_ui_lines
from klbench.record import store
from klbench.analysis.artifacts import write_figure_html, write_pareto
from klbench.analysis.frontier import DEFAULT_REF_POINT, describe_groups, format_table, group_runs, summarize
from klbench.analysis.mlflow_io import (TRACKING_URI_HELP, collect_runs, exact_frontier_of, experiment_ids,
                                        log_pareto, new_summary_run, open_client)
from klbench.analysis.plotly_figure import pareto_figure


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
    p.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    p.add_argument("--reward-metric", default="val/reward", metavar="METRIC",
                   help="the metric on the reward axis (default %(default)s; val/accuracy for reward=answer)")
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
    from mlflow.exceptions import MlflowException

    ref_point = (args.ref_reward, args.ref_kl)
    uri = None
    try:
        client, uri = open_client(args.tracking_uri)
        if args.log_to:
            client.get_run(args.log_to)  # fail before any work on a mistyped run id
        found = collect_runs(client, args.experiment, args.run_ids, args.parent, reward_metric=args.reward_metric)
        print(f"tracking URI: {uri}\nruns: {found.describe()}")
        if not found:
            raise ValueError(f"no usable runs (FINISHED at their max_steps, with {args.reward_metric}, val/seq_kl "
                             "and estimator.name)")
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
            exact = exact_frontier_of(pts)  # the tabular model's optimum, drawn as a dashed curve
            png, csv_path = write_pareto(recs, where, "Pareto frontier of " + what, ref_point, exact)
            html = write_figure_html(pareto_figure(recs, exact, "Pareto frontier of " + what, ref_point,
                                                   n_boot=args.bootstrap), where)
            print(format_table(summary))
            print(f"wrote {html} (interactive), {png} and {csv_path}")
        if args.log_to or args.new_run:
            run_id = args.log_to or _new_run(client, args, found)
            log_pareto(client, run_id, found, exact_frontier=exact_frontier_of(found), ref_point=ref_point,
                       n_boot=args.bootstrap)
            if args.new_run:
                client.set_terminated(run_id)
            print(f"logged pareto.html (interactive), pareto.png, pareto.csv and pareto/* metrics to MLflow run "
                  f"{run_id}; to see it:")
            for line in mlflow_ui_lines(uri, client.get_run(run_id).info.experiment_id, run_id):
                print(f"  {line}")
    except (ValueError, MlflowException, store.StoreError) as e:
        msg = str(e) if uri is None or display_uri(uri) in str(e) else f"{e} (searched {_which_store(args, uri)})"
        print(f"klbench-pareto: error: {msg}", file=sys.stderr)
        return 1
    return 0


def _which_store(args: argparse.Namespace, uri: str) -> str:
    """The store searched and where its address came from, so that a run 'not found' points at the
    store to name instead."""
    if args.tracking_uri:
        why = "--tracking-uri"
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        why = "$MLFLOW_TRACKING_URI"
    elif os.environ.get(store.OUTPUTS_ENV):
        why = f"${store.OUTPUTS_ENV}"
    else:
        why = f"./outputs, as neither $MLFLOW_TRACKING_URI nor ${store.OUTPUTS_ENV} is set"
    return f"{display_uri(uri)}, from {why}; another store: --tracking-uri URI"


def _new_run(client, args: argparse.Namespace, found: list[dict]) -> str:
    if args.parent:
        exp_id = client.get_run(args.parent).info.experiment_id
    else:
        exp_id = found[0]["experiment_id"] if not args.experiment else experiment_ids(client, args.experiment[:1])[0]
    sources = " ".join(args.experiment + args.run_ids + ([f"parent={args.parent}"] if args.parent else []))
    return new_summary_run(client, exp_id, args.new_run, sources)


if __name__ == "__main__":
    sys.exit(main())
