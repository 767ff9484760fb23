"""The trials a dead sweep process left RUNNING, settled by its rerun without training any twice.

The evidence, in the order it is trusted: the trial's MLflow run (a FINISHED child of the study's parent
run with the trial's params), then its job's result file. A result file is a pickle, and unpickling runs
code, so it is read only from the sweep folders this user's own sweeps recorded (klbench.sweep.jobs), never
from a folder the study database names: on a shared database anyone who can write the study could name
one. Called by klbench.sweep.study.prepare_study.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger(__name__)

# the study's user attributes a resume reads, and the trials' one it writes (klbench.sweep.study re-exports them)
STUDY_PARENT = "klbench.mlflow_parent_run_id"  # the MLflow parent run: its children are the trials' runs
STUDY_SWEEP_DIR = "klbench.sweep_dir"  # the folder of the study's latest invocation: for people, never read
RETRY_OF = "klbench.retry_of"  # trial user attr: number of the interrupted trial this one re-runs

CLOCK_SKEW_S = 60  # a trial's MLflow run starts after the trial; by this much earlier on another host's clock


def job_folders(config: DictConfig, study, recorded: Path | None) -> list[Path]:
    """The sweep folders whose jobs a resume may wait for and read: this invocation's, and the study's
    previous one as this user recorded it (klbench.sweep.jobs.recorded_sweep_dir). Never the folder that the
    study database names: anyone who can write the study could name a folder of pickles there."""
    folders = [Path(config.hydra.sweep.dir).resolve()]
    if recorded is not None and recorded.resolve() not in folders:
        folders.append(recorded.resolve())
    named = study.user_attrs.get(STUDY_SWEEP_DIR)
    if named and Path(str(named)).resolve() not in folders:
        log.warning("study %r names the sweep folder %s (user attribute %s), which no sweep of this user "
                    "recorded in %s: ignored, its trials' results are taken from MLflow only",
                    study.study_name, named, STUDY_SWEEP_DIR, config.paths.outputs)
    return folders


def trial_runs(config: DictConfig, study) -> list:
    """The MLflow runs of the study's parent run (its trials' runs); [] without MLflow or a parent."""
    parent = study.user_attrs.get(STUDY_PARENT)
    if config.logger.get("kind") != "mlflow" or not parent:
        return []
    if not re.fullmatch(r"[0-9A-Za-z_-]+", str(parent)):
        log.warning("study %r names %r as its MLflow parent run: not a run id, ignored", study.study_name, parent)
        return []
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from klbench.analysis.mlflow_io import child_runs
    try:
        return child_runs(MlflowClient(config.logger.tracking_uri), parent, noticed_by="a resumed sweep")
    except MlflowException as e:
        log.warning("the study's parent run %s is not readable in %s (%s): trials' results come from their "
                    "jobs only", parent, config.logger.tracking_uri, e)
        return []


def settle_orphans(study, stale: list, folders: list[Path] = (), runs: list = (), metrics: list[str] = (),
                   cause: str = "its sweep process died") -> None:
    """Closes the trials a dead sweep process left RUNNING, without running any of them twice (also the
    trials of a sweep stopped by a signal, at its end: `cause` says which, in the log).

    Call it once the jobs in `folders` have ended (klbench.sweep.jobs.wait): their jobs outlive that process
    (SLURM array jobs, submitit's local processes). Each trial's result is taken, as the sweeper would
    have told it, from the evidence at hand:
    - its MLflow run among `runs` (the parent run's children): the newest one with the trial's params
      that started after the trial. FINISHED with all its steps and finite `metrics` (the objectives, in
      order): the trial is COMPLETE with them. FAILED: the trial failed, and is FAIL.
    - else its job's result file in `folders` (read only after klbench.sweep.jobs.unsafe's checks): a result
      makes it COMPLETE, a job that raised makes it FAIL;
    - else (its job never started or was killed) it is FAIL and its parameters run again.
    """
    from optuna.trial import TrialState

    from klbench.sweep import jobs
    returns, used = None, set()
    for t in stale:
        run = trial_run(t, [r for r in runs if r.info.run_id not in used])
        values = run_values(run, metrics, len(study.directions)) if run is not None else None
        if values is not None:
            used.add(run.info.run_id)
            study.tell(t.number, values=values)
            log.warning("trial %d finished though %s: result %s taken from its job (MLflow run %s)", t.number,
                        cause, values, run.info.run_id)
            continue
        if run is not None and run.info.status == "FAILED":
            used.add(run.info.run_id)
            study.tell(t.number, state=TrialState.FAIL)
            log.warning("trial %d failed though %s (MLflow run %s)", t.number, cause, run.info.run_id)
            continue
        if returns is None:  # unpickled only for a trial that MLflow cannot settle
            returns = [r for folder in folders for r in jobs.results(folder)]
        wanted = {f"{k}={v}" for k, v in t.params.items()}
        ret = next((r for r in returns if wanted <= set(r.overrides)), None)
        if ret is not None:
            returns.remove(ret)
        values = jobs.objective_values(ret, len(study.directions)) if ret is not None else None
        if values is not None:
            study.tell(t.number, values=values)
            log.warning("trial %d finished though %s: result %s taken from its job (result file)", t.number,
                        cause, values)
        elif ret is not None:
            study.tell(t.number, state=TrialState.FAIL)
            log.warning("trial %d failed though %s (see its job's log)", t.number, cause)
        else:
            study.tell(t.number, state=TrialState.FAIL)
            study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number})
            log.warning("trial %d was interrupted (%s): marked FAIL, its parameters %s run again", t.number,
                        cause, t.params)


def trial_run(trial, runs: list):
    """Of `runs`, the newest FINISHED (else newest) one that ran this trial's params and started after it
    (CLOCK_SKEW_S), or None.
    A swept config group (`estimator: choice(seq, rb)`) is matched by the name its runs log
    (estimator.name, model.kind, dataset.source)."""
    from klbench.analysis.mlflow_io import param
    start_ms = (trial.datetime_start.timestamp() - CLOCK_SKEW_S) * 1000 if trial.datetime_start else 0

    def ran(run) -> bool:
        ps = run.data.params
        for key, value in trial.params.items():
            raw = next((v for k in (key, f"{key}.name", f"{key}.kind", f"{key}.source")
                        if (v := param(ps, k)) is not None), None)
            if raw is None or not _same(raw, value):
                return False
        return (run.info.start_time or 0) >= start_ms

    matches = [r for r in runs if ran(r)]
    # a FINISHED one first: an interrupted attempt of the same params, later, is not what settles it
    return max(matches, key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0)) if matches else None


def _same(raw: str, value) -> bool:
    """A logged param (a string) against a trial's param value."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(raw) == float(value)
        except ValueError:
            return False
    return raw == str(value)


def run_values(run, metrics: list[str], n_objectives: int) -> list[float] | None:
    """The objectives a FINISHED run that did all its steps reached; None if it did not, or lacks one."""
    from klbench.record.runs import completed
    if run.info.status != "FINISHED" or not completed(run.data.tags)[0] or len(metrics) != n_objectives:
        return None
    values = [run.data.metrics.get(m) for m in metrics]
    if any(v is None or not math.isfinite(v) for v in values):
        return None
    return [float(v) for v in values]
