"""The sweep's MLflow parent run: opened (or reopened, when a restarted sweep resumes its study) before
the first trial, summarised when the sweep ends (trial counts, failed trials, the Pareto frontier, drawn
interactively in pareto.html, and, for a tabular sweep, each estimator's gap to the exact frontier), and
never left RUNNING.

Also what the sweep prints at its end: Optuna's Pareto-optimal trials, labelled, and where everything is.
Runs in the sweeper's process only; the trials find the parent run's id in PARENT_FILE.
"""
from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from klbench.record.redact import redact
from klbench.sweep.exact import exact_frontier
from klbench.sweep.study import STUDY_PARENT, failed_trials

log = logging.getLogger(__name__)

PARENT_FILE = "mlflow_parent_run_id.txt"  # in the sweep folder, read by every trial
# what an invocation's end writes only in some cases: a resumed parent run starts without them
STALE_TAGS = ("klbench.error", "klbench.ended", "klbench.sweep.result", "klbench.sweep.failed_trials")


def open_parent(config: DictConfig, study, n_trials) -> str:
    """The sweep's parent run, RUNNING: the study's earlier one if it is in this experiment, else a new one.
    Its id goes to the study and to PARENT_FILE in the sweep folder."""
    from mlflow import MlflowClient

    from klbench.record.store import ensure_experiment
    lg = config.logger
    sweep_dir = Path(config.hydra.sweep.dir)
    # a sweep usually creates the store: from the migrated template, as a single run does (record/store.py)
    exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root, config.paths.get("cache"))
    client = MlflowClient(lg.tracking_uri)
    parent = reopen_parent(client, study, exp_id) if study is not None else None
    if parent is None:
        parent = new_parent(client, exp_id, config, study, n_trials)
    client.set_tag(parent, "klbench.sweep.dir", str(sweep_dir))
    if study is not None:
        study.set_user_attr(STUDY_PARENT, parent)
    (sweep_dir / PARENT_FILE).write_text(parent)
    log.info("MLflow parent run %s in experiment %r (%s)", parent, lg.experiment, redact(lg.tracking_uri))
    return parent


def reopen_parent(client, study, exp_id: str) -> str | None:
    """The parent run of an earlier invocation of this study, set RUNNING again; None if there is none here."""
    from mlflow.exceptions import MlflowException

    from klbench.record.runs import owner_tags, reap
    run_id = study.user_attrs.get(STUDY_PARENT)
    if not run_id:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException:
        log.warning("study's parent run %s is not in this tracking store; starting a new one", run_id)
        return None
    if run.info.lifecycle_stage != "active" or run.info.experiment_id != exp_id:
        return None
    for dead in reap(client, [exp_id], noticed_by="a resumed sweep"):
        log.warning("run %s was left RUNNING by a process that is gone: marked KILLED", dead)
    for k, v in owner_tags().items():
        client.set_tag(run_id, k, v)
    for stale in STALE_TAGS:  # how the last invocation ended: this one ends afresh
        if stale in run.data.tags:
            client.delete_tag(run_id, stale)
    client.update_run(run_id, status="RUNNING")
    log.info("resuming the study's parent run %s", run_id)
    return run_id


def new_parent(client, exp_id: str, config: DictConfig, study, n_trials) -> str:
    from mlflow.entities import Param
    sw = config.hydra.sweeper
    sweep = OmegaConf.select(config, "hydra.runtime.choices.sweep") or "multirun"
    name = f"sweep-{study.study_name}" if study is not None else f"sweep-{sweep}"
    from klbench.record.runs import owner_tags
    tags = {"klbench.sweep": sweep, **owner_tags()}
    if study is not None:
        tags.update({"optuna.study_name": study.study_name, "optuna.storage": redact(str(sw.storage))})
    run_id = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    params = {"sweep.name": sweep, "sweep.overrides": " ".join(config.hydra.overrides.task),
              "sweep.launcher": config.hydra.launcher.get("_target_", ""),
              "sweep.sampler": sw.get("sampler", {}).get("_target_", ""), "sweep.n_trials": n_trials,
              "sweep.n_jobs": sw.get("n_jobs"), "sweep.max_failure_rate": sw.get("max_failure_rate"),
              "sweep.direction": sw.get("direction")}
    params.update({f"sweep.params.{k}": v for k, v in (sw.get("params") or {}).items()})
    # the URLs on the command line and the sweeper's storage may carry passwords: the record keeps none
    client.log_batch(run_id, params=[Param(k, redact(str(v))[:6000]) for k, v in params.items() if v is not None])
    client.log_text(run_id, redact(OmegaConf.to_yaml(sw, resolve=True)), "sweep/sweeper.yaml")
    return run_id


# ---- the sweep's end ----

def finish(client, config: DictConfig, parent: str, study: tuple[str, str] | None) -> None:
    """Tags the trial counts and failed trials, logs the frontier of the trials that finished, and ends
    the parent run FINISHED, or FAILED when no trial is usable."""
    from klbench.analysis.frontier import describe_groups, format_table, group_runs
    from klbench.analysis.mlflow_io import collect_runs, log_pareto
    counts = tag_trial_counts(client, parent)
    from klbench.sweep.storage import StorageUnreachable
    try:
        failed = failed_trials(study)
    except StorageUnreachable:  # the sweep stopped on it (Hydra still calls its end): not a result
        client.set_tag(parent, "klbench.error", "the Optuna storage was unreachable, so the sweep stopped before "
                                                "its end; rerun the same command to finish it")
        client.set_terminated(parent, "FAILED")
        log.warning("sweep %s stopped before its end: parent run marked FAILED until a rerun finishes it", parent)
        return
    if failed:
        # trials stopped by their config have no MLflow run: the study is where they are recorded
        client.set_tag(parent, "klbench.sweep.failed_trials", failed[:5000])
        log.warning("failed trials (see each trial's log for the error): %s", failed)
    # the reward axis is the sweep's first objective (experiment=arith: val/accuracy)
    metric = (list(OmegaConf.select(config, "optimized_metrics") or []) or ["val/reward"])[0]
    runs = collect_runs(client, parent_run_id=parent, noticed_by="the sweep's end", reward_metric=metric)
    log.info("sweep %s: trial runs %s; for the Pareto plot: %s", parent, counts, runs.describe())
    swept = swept_keys(config)  # they, and the params derived from them (frontier.DERIVED), may differ
    if len(groups := group_runs(runs, vary=swept)) > 1:
        raise ValueError(f"the trials are not comparable, so no one frontier: {describe_groups(groups)}")
    if not runs:
        client.set_tag(parent, "klbench.sweep.result", f"no trial finished with finite {metric} and val/seq_kl")
        log.error("sweep %s: no trial finished with usable metrics; parent run marked FAILED", parent)
        client.set_terminated(parent, "FAILED")
        return
    frontier = exact_frontier(config)
    summary = log_pareto(client, parent, runs, exact_frontier=frontier, out_dir=config.hydra.sweep.dir)
    if frontier is not None:
        log_frontier_gaps(client, parent, runs, frontier)
    print(f"\nPareto frontier of sweep run {parent} ({runs.describe()}):\n{format_table(summary)}")
    client.set_terminated(parent, "FINISHED")


def tag_trial_counts(client, parent: str) -> dict[str, int]:
    """The parent run's trial runs by status, also in its `klbench.sweep.trials` tag."""
    from klbench.analysis.mlflow_io import search_runs
    children = search_runs(client, [client.get_run(parent).info.experiment_id],
                           f"tags.mlflow.parentRunId = '{parent}'")
    statuses = sorted({r.info.status for r in children})
    counts = {s: sum(r.info.status == s for r in children) for s in statuses}
    client.set_tag(parent, "klbench.sweep.trials", ", ".join(f"{n} {s}" for s, n in counts.items()) or "none")
    return counts


def stop(client, parent: str, why: str) -> None:
    """A sweep stopped by a signal: its parent run ends KILLED, `why` in its klbench.ended tag, without the
    frontier (the rerun that finishes the study draws it)."""
    from klbench.record.runs import ENDED
    tag_trial_counts(client, parent)
    client.set_tag(parent, ENDED, why)
    client.set_terminated(parent, "KILLED")


def fail(client, parent: str) -> str:
    """Call while handling the exception that stopped `finish`: the parent run ends FAILED with it. Returns the
    error's one line (the traceback goes to the log file only: the sweep's own line says what failed)."""
    error = redact(traceback.format_exc(limit=0)).strip().splitlines()[-1]
    log.debug("could not summarise sweep run %s", parent, exc_info=True)
    client.set_tag(parent, "klbench.error", error[-5000:])
    client.set_terminated(parent, "FAILED")
    return error


def failed_why(client, parent: str) -> str | None:
    """Why the parent run ended FAILED (its klbench.error or klbench.sweep.result tag), None unless it did."""
    run = client.get_run(parent)
    if run.info.status != "FAILED":
        return None
    tags = run.data.tags
    return tags.get("klbench.error") or tags.get("klbench.sweep.result") or "see the sweep's log"


def abandon(tracking_uri: str, parent: str) -> None:
    """At exit of a sweep process that never reached its end: a parent run still RUNNING becomes FAILED."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri)
    if client.get_run(parent).info.status == "RUNNING":
        client.set_tag(parent, "klbench.error", "the sweep process ended with an error before "
                                                "the sweep's end (see its console)")
        client.set_terminated(parent, "FAILED")


def log_frontier_gaps(client, parent: str, runs, frontier) -> None:
    """Mean reward each estimator's trials leave below the exact frontier at their own KL."""
    from mlflow.entities import Metric
    from klbench.analysis.mlflow_io import metric_name
    gaps: dict[str, list[float]] = {}
    for p in runs:
        gaps.setdefault(p["estimator"], []).append(frontier.reward_gap(p["reward"], p["seq_kl"]))
    values = {f"pareto/frontier_gap/{metric_name(est)}": sum(g) / len(g) for est, g in gaps.items()}
    every = [g for gs in gaps.values() for g in gs]
    values["pareto/frontier_gap"] = sum(every) / len(every)
    now = int(time.time() * 1000)  # re-logged when a resumed sweep ends: the newest value must win
    client.log_batch(parent, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()])
    log.info("mean gap to the exact frontier: %s", {k: round(v, 4) for k, v in values.items()})


# ---- what the sweep prints at its end ----

def print_pareto_trials(sweep_dir: Path, metrics: list[str]) -> None:
    """The Optuna study's Pareto-optimal trials, labelled: the sweeper plugin logs them as
    `Values: [1.79, 4.35], Params: {...}` (silenced by klbench.console.messages) and saves them in
    optimization_results.yaml, read here."""
    path = sweep_dir / "optimization_results.yaml"
    if not path.is_file():  # not the Optuna sweeper, or it stopped before its end
        return
    solutions = OmegaConf.to_container(OmegaConf.load(path)).get("solutions")
    if not solutions:  # a single objective: the plugin's own "Best value" lines say it
        return
    names = metrics if len(metrics) == len(solutions[0]["values"]) else \
        [f"objective {i}" for i in range(len(solutions[0]["values"]))]
    width = max(12, *(len(n) for n in names))
    rows = sorted(solutions, key=lambda s: tuple(s["values"][1:]) + tuple(s["values"][:1]))
    print(f"\nOptuna's Pareto-optimal trials of this sweep ({len(rows)}, by {names[-1]}):")
    print("  ".join(f"{n:>{width}}" for n in names) + "  params")
    for sol in rows:
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sol["params"].items())
        print("  ".join(f"{v:>{width}.4f}" for v in sol["values"]) + f"  {params}")


def print_sweep_where(sweep_dir: Path, client=None, parent: str | None = None, tracking_uri: str = "",
                      stopped: str | None = None) -> None:
    """`stopped`: how a sweep stopped by a signal ended, and how to finish it."""
    from klbench.console import messages as console
    lines = [("stopped", stopped)] if stopped else []
    lines += [("sweep folder", str(sweep_dir))]
    lines += [(name, str(sweep_dir / name)) for name in ("pareto.html", "pareto.png", "pareto.csv")
              if (sweep_dir / name).is_file()]
    if parent is not None:
        info = client.get_run(parent).info
        exp = client.get_experiment(info.experiment_id).name
        lines.append(("MLflow run", f"{parent} ({info.run_name}, the sweep's parent run) in experiment {exp!r}"))
        ui = console.mlflow_ui_lines(tracking_uri, info.experiment_id, parent, console.ui_port())
        lines += [("to see it" if i == 0 else "", line) for i, line in enumerate(ui)]
    console.print_where(lines)


def swept_keys(config: DictConfig) -> list[str]:
    """Every key the sweep varies, on the sweeper's side: hydra.sweeper.params and the command line's sweeps
    (`'task.temperature=choice(0.7,1.0)'`, `seed=0,1`), which the Optuna sweeper adds to its search space."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    keys = list(OmegaConf.select(config, "hydra.sweeper.params") or {})
    parsed = OverridesParser.create().parse_overrides(list(OmegaConf.select(config, "hydra.overrides.task") or []))
    return keys + [o.key_or_group for o in parsed if o.is_sweep_override() and o.key_or_group not in keys]
