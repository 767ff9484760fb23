"""Every MLflow read and write of the analyses: the runs a Pareto frontier or a distillation report is
computed from, and the summary they log back.

    client, uri = open_client(args.tracking_uri)            # the store klbench runs write to
    points = collect_runs(client, parent_run_id=parent)     # finished runs -> klbench.analysis.frontier points
    log_pareto(client, parent, points)                      # pareto.html / .png / .csv and pareto/* metrics
    curves, skipped = collect_curves(client, run_ids)       # val/seq_kl histories -> klbench.analysis.distill_curves
    log_report(client, experiment_id, curves, out_dir, ...) # the report as a `distill-report` run

The maths is klbench.analysis.frontier and klbench.analysis.distill_curves, the files klbench.analysis.artifacts; the command
lines are klbench.analysis.pareto and klbench.analysis.distill_report, the sweep's end klbench.sweep. No Hydra or
Lightning here, and mlflow loads only when a function needs it.
"""
from __future__ import annotations

import re

import contextlib
import logging
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from klbench.record import runs, store
from klbench.record.experiments import FIGURE, NOTE_TAG
from klbench.analysis.artifacts import write_figure_html, write_pareto, write_report
from klbench.analysis.distill_curves import BASELINE, METRIC, Curve, newest_per_seed, ratio_to
from klbench.analysis.frontier import REWARD, SEQ_KL, RunPoints, one_per_trial, summarize

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from klbench.exact.tabular import Frontier

log = logging.getLogger(__name__)

FRONTIER_NOTE = (
    f"**Reward against KL per estimator, with the frontier**: the Artifacts tab, `{FIGURE}` (interactive: "
    "every run's `val/seq_kl` against `val/reward`, a colour per estimator, the empirical frontier with its "
    "95% bootstrap band and, on the tabular model, the exact frontier; hover a point for its run). The same "
    "as an image: `pareto.png`; one row per run: `pareto.csv`. Each estimator's share of the frontier and "
    "the hypervolume: the `pareto/*` metrics.")

SOURCES_TAG = "klbench.analysis.pareto.sources"  # marks runs made by klbench-pareto --new-run: never a trial
REPORT_TAG = "klbench.report"  # marks a distillation report run: never a trial
TRACKING_URI_HELP = ("default: $MLFLOW_TRACKING_URI, else the mlflow.db in $KLBENCH_OUTPUTS (default ./outputs), "
                     "as for klbench runs")


class UnknownExperiment(ValueError):
    """An experiment name not in the tracking store; the message lists the ones that are."""


def open_client(tracking_uri: str | None = None) -> tuple[MlflowClient, str]:
    """A client on an existing store, and its URI: `tracking_uri`, else the store klbench runs write to
    (klbench.record.store.tracking_uri). Never creates an empty database that knows no experiment: raises
    klbench.record.store.StoreError naming the path instead."""
    from mlflow import MlflowClient

    uri = tracking_uri or store.tracking_uri()
    store.open_store(uri, create=False)
    return MlflowClient(tracking_uri=uri), uri


# ---- queries ----

def _all_pages(fetch) -> list:
    """Every item of a paged MLflow search, `fetch(page_token)` returning one page."""
    items, token = [], None
    while True:
        page = fetch(token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def search_runs(client: MlflowClient, experiment_ids: Sequence[str], filter_string: str = "") -> list:
    """Every run that matches, however many pages it takes."""
    return _all_pages(lambda token: client.search_runs(list(experiment_ids), filter_string, max_results=1000,
                                                       page_token=token))


def experiment_ids(client: MlflowClient, names: Sequence[str]) -> list[str]:
    """The ids of these experiments; UnknownExperiment, listing the store's experiments, if one is not there."""
    ids, missing = [], []
    for name in names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            missing.append(name)
        else:
            ids.append(exp.experiment_id)
    if missing:
        known = sorted(e.name for e in _all_pages(lambda token: client.search_experiments(page_token=token)))
        what = f"experiment {missing[0]!r}" if len(missing) == 1 else f"experiments {missing}"
        raise UnknownExperiment(f"unknown {what}; available: {known or 'none'}")
    return ids


def param(params: dict[str, str], key: str) -> str | None:
    """A logged param as logged, None when absent or empty. klbench logs the flattened config with '.'
    separators (estimator.name); '/' is accepted too, for runs logged by hand."""
    raw = next((params[k] for k in (key, key.replace(".", "/")) if k in params), None)
    return None if raw in (None, "", "None", "null") else raw


def _number(params: dict[str, str], key: str):
    raw = param(params, key)
    if raw is None:
        return None
    try:
        return int(raw) if key == "seed" else float(raw)
    except ValueError:
        return raw  # keep what was logged rather than guess


def run_ids_in_sweep(sweep_dir: str | Path) -> list[str]:
    """MLflow run ids that the trials of a Hydra sweep folder wrote next to their outputs."""
    return [p.read_text().strip() for p in sorted(Path(sweep_dir).glob(f"*/{runs.RUN_ID_FILE}"))]


# ---- the Pareto frontier ----

def estimator_label(params: dict) -> str:
    """The estimator name, with the value of a placement estimator (`in_reward:k3`, and in_reward's form,
    baseline and kl_norm where not the default: `in_reward:k1:reward_to_go`, `in_reward:k1:fused`) or the
    setting of a library one (`library:trl.grpo`), so that every cell of a grid has its own frontier share and
    gap (MLflow metric names allow no parentheses)."""
    name = str(param(params, "estimator.name"))
    detail = param(params, "estimator.value") or param(params, "estimator.setting")
    # in_reward's placement choices away from their defaults (estimator=frpo, kl_fused): cells of their own
    for key, default in (("form", "sequence"), ("baseline", "none"), ("kl_norm", "after")):
        value = param(params, f"estimator.{key}") if name == "in_reward" else None
        if value is not None and value != default:
            detail = f"{detail}:{value}"
    return f"{name}:{detail}" if detail is not None else name


def metric_name(label: str) -> str:
    """An estimator label as MLflow accepts it in a metric name (alphanumerics and _ - . space / : only):
    a library setting's "+" (verl.kl_penalty.k3+) becomes "plus", anything else unaccepted "_"."""
    return re.sub(r"[^\w\-. /:]", lambda m: "plus" if m.group() == "+" else "_", label)


def child_runs(client: MlflowClient, parent_run_id: str, noticed_by: str) -> list:
    """Every run of a sweep's parent run (its trials' runs), RUNNING ones whose process is gone first
    marked KILLED (klbench.record.runs.reap)."""
    exp_id = client.get_run(parent_run_id).info.experiment_id
    runs.reap(client, [exp_id], noticed_by)
    return search_runs(client, [exp_id], f"tags.mlflow.parentRunId = '{parent_run_id}'")


def collect_runs(client: MlflowClient, experiment_names: Sequence[str] | None = None,
                 run_ids: Sequence[str] | None = None, parent_run_id: str | None = None,
                 noticed_by: str = "klbench-pareto", reward_metric: str = REWARD) -> RunPoints:
    """Runs that FINISHED all their steps, with final `val/reward` and `val/seq_kl` and an `estimator.name`
    param, one dict each (its logged params under "params", for klbench.analysis.frontier.group_runs).
    reward_metric: the metric on the frontier's reward axis (e.g. val/accuracy of reward=answer), read into
    each point's "reward" and named by its "reward_metric".

    `experiment_names` takes every run of those experiments; `parent_run_id` keeps only that sweep's
    children (searched in the parent's experiment unless experiment_names is given); `run_ids` adds
    runs by id. Other statuses, runs stopped before their max_steps, missing or non-finite metrics, a
    missing estimator name and sweep parent runs are skipped and recorded in `.skipped` (reason -> run
    ids), and so are older runs of a trial that a sweep ran twice (klbench.analysis.frontier.one_per_trial).
    RUNNING runs whose process on this host is gone are first marked KILLED (klbench.record.runs.reap).
    """
    if not (experiment_names or run_ids or parent_run_id):
        raise ValueError("give experiment_names, run_ids or parent_run_id")
    found = []
    exp_ids = experiment_ids(client, experiment_names) if experiment_names else []
    if parent_run_id:
        exp_ids = exp_ids or [client.get_run(parent_run_id).info.experiment_id]
    picked = [client.get_run(rid) for rid in run_ids or []]
    runs.reap(client, sorted(set(exp_ids) | {r.info.experiment_id for r in picked}), noticed_by)
    if parent_run_id:
        found += search_runs(client, exp_ids, f"tags.mlflow.parentRunId = '{parent_run_id}'")
    elif exp_ids:
        found += search_runs(client, exp_ids)
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
        elif missing := [m for m in (reward_metric, SEQ_KL) if m not in metrics]:
            out.skip(f"missing metric {missing[0]}", rid)
        elif bad := [m for m in (reward_metric, SEQ_KL) if not math.isfinite(metrics[m])]:
            out.skip(f"non-finite {bad[0]}", rid)
        elif param(params, "estimator.name") is None:
            out.skip("missing param estimator.name", rid)
        else:
            eid = run.info.experiment_id
            if eid not in exp_names:
                exp_names[eid] = client.get_experiment(eid).name
            out.append({"run_id": rid, "run_name": run.info.run_name, "experiment": exp_names[eid],
                        "experiment_id": eid, "estimator": estimator_label(params),
                        "beta": _number(params, "estimator.beta"), "lam": _number(params, "estimator.lam"),
                        "seed": _number(params, "seed"), "reward": metrics[reward_metric],
                        "reward_metric": reward_metric,
                        "seq_kl": metrics[SEQ_KL], "status": run.info.status, "params": dict(params),
                        "parent": run.data.tags.get("mlflow.parentRunId"), "start_time": run.info.start_time})
    kept, dropped = one_per_trial(out)
    if dropped:
        log.warning("%d run(s) repeat a trial of their sweep: only the newest run of each trial is counted",
                    len(dropped))
        out[:] = kept
        for p in dropped:
            out.skip("older run of the same trial", p["run_id"])
    return out


def log_pareto(client: MlflowClient, run_id: str, points: Any, exact_frontier: Frontier | None = None,
               ref_point: tuple[float, float] | None = None, n_boot: int = 1000,
               out_dir: str | Path | None = None) -> dict:
    """Logs the interactive figure pareto.html (mlflow.log_figure), pareto.png, pareto.csv and the pareto/*
    metrics to `run_id` (a sweep's parent run, a klbench-pareto run), and points the run's description at
    the figure; returns the summary (n_points, n_frontier, share, counts, hypervolume, ref_point,
    n_outside_ref). With `out_dir` (a sweep's folder), the three files are also kept there."""
    from mlflow.entities import Metric

    from klbench.analysis.plotly_figure import pareto_figure

    recs, summary = summarize(points, ref_point, n_boot=n_boot)
    if not recs:
        raise ValueError(f"no usable runs to put on a Pareto plot for run {run_id}")
    title = f"Pareto frontier of run {client.get_run(run_id).info.run_name}"
    with (contextlib.nullcontext(str(out_dir)) if out_dir is not None else tempfile.TemporaryDirectory()) as tmp:
        for path in write_pareto(recs, tmp, title, summary["ref_point"], exact_frontier):
            client.log_artifact(run_id, str(path))
        fig = pareto_figure(recs, exact_frontier, title, summary["ref_point"], n_boot=n_boot)
        # self-contained (plotly's script inside): MLflow's default fetches it from a CDN, which a
        # cluster's or a test's browser may not reach
        client.log_figure(run_id, fig, FIGURE, save_kwargs={"include_plotlyjs": True})
        if out_dir is not None:
            write_figure_html(fig, tmp)
    describe_frontier_run(client, run_id)
    now = int(time.time() * 1000)
    values = {f"pareto/share/{metric_name(lab)}": share for lab, share in summary["share"].items()}
    for lab, (lo, hi) in summary.get("share_ci", {}).items():
        values.update({f"pareto/share_lo/{metric_name(lab)}": lo, f"pareto/share_hi/{metric_name(lab)}": hi})
    values.update({"pareto/hypervolume": summary["hypervolume"], "pareto/n_points": summary["n_points"],
                   "pareto/n_frontier": summary["n_frontier"]})
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()])
    # a tag, not a param: params are immutable and the frontier may be recomputed with another reference
    client.set_tag(run_id, "pareto.ref_point", "reward={:g},seq_kl={:g}".format(*summary["ref_point"]))
    return summary


def exact_frontier_of(points: Sequence[dict]) -> Frontier | None:
    """The exact reward-vs-KL frontier the runs share, rebuilt from their logged params as the trials built
    it (klbench.models.policies, the tabular model with no teacher; klbench.rewards.reward): None unless
    every run is `model=tabular reward=tabular` with the same model and reward."""
    keys = ("model.kind", "reward.kind", "model.K", "model.T", "model.eos", "model.ref_seed", "model.ref_scale",
            "reward.seed", "reward.scale")
    seen = {tuple(param(p.get("params", {}), k) for k in keys) for p in points}
    teacher = any(k.startswith("teacher.") for p in points for k in p.get("params", {}) if param(p["params"], k))
    if len(seen) != 1 or teacher:
        return None
    kind, reward_kind, K, T, eos, ref_seed, ref_scale, seed, scale = next(iter(seen))
    if kind != "tabular" or reward_kind != "tabular":
        return None
    from klbench.exact.tabular import rl_frontier
    return rl_frontier(int(K), int(T), None if eos is None else int(eos), int(ref_seed), float(ref_scale),
                       int(seed), float(scale))


def describe_frontier_run(client: MlflowClient, run_id: str) -> None:
    """Points the run's description (the `mlflow.note.content` tag, shown on its Overview) at the figure. A
    description someone wrote is kept, with the pointer added below it."""
    old = client.get_run(run_id).data.tags.get(NOTE_TAG, "")
    if FIGURE in old:
        return
    client.set_tag(run_id, NOTE_TAG, (old.rstrip() + "\n\n" if old.strip() else "") + FRONTIER_NOTE)


def new_summary_run(client: MlflowClient, experiment_id: str, name: str, sources: str) -> str:
    """A run to log a recomputed frontier to, tagged so that later recomputations skip it."""
    return client.create_run(experiment_id, run_name=name, tags={SOURCES_TAG: sources}).info.run_id


# ---- the distillation report ----

def curve_from_run(client: MlflowClient, run) -> Curve | str:
    """The run's val/seq_kl history as a Curve, or the reason it cannot be used."""
    params = run.data.params
    if run.info.status != "FINISHED":
        return f"status {run.info.status}"
    if REPORT_TAG in run.data.tags:
        return "a report run"
    est = param(params, "estimator.name")
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
    seed, max_steps = param(params, "seed"), param(params, "task.max_steps")
    return Curve(run.info.run_id, est, int(seed) if seed is not None else None, steps, values,
                 int(max_steps) if max_steps is not None else None, run.info.start_time or 0)


def collect_curves(client: MlflowClient, run_ids: Sequence[str] = (), experiment_id: str | None = None,
                   parent_run_id: str | None = None) -> tuple[list[Curve], dict[str, list[str]]]:
    """Curves of the given runs, plus every finished task=distill run of an experiment or of a parent run.

    From a whole experiment several sweeps may repeat an (estimator, seed): the newest run of each is
    kept, so a recomputation reports one comparison. Returns (curves, skipped: reason -> run ids).
    """
    found = [client.get_run(r) for r in run_ids]
    if parent_run_id:
        exp = experiment_id or client.get_run(parent_run_id).info.experiment_id
        found += search_runs(client, [exp], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    elif experiment_id:
        found += search_runs(client, [experiment_id], "tags.`klbench.task` = 'distill'")
    curves, skipped, seen = [], {}, set()
    for run in found:
        if run.info.run_id in seen:
            continue
        seen.add(run.info.run_id)
        c = curve_from_run(client, run)
        if isinstance(c, str):
            skipped.setdefault(c, []).append(run.info.run_id)
        else:
            curves.append(c)
    curves, older = newest_per_seed(curves)
    if older:
        skipped["older repeat of an (estimator, seed)"] = older
    budgets = {c.max_steps for c in curves}
    if len(budgets) > 1:
        log.warning("runs have different step budgets %s: the curves are compared on shared steps only", budgets)
    return curves, skipped


def log_report(client: MlflowClient, experiment_id: str, curves: Sequence[Curve], out_dir: str | Path,
               sources: str, run_name: str = "distill-report", adopt: bool = True, **kw) -> tuple[str, dict]:
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
            metrics += [Metric(f"report/ratio_to_{BASELINE}/{est}", float(v), now, int(s))
                        for s, v in zip(*ratio_to(b, base))]
    for i in range(0, len(metrics), 900):  # MLflow takes at most 1000 metrics per batch
        client.log_batch(run_id, metrics=metrics[i:i + 900])
    if adopt:
        for c in curves:
            if "mlflow.parentRunId" not in client.get_run(c.run_id).data.tags:
                client.set_tag(c.run_id, "mlflow.parentRunId", run_id)
    client.set_terminated(run_id, "FINISHED")
    return run_id, report
