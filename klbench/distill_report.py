"""The token-level versus sequence-level KL result of on-policy distillation, from finished MLflow runs.

    curves = collect_curves(client, run_ids)        # one val/seq_kl history per run
    bands = aggregate(curves)                        # per estimator: steps [S], values [n_seeds, S]
    rows = summary_rows(bands, steps)                # mean, std, min, max, ratio to token, per step
    write_report(curves, out_dir)                    # distill_seq_kl.png / .md / .csv
    log_report(client, experiment_id, curves, ...)   # the same, as a `distill-report` MLflow run

`DistillReport` is the Hydra callback that does all of this when `klbench -m experiment=distill_estimators`
ends; `klbench-distill-report` recomputes it from any MLflow experiment. No Lightning here, and mlflow
and matplotlib load only when used.
"""
from __future__ import annotations

import argparse
import csv
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

METRIC = "val/seq_kl"  # rb on fresh student samples (LM) or exact (tabular): never the training estimator
ORDER = ("token", "seq", "cumulative", "loo", "rb")  # plot and table order; other estimators follow
BASELINE = "token"
COLORS = {"token": "tab:red", "seq": "tab:orange", "cumulative": "tab:olive", "loo": "tab:blue", "rb": "tab:green"}
REPORT_TAG = "klbench.report"  # on the report run, so a recomputation never reads it as a trial
RUN_ID_FILE = "mlflow_run_id.txt"  # klbench.tracking.RUN_ID_FILE, in every trial's folder
FILES = ("distill_seq_kl.png", "distill_seq_kl.md", "distill_seq_kl.csv")


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


# ---- curves -> bands -> table ----

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


def write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def plot_bands(bands: dict[str, Band], path: Path, title: str = "", log_y: bool | None = None,
               baseline: str = BASELINE) -> Path:
    """Left: mean val/seq_kl per estimator with its min-max band over seeds. Right: mean / baseline's mean.

    log_y=None picks a log axis when the means span more than a factor 10.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = np.concatenate([b.mean() for b in bands.values()])
    if log_y is None:
        log_y = bool(means.min() > 0 and means.max() / means.min() > 10)
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    base = bands.get(baseline)
    for est, b in bands.items():
        color = COLORS.get(est)
        ax.plot(b.steps, b.mean(), marker="o", ms=3, color=color, label=f"{est} (n={len(b.values)})")
        ax.fill_between(b.steps, b.values.min(0), b.values.max(0), color=color, alpha=0.15, lw=0)
        if base is not None:
            steps = np.intersect1d(b.steps, base.steps)
            ratio = b.mean()[np.searchsorted(b.steps, steps)] / base.mean()[np.searchsorted(base.steps, steps)]
            ax_r.plot(steps, ratio, marker="o", ms=3, color=color, label=est)
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
    plt.close(fig)
    return path


def write_report(curves: Sequence[Curve], out_dir: str | Path, title: str = "", steps: Sequence[int] | None = None,
                 log_y: bool | None = None) -> dict[str, Any]:
    """The plot, the markdown table (`steps`, default about six) and the CSV (every step) in out_dir;
    returns their paths, the table's rows and the bands."""
    bands = aggregate(curves)
    if not bands:
        raise ValueError("no usable runs: every run lacks a val/seq_kl history")
    out = Path(out_dir)
    every = sorted({int(s) for b in bands.values() for s in b.steps})
    table_steps = list(steps) if steps else pick_steps(common_steps(bands))
    rows = summary_rows(bands, table_steps)  # the markdown table: a few steps
    png = plot_bands(bands, out / FILES[0], title, log_y)
    md = out / FILES[1]
    md.write_text(format_markdown(rows))
    csv_path = write_csv(summary_rows(bands, every), out / FILES[2])  # the CSV: every validation step
    return {"png": png, "md": md, "csv": csv_path, "rows": rows, "bands": bands}


# ---- MLflow ----

def _param(params: dict, key: str) -> str | None:
    v = params.get(key)
    return None if v in (None, "", "None", "null") else v


def curve_from_run(client, run) -> Curve | str:
    """The run's val/seq_kl history as a Curve, or the reason it cannot be used."""
    params = run.data.params
    if run.info.status != "FINISHED":
        return f"status {run.info.status}"
    if REPORT_TAG in run.data.tags:
        return "a report run"
    est = _param(params, "estimator.name")
    if est is None:
        return "no estimator.name param"
    hist = client.get_metric_history(run.info.run_id, METRIC)
    last = {m.step: m.value for m in sorted(hist, key=lambda m: m.timestamp)}  # a re-logged step: the newest
    if not last:
        return f"no {METRIC} history"
    steps = np.array(sorted(last), dtype=int)  # [S]
    values = np.array([last[s] for s in steps], dtype=float)  # [S]
    if not np.isfinite(values).all():
        return f"non-finite {METRIC}"
    seed, max_steps = _param(params, "seed"), _param(params, "task.max_steps")
    return Curve(run.info.run_id, est, int(seed) if seed is not None else None, steps, values,
                 int(max_steps) if max_steps is not None else None, run.info.start_time or 0)


def collect_curves(client, run_ids: Sequence[str] = (), experiment_id: str | None = None,
                   parent_run_id: str | None = None) -> tuple[list[Curve], dict[str, list[str]]]:
    """Curves of the given runs, plus every finished task=distill run of an experiment or of a parent run.

    From a whole experiment several sweeps may repeat an (estimator, seed): the newest run of each is
    kept, so a recomputation reports one comparison. Returns (curves, skipped: reason -> run ids).
    """
    runs = [client.get_run(r) for r in run_ids]
    if parent_run_id:
        exp = experiment_id or client.get_run(parent_run_id).info.experiment_id
        runs += _search(client, exp, f"tags.mlflow.parentRunId = '{parent_run_id}'")
    elif experiment_id:
        runs += _search(client, experiment_id, "tags.`klbench.task` = 'distill'")
    curves, skipped, seen = [], {}, set()
    for run in runs:
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        c = curve_from_run(client, run)
        if isinstance(c, str):
            skipped.setdefault(c, []).append(run.info.run_id)
        else:
            curves.append(c)
    newest: dict[tuple, Curve] = {}
    for c in sorted(curves, key=lambda c: c.start_time):
        key = (c.estimator, c.seed)
        if key in newest:
            skipped.setdefault("older repeat of an (estimator, seed)", []).append(newest[key].run_id)
        newest[key] = c
    budgets = {c.max_steps for c in newest.values()}
    if len(budgets) > 1:
        log.warning("runs have different step budgets %s: the curves are compared on shared steps only", budgets)
    return list(newest.values()), skipped


def _search(client, experiment_id: str, filter_string: str) -> list:
    out, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, page_token=token)
        out += page
        token = page.token
        if not token:
            return out


def run_ids_in_sweep(sweep_dir: str | Path) -> list[str]:
    """MLflow run ids that the trials of a Hydra sweep folder wrote next to their outputs."""
    return [p.read_text().strip() for p in sorted(Path(sweep_dir).glob(f"*/{RUN_ID_FILE}"))]


def log_report(client, experiment_id: str, curves: Sequence[Curve], out_dir: str | Path, sources: str,
               run_name: str = "distill-report", adopt: bool = True, **kw) -> tuple[str, dict]:
    """Writes the report to out_dir and logs it as a new MLflow run: the three files as artifacts, and
    per estimator the mean curve (report/seq_kl/<est>) and its ratio to token (report/ratio_to_token/<est>)
    as step metrics. With adopt, trial runs without a parent become this run's children in the UI."""
    from mlflow.entities import Metric

    report = write_report(curves, out_dir, **kw)
    run_id = client.create_run(experiment_id, run_name=run_name,
                               tags={REPORT_TAG: "distill", "klbench.report.sources": sources[:5000]}).info.run_id
    for key in ("png", "md", "csv"):
        client.log_artifact(run_id, str(report[key]))
    now = int(time.time() * 1000)
    bands, base = report["bands"], report["bands"].get(BASELINE)
    metrics = []
    for est, b in bands.items():
        metrics += [Metric(f"report/seq_kl/{est}", float(v), now, int(s)) for s, v in zip(b.steps, b.mean())]
        if base is not None:
            for s, v in zip(b.steps, b.mean()):
                if s in base.steps:
                    ratio = v / base.mean()[int(np.searchsorted(base.steps, s))]
                    metrics.append(Metric(f"report/ratio_to_{BASELINE}/{est}", float(ratio), now, int(s)))
    for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run_id, metrics=metrics[i:i + 900])
    if adopt:
        for c in curves:
            if "mlflow.parentRunId" not in client.get_run(c.run_id).data.tags:
                client.set_tag(c.run_id, "mlflow.parentRunId", run_id)
    client.set_terminated(run_id, "FINISHED")
    return run_id, report


# ---- the Hydra callback ----

try:
    from hydra.experimental.callback import Callback
except ImportError:  # the report functions and the CLI do not need Hydra
    Callback = object  # type: ignore[assignment,misc]


class DistillReport(Callback):
    """At the end of a multirun: the report over this sweep folder's trial runs, in <sweep dir>/report
    and as a `distill-report` MLflow run in the trials' experiment (their parent, unless they had one)."""

    def __init__(self, steps: Sequence[int] | None = None, log_y: bool | None = None) -> None:
        self.steps = list(steps) if steps else None
        self.log_y = log_y

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.logger.get("kind") != "mlflow":
            log.warning("distill report: needs logger=mlflow (got %s); no report", config.logger.get("kind"))
            return
        try:
            self._report(config, sweep_dir)
        except Exception:  # Hydra would only warn; say plainly that the runs are fine and how to retry
            log.exception("distill report failed; the trial runs are intact: retry with "
                          "klbench-distill-report --sweep-dir %s", sweep_dir)

    def _report(self, config, sweep_dir: Path) -> None:
        from mlflow import MlflowClient

        from klbench.store import ensure_experiment
        lg = config.logger
        client = MlflowClient(lg.tracking_uri)
        curves, skipped = collect_curves(client, run_ids_in_sweep(sweep_dir))
        for why, ids in skipped.items():
            log.warning("distill report: %d run(s) left out (%s): %s", len(ids), why, ids)
        if not curves:
            log.error("distill report: no finished trial with a %s history in %s", METRIC, sweep_dir)
            return
        exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
        title = f"{config.model.kind} distillation, {len(curves)} runs ({sweep_dir.name})"
        run_id, report = log_report(client, exp_id, curves, sweep_dir / "report", f"sweep_dir={sweep_dir}",
                                    title=title, steps=self.steps, log_y=self.log_y)
        print(f"\nOn-policy distillation, {METRIC} (mean ± std over seeds, ratio to {BASELINE}):\n"
              f"{report['md'].read_text()}\nreport in {sweep_dir / 'report'}, MLflow run {run_id}")


# ---- klbench-distill-report ----

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
    p.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI, else sqlite:////<cwd>/outputs/mlflow.db")
    p.add_argument("--out", help="output folder (default: outputs/distill_report/<timestamp>)")
    p.add_argument("--steps", type=int, nargs="+", help="table columns (default: about 5 validation steps)")
    p.add_argument("--log-y", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--no-log", action="store_true", help="write the files only, log no MLflow run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from klbench.store import tracking_uri
    uri = args.tracking_uri or tracking_uri()
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        print(f"klbench-distill-report: error: no MLflow database at {uri[len('sqlite:///'):]}", file=sys.stderr)
        return 1
    client = MlflowClient(tracking_uri=uri)
    try:
        exp_id = None
        if args.experiment:
            exp = client.get_experiment_by_name(args.experiment)
            if exp is None:
                names = sorted(e.name for e in client.search_experiments())
                raise ValueError(f"unknown experiment {args.experiment!r}; available: {names}")
            exp_id = exp.experiment_id
        run_ids = run_ids_in_sweep(args.sweep_dir) if args.sweep_dir else (args.run_ids or [])
        if args.sweep_dir and not run_ids:
            raise ValueError(f"no */{RUN_ID_FILE} under {args.sweep_dir}: not a multirun folder with MLflow trials")
        curves, skipped = collect_curves(client, run_ids, exp_id, args.parent)
        for why, ids in skipped.items():
            print(f"left out {len(ids)} run(s): {why}")
        if not curves:
            raise ValueError(f"no finished run with an estimator.name param and a {METRIC} history")
        out = Path(args.out or Path("outputs", "distill_report", time.strftime("%Y%m%d-%H%M%S")))
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
    except (ValueError, MlflowException) as e:
        print(f"klbench-distill-report: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
