"""The sweeps' Hydra callback: one MLflow parent run per Optuna study with every trial as its child,
the Pareto frontier logged on the parent when the sweep ends, and restarts that resume the study.

Enabled by the sweep configs (sweeps/sweep/*.yaml, `hydra.callbacks.sweep_tracking`). `on_multirun_*`
run in the sweeper's process; `on_job_*` run in each trial's process, which is the same process with
the basic launcher, a fresh one with submitit, another machine with SLURM. The two sides therefore
talk only through files in the sweep folder and environment variables that the sweep configs read:
`logger.parent_run_id: ${oc.env:KLBENCH_PARENT_RUN_ID,null}`, `ckpt_path: ${oc.env:KLBENCH_RESUME_CKPT,null}`.
"""
from __future__ import annotations

import atexit
import logging
import math
import os
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, read_write

log = logging.getLogger(__name__)

PARENT_ENV = "KLBENCH_PARENT_RUN_ID"
RESUME_ENV = "KLBENCH_RESUME_CKPT"
PARENT_FILE = "mlflow_parent_run_id.txt"  # in the sweep folder, read by every trial
JOB_FILE = "klbench_trial.txt"  # in a trial folder: its overrides, so only that trial resumes its checkpoint
STUDY_PARENT = "klbench.mlflow_parent_run_id"  # study user attrs
STUDY_SETUP = "klbench.setup"
STUDY_SWEEP_DIR = "klbench.sweep_dir"  # the folder of the study's latest invocation
RETRY_OF = "klbench.retry_of"  # trial user attr: number of the interrupted trial this one re-runs


class SweepTracking(Callback):
    """Holds only strings: submitit pickles this object into every trial after on_multirun_start."""

    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.tracking_uri: str | None = None
        self.study: tuple[str, str] | None = None  # (name, storage)

    # ---- sweeper side ----

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from klbench import console
        console.setup()  # e.g. the sweeper's unlabelled result lines: on_multirun_end prints them labelled
        _tolerate_grid_stop()
        try:
            self._start(config)
            if self.parent_run_id is not None:
                # the plugin can end a sweep with an exception (too many failed trials in a batch),
                # and then Hydra skips on_multirun_end: the parent run must not stay RUNNING
                atexit.register(self._abandoned)
        except Exception as e:
            # Hydra downgrades callback exceptions to warnings; a sweep that would mix into another
            # study, or whose trials could not be tracked, must not start.
            raise SystemExit(f"klbench sweep: {type(e).__name__}: {e}") from e

    def _start(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        os.makedirs(config.paths.outputs, exist_ok=True)  # SQLite creates no folders
        n_trials = config.hydra.sweeper.get("n_trials")
        study = _prepare_study(config)
        if study is not None:
            self.study = (study.study_name, str(config.hydra.sweeper.storage))
        if config.logger.get("kind") != "mlflow":
            log.info("logger.kind=%s: no MLflow parent run for this sweep", config.logger.get("kind"))
            return
        from mlflow import MlflowClient

        from klbench.store import ensure_experiment
        lg = config.logger
        self.tracking_uri = lg.tracking_uri
        exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
        client = MlflowClient(lg.tracking_uri)
        parent = _reopen_parent(client, study, exp_id) if study is not None else None
        if parent is None:
            parent = _new_parent(client, exp_id, config, study, n_trials)
        client.set_tag(parent, "klbench.sweep.dir", str(sweep_dir))
        if study is not None:
            study.set_user_attr(STUDY_PARENT, parent)
        (sweep_dir / PARENT_FILE).write_text(parent)
        self.parent_run_id = parent
        log.info("MLflow parent run %s in experiment %r (%s)", parent, lg.experiment, lg.tracking_uri)

    def _abandoned(self) -> None:
        from mlflow import MlflowClient
        client = MlflowClient(self.tracking_uri)
        if client.get_run(self.parent_run_id).info.status == "RUNNING":
            client.set_tag(self.parent_run_id, "klbench.error", "the sweep process ended with an error before "
                                                                "the sweep's end (see its console)")
            client.set_terminated(self.parent_run_id, "FAILED")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        print_pareto_trials(sweep_dir, list(config.get("optimized_metrics") or ()))
        if self.parent_run_id is None:
            _print_sweep_where(sweep_dir)
            return
        atexit.unregister(self._abandoned)
        from mlflow import MlflowClient
        client = MlflowClient(self.tracking_uri)
        try:
            self._finish(client, config)
        except Exception:
            log.exception("could not summarise sweep run %s; marking it FAILED", self.parent_run_id)
            client.set_tag(self.parent_run_id, "klbench.error", traceback.format_exc(limit=0)[-5000:])
            client.set_terminated(self.parent_run_id, "FAILED")
        _print_sweep_where(sweep_dir, client, self.parent_run_id, self.tracking_uri)

    def _finish(self, client, config: DictConfig) -> None:
        from klbench.pareto import collect_runs, describe_groups, format_table, group_runs, log_pareto
        parent = self.parent_run_id
        children = client.search_runs([client.get_run(parent).info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{parent}'", max_results=50000)
        statuses = sorted({r.info.status for r in children})
        counts = {s: sum(r.info.status == s for r in children) for s in statuses}
        client.set_tag(parent, "klbench.sweep.trials", ", ".join(f"{n} {s}" for s, n in counts.items()) or "none")
        if failed := self._failed_trials():
            # trials stopped by their config have no MLflow run: the study is where they are recorded
            client.set_tag(parent, "klbench.sweep.failed_trials", failed[:5000])
            log.warning("failed trials (see each trial's log for the error): %s", failed)
        runs = collect_runs(client, parent_run_id=parent, noticed_by="the sweep's end")
        log.info("sweep %s: trial runs %s; for the Pareto plot: %s", parent, counts, runs.describe())
        swept = list(OmegaConf.select(config, "hydra.sweeper.params") or {})
        if len(groups := group_runs(runs, vary=swept)) > 1:
            raise ValueError(f"the trials are not comparable, so no one frontier: {describe_groups(groups)}")
        if not runs:
            client.set_tag(parent, "klbench.sweep.result", "no trial finished with finite val/reward and val/seq_kl")
            log.error("sweep %s: no trial finished with usable metrics; parent run marked FAILED", parent)
            client.set_terminated(parent, "FAILED")
            return
        frontier = exact_frontier(config)
        summary = log_pareto(client, parent, runs, exact_frontier=frontier, out_dir=config.hydra.sweep.dir)
        if frontier is not None:
            _log_frontier_gaps(client, parent, runs, frontier)
        print(f"\nPareto frontier of sweep run {parent} ({runs.describe()}):\n{format_table(summary)}")
        client.set_terminated(parent, "FINISHED")

    def _failed_trials(self) -> str:
        if self.study is None:
            return ""
        import optuna
        from optuna.trial import TrialState
        st = optuna.load_study(study_name=self.study[0], storage=self.study[1])
        retried = {t.user_attrs.get(RETRY_OF) for t in st.trials}
        return "; ".join(f"#{t.number} {t.params}" for t in st.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                         if t.number not in retried)

    # ---- trial side ----

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        parent_file = Path(config.hydra.sweep.dir) / PARENT_FILE
        _set_env(PARENT_ENV, parent_file.read_text().strip() if parent_file.is_file() else None)
        _set_env(RESUME_ENV, "last" if _own_checkpoint(config) else None)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            _requeue_outside_database()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        os.environ.pop(RESUME_ENV, None)  # the basic launcher runs the next trial in this process
        if config.logger.get("kind") != "mlflow":
            return
        from mlflow import MlflowClient

        from klbench.tracking import RUN_ID_FILE
        run_dir = Path(config.hydra.runtime.output_dir)
        client = MlflowClient(config.logger.tracking_uri)
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        err = getattr(job_return, "_return_value", None)  # JobReturn.return_value re-raises
        # SystemExit & co. are control flow (submitit requeueing a job, a kill): the trial goes on elsewhere
        from klbench.schema import ConfigError
        if job_return.status == JobStatus.FAILED and isinstance(err, ConfigError):
            log.error("trial not run: %s", err)  # stopped before anything was built: no MLflow run
        elif job_return.status == JobStatus.FAILED and isinstance(err, Exception):
            run_id = _record_failure(client, config, err, run_id)
        if run_id:
            client.set_tag(run_id, "klbench.run_dir", str(run_dir))


# ---- what the sweep prints at its end ----

def print_pareto_trials(sweep_dir: Path, metrics: list[str]) -> None:
    """The Optuna study's Pareto-optimal trials, labelled: the sweeper plugin logs them as
    `Values: [1.79, 4.35], Params: {...}` (silenced by klbench.console) and saves them in
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


def _print_sweep_where(sweep_dir: Path, client=None, parent: str | None = None, tracking_uri: str = "") -> None:
    from klbench import console
    lines = [("sweep folder", str(sweep_dir))]
    lines += [(name, str(sweep_dir / name)) for name in ("pareto.png", "pareto.csv") if (sweep_dir / name).is_file()]
    if parent is not None:
        info = client.get_run(parent).info
        exp = client.get_experiment(info.experiment_id).name
        lines.append(("MLflow run", f"{parent} ({info.run_name}, the sweep's parent run) in experiment {exp!r}"))
        ui = console.mlflow_ui_lines(tracking_uri, info.experiment_id, parent)
        lines += [("to see it" if i == 0 else "", line) for i, line in enumerate(ui)]
    console.print_where(lines)


# ---- the Optuna study: resume instead of duplicate ----

def _tolerate_grid_stop() -> None:
    """Optuna's GridSampler calls study.stop() after the trial that completes the grid, and stop() raises
    outside study.optimize. The sweeper plugin catches that for a completed trial but not for a failed
    one, so a sweep whose last grid trial failed exited 1 though every result was recorded. Only that
    one error is swallowed, and only in the sweep's own process."""
    import optuna
    grid = optuna.samplers.GridSampler
    if getattr(grid.after_trial, "_klbench", False):
        return
    original = grid.after_trial

    def after_trial(self, study, trial, state, values):
        try:
            original(self, study, trial, state, values)
        except RuntimeError as e:
            if "Study.stop" not in str(e):
                raise

    after_trial._klbench = True
    grid.after_trial = after_trial


def _prepare_study(config: DictConfig):
    """Opens the sweep's study, closes trials a dead sweep left RUNNING and re-queues their parameters,
    and turns `hydra.sweeper.n_trials` into the study's total: this invocation runs what is missing.

    Hydra instantiates the sweeper after this callback, so the budget is set by editing the config.
    """
    sw = config.hydra.sweeper
    name, storage = sw.get("study_name"), sw.get("storage")
    if not (name and storage and "n_trials" in sw):
        return None  # not the Optuna sweeper, or an in-memory study: nothing to resume
    import optuna
    from optuna.trial import TrialState
    dirs = sw.direction if OmegaConf.is_list(sw.direction) else [sw.direction]
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True,
                                directions=[getattr(d, "name", str(d)) for d in dirs])
    # what the trials run: the command line's task overrides and the search space
    setup = {"overrides": sorted(config.hydra.overrides.task),
             "params": {k: str(v) for k, v in (sw.get("params") or {}).items()}}
    first = study.user_attrs.get(STUDY_SETUP)
    if first is None:
        study.set_user_attr(STUDY_SETUP, setup)
    elif first != setup:
        raise ValueError(f"study {name!r} in {storage} was run with {first}, this sweep has {setup}; "
                         "repeat the original command to resume it, or start a new study with "
                         "hydra.sweeper.study_name=<new name>")
    if stale := study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # only a sweep process that died leaves RUNNING trials behind (restart after it has exited)
        _settle_orphans(study, stale, study.user_attrs.get(STUDY_SWEEP_DIR))
    study.set_user_attr(STUDY_SWEEP_DIR, str(config.hydra.sweep.dir))
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs[RETRY_OF] for t in trials if RETRY_OF in t.user_attrs}
    done = sum(t.state.is_finished() and t.number not in retried for t in trials)
    total = _study_total(config)
    _set_hydra_value(config, "sweeper.n_trials", max(0, total - done))
    seed = sw.get("sampler", {}).get("seed")
    if trials and seed is not None:
        # the sampler restarts with every invocation: with the first invocation's seed its random
        # start-up trials would propose the same points again. Offset by the study's size, so a rerun
        # of the same command still proposes the same (new) points.
        _set_hydra_value(config, "sweeper.sampler.seed", int(seed) + len(trials))
    log.info("study %r: %d of %d trials finished, running %d", name, done, total, sw.n_trials)
    return study


def _settle_orphans(study, stale: list, sweep_dir: str | None) -> None:
    """Closes the trials a dead sweep process left RUNNING, without running any of them twice.

    Their jobs outlive that process (SLURM array jobs, submitit's local processes): wait for those still
    pending or running, then take each trial's result from its job's result file, as the sweeper would
    have. A trial whose job left no result (never started, or killed) is marked FAIL and its parameters
    run again; one whose job raised is marked FAIL, as the sweeper marks it.
    """
    from optuna.trial import TrialState

    from klbench import jobs
    returns = jobs.wait_and_collect(Path(sweep_dir) / ".submitit") if sweep_dir else []
    for t in stale:
        wanted = {f"{k}={v}" for k, v in t.params.items()}
        ret = next((r for r in returns if wanted <= set(r.overrides)), None)
        if ret is not None:
            returns.remove(ret)
        values = jobs.objective_values(ret, len(study.directions)) if ret is not None else None
        if values is not None:
            study.tell(t.number, values=values)
            log.warning("trial %d finished after its sweep process died: result %s taken from its job",
                        t.number, values)
        elif ret is not None:
            study.tell(t.number, state=TrialState.FAIL)
            log.warning("trial %d failed after its sweep process died (see its job's log)", t.number)
        else:
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number})
            log.warning("trial %d was interrupted: marked FAIL, its parameters %s run again", t.number, t.params)


def _set_hydra_value(config: DictConfig, key: str, value) -> None:
    """Sets hydra.<key> as if given on the command line: Hydra rebuilds every trial's config from the
    command-line overrides and refuses trials whose hydra.sweeper differs from the sweeper's."""
    with read_write(config.hydra):
        OmegaConf.update(config.hydra, key, value)
        full = f"hydra.{key}"
        kept = [o for o in config.hydra.overrides.hydra if o.split("=", 1)[0].lstrip("+~") != full]
        config.hydra.overrides.hydra = kept + [f"{full}={value}"]


def _study_total(config: DictConfig) -> int:
    """n_trials, capped at the grid size for the grid sampler (which repeats points beyond it)."""
    sw = config.hydra.sweeper
    total = int(sw.n_trials)
    if sw.get("sampler", {}).get("_target_") != "optuna.samplers.GridSampler":
        return total
    from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
    args = [f"{k}={v}" for k, v in (sw.params or {}).items()] + list(config.hydra.overrides.task)
    dists, fixed, _ = create_params_from_overrides(args)  # as the sweeper parses them
    if both := sorted(set(dists) & set(fixed)):
        # the plugin builds the grid before it drops fixed values: it would enumerate these anyway
        # and run the same point several times
        raise ValueError(f"{both} are grid dimensions in hydra.sweeper.params and fixed on the command "
                         "line; narrow the grid instead, e.g. 'hydra.sweeper.params={seed:\"choice(0)\"}'")
    return min(total, math.prod(len(OptunaSweeperImpl._to_grid_sampler_choices(d)) for d in dists.values()))


# ---- the MLflow parent run ----

def _reopen_parent(client, study, exp_id: str) -> str | None:
    """The parent run of an earlier invocation of this study, set RUNNING again; None if there is none here."""
    from mlflow.exceptions import MlflowException

    from klbench.runs import owner_tags, reap
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
    client.update_run(run_id, status="RUNNING")
    log.info("resuming the study's parent run %s", run_id)
    return run_id


def _new_parent(client, exp_id: str, config: DictConfig, study, n_trials) -> str:
    from mlflow.entities import Param
    sw = config.hydra.sweeper
    sweep = OmegaConf.select(config, "hydra.runtime.choices.sweep") or "multirun"
    name = f"sweep-{study.study_name}" if study is not None else f"sweep-{sweep}"
    from klbench.runs import owner_tags
    tags = {"klbench.sweep": sweep, **owner_tags()}
    if study is not None:
        tags.update({"optuna.study_name": study.study_name, "optuna.storage": str(sw.storage)})
    run_id = client.create_run(exp_id, run_name=name, tags=tags).info.run_id
    params = {"sweep.name": sweep, "sweep.overrides": " ".join(config.hydra.overrides.task),
              "sweep.launcher": config.hydra.launcher.get("_target_", ""),
              "sweep.sampler": sw.get("sampler", {}).get("_target_", ""), "sweep.n_trials": n_trials,
              "sweep.n_jobs": sw.get("n_jobs"), "sweep.max_failure_rate": sw.get("max_failure_rate"),
              "sweep.direction": sw.get("direction")}
    params.update({f"sweep.params.{k}": v for k, v in (sw.get("params") or {}).items()})
    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items() if v is not None])
    client.log_text(run_id, OmegaConf.to_yaml(sw, resolve=True), "sweep/sweeper.yaml")
    return run_id


def exact_frontier(config: DictConfig):
    """The exact reward-vs-KL frontier of the tabular model and reward the trials train on (built by the
    same build_policy / build_reward the trials use); None otherwise."""
    model, reward = config.model, config.reward
    if model.kind != "tabular" or reward.kind != "tabular":
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}  # absent when composed without hydra
    swept = [k for k in params if k.split(".")[0] in ("model", "reward")]
    if swept:
        log.info("no exact frontier: the sweep changes %s, so trials do not share one", swept)
        return None
    from klbench.policies import build_policy
    from klbench.rewards import build_reward
    policy = build_policy(model, max_new_tokens=1)  # tabular: nothing is read from disk
    return policy.table.pareto_frontier(build_reward(reward, policy).table)


def _log_frontier_gaps(client, parent: str, runs, frontier) -> None:
    """Mean reward each estimator's trials leave below the exact frontier at their own KL."""
    from mlflow.entities import Metric
    gaps: dict[str, list[float]] = {}
    for p in runs:
        gaps.setdefault(p["estimator"], []).append(frontier.reward_gap(p["reward"], p["seq_kl"]))
    values = {f"pareto/frontier_gap/{est}": sum(g) / len(g) for est, g in gaps.items()}
    every = [g for gs in gaps.values() for g in gs]
    values["pareto/frontier_gap"] = sum(every) / len(every)
    now = int(time.time() * 1000)  # re-logged when a resumed sweep ends: the newest value must win
    client.log_batch(parent, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()])
    log.info("mean gap to the exact frontier: %s", {k: round(v, 4) for k, v in values.items()})


# ---- trial helpers ----

def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _requeue_outside_database() -> None:
    """Delays submitit's requeue signal while the trial is inside database code.

    submitit's handler ends the process with SystemExit wherever the signal lands. Inside an MLflow
    SQLite write, that leaves the transaction holding the database lock; Lightning's logger.finalize
    then waits on the lock until MLflow gives up, and the trial fails instead of being requeued.
    """
    import signal
    import threading
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    submitit_handler = signal.getsignal(sig)
    if not callable(submitit_handler):
        return

    def handler(signum, frame):
        f = frame
        while f is not None:
            if f.f_globals.get("__name__", "").startswith(("sqlalchemy", "mlflow.store")):
                threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()  # ask again shortly
                return
            f = f.f_back
        submitit_handler(signum, frame)

    signal.signal(sig, handler)


def _own_checkpoint(config: DictConfig) -> bool:
    """True when this trial's folder holds a last.ckpt that this same trial wrote (a requeued job).

    A folder can also be another trial's: a restarted sweep given a fixed hydra.sweep.dir numbers its
    jobs from 0 again. That trial's checkpoint and MLflow run id are then not this trial's to resume.
    """
    from klbench.tracking import RUN_ID_FILE
    run_dir = Path(config.hydra.runtime.output_dir)
    me = "\n".join(config.hydra.overrides.task)
    marker = run_dir / JOB_FILE
    if marker.is_file() and marker.read_text() == me:
        if (Path(config.paths.ckpt_dir) / "last.ckpt").is_file():
            log.info("resuming this trial from %s", Path(config.paths.ckpt_dir) / "last.ckpt")
            return True
        _close_attempt(config, run_dir / RUN_ID_FILE, "an earlier attempt of this trial saved no checkpoint")
    else:
        _close_attempt(config, run_dir / RUN_ID_FILE, "the folder belonged to another trial")
    marker.write_text(me)
    return False


def _close_attempt(config: DictConfig, id_file: Path, why: str) -> None:
    """Ends the MLflow run an earlier process left in this folder, so the new attempt starts its own."""
    if not id_file.is_file():
        return
    run_id = id_file.read_text().strip()
    id_file.unlink()
    if config.logger.get("kind") == "mlflow":
        from mlflow import MlflowClient
        client = MlflowClient(config.logger.tracking_uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, "KILLED")
    log.warning("%s: not resuming MLflow run %s", why, run_id)


def _record_failure(client, config: DictConfig, err: Exception, run_id: str | None) -> str | None:
    """Marks the failed trial's MLflow run FAILED. Lightning does that for exceptions inside fit; this
    covers the rest (non-finite final metrics, errors before the logger existed, where it creates one)."""
    from mlflow.entities import Param
    message = f"{type(err).__name__}: {err}"[:5000]
    if run_id is None:
        parent = os.environ.get(PARENT_ENV)
        from klbench.store import ensure_experiment
        lg = config.logger
        exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
        tags = {"mlflow.parentRunId": parent} if parent else {}
        overrides = list(config.hydra.overrides.task)
        run_id = client.create_run(exp_id, run_name="failed-" + "-".join(overrides)[:200], tags=tags).info.run_id
        client.log_batch(run_id, params=[Param(o.split("=", 1)[0], o.split("=", 1)[-1][:6000])
                                         for o in overrides if "=" in o])
    client.set_terminated(run_id, "FAILED")
    client.set_tag(run_id, "klbench.error", message)
    log.error("trial failed (%s); MLflow run %s marked FAILED", message[:300], run_id)
    return run_id
