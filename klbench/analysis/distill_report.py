"""`klbench-distill-report`: recomputes the on-policy distillation report (val/seq_kl against step per
gradient estimator, mean over seeds, ratio to token) from any MLflow experiment, sweep folder or runs.

    distill_seq_kl.png / .md / .csv in --out, and a `distill-report` MLflow run unless --no-log

A sweep of `klbench -m experiment=distill_estimators` makes the same report when it ends
(klbench.sweep.distill.DistillReport). The maths is klbench.analysis.distill_curves, the MLflow queries
klbench.analysis.mlflow_io, the files klbench.analysis.artifacts.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from klbench.record import runs, store
from klbench.analysis.artifacts import write_report
from klbench.analysis.distill_curves import METRIC
from klbench.analysis.mlflow_io import (TRACKING_URI_HELP, collect_curves, experiment_ids, log_report, open_client,
                               run_ids_in_sweep)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="klbench-distill-report",
        description="Recompute the on-policy distillation report (val/seq_kl against step per gradient "
                    "estimator, mean over seeds, ratio to token) from MLflow runs.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--experiment", metavar="NAME", help="every finished task=distill run of this experiment "
                     "(the newest per estimator and seed)")
    src.add_argument("--sweep-dir", help="the trials of this Hydra multirun folder")
    src.add_argument("--parent", metavar="RUN_ID", help="the child runs of this run (e.g. an earlier report)")
    src.add_argument("--run-ids", nargs="+", metavar="RUN_ID")
    p.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    p.add_argument("--out", help="output folder (default: <outputs>/distill_report/<timestamp>)")
    p.add_argument("--steps", type=int, nargs="+", help="table columns (default: about 5 validation steps)")
    p.add_argument("--log-y", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--no-log", action="store_true", help="write the files only, log no MLflow run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from mlflow.exceptions import MlflowException

    try:
        client, _ = open_client(args.tracking_uri)
        exp_id = experiment_ids(client, [args.experiment])[0] if args.experiment else None
        run_ids = run_ids_in_sweep(args.sweep_dir) if args.sweep_dir else (args.run_ids or [])
        if args.sweep_dir and not run_ids:
            raise ValueError(f"no */{runs.RUN_ID_FILE} under {args.sweep_dir}: not a multirun folder with "
                             "MLflow trials")
        curves, skipped = collect_curves(client, run_ids, exp_id, args.parent)
        for why, ids in skipped.items():
            print(f"left out {len(ids)} run(s): {why}")
        if not curves:
            raise ValueError(f"no finished run with an estimator.name param and a {METRIC} history")
        out = Path(args.out or store.outputs_dir() / "distill_report" / time.strftime("%Y%m%d-%H%M%S"))
        log_y = {"auto": None, "yes": True, "no": False}[args.log_y]
        source = args.experiment or args.sweep_dir or args.parent or " ".join(args.run_ids)
        kw = {"title": f"on-policy distillation, {len(curves)} runs ({source})"[:90], "steps": args.steps,
              "log_y": log_y}
        if args.no_log:
            report = write_report(curves, out, **kw)
        else:
            exp_id = exp_id or client.get_run(curves[0].run_id).info.experiment_id
            run_id, report = log_report(client, exp_id, curves, out, source, adopt=False, **kw)
            print(f"logged to MLflow run {run_id}")
        print(report["md"].read_text())
        print(f"wrote {report['png']}, {report['md']}, {report['csv']}")
    except (ValueError, MlflowException, store.StoreError) as e:
        print(f"klbench-distill-report: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
