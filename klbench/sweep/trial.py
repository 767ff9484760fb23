"""A trial's side of the sweep: which checkpoint and MLflow run in its folder are its own, and the
failures Lightning does not record.

Runs in the trial's process (see klbench.sweep.callback). It hands its decisions to the trial's
config through environment variables that the sweep configs read: PARENT_ENV becomes
logger.parent_run_id, RESUME_ENV becomes ckpt_path, NAME_ENV becomes logger.run_name.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from klbench.record.redact import redact
from klbench.record.runs import RUN_ID_FILE
from klbench.record.experiments import trial_name
from klbench.sweep.parent import PARENT_FILE

log = logging.getLogger(__name__)

PARENT_ENV = "KLBENCH_PARENT_RUN_ID"
RESUME_ENV = "KLBENCH_RESUME_CKPT"
NAME_ENV = "KLBENCH_RUN_NAME"
JOB_FILE = "klbench_trial.txt"  # in a trial folder: its overrides, so only that trial resumes its checkpoint


def start(config: DictConfig) -> None:
    """Before the trial runs: its parent run, and whether it resumes from its folder's last.ckpt."""
    parent_file = Path(config.hydra.sweep.dir) / PARENT_FILE
    _set_env(PARENT_ENV, parent_file.read_text().strip() if parent_file.is_file() else None)
    _set_env(RESUME_ENV, "last" if own_checkpoint(config) else None)
    _set_env(NAME_ENV, trial_name(config, swept_values(config)))


def swept_values(config: DictConfig) -> dict[str, object]:
    """The values this trial's config holds for the keys the sweep varies (hydra.sweeper.params), in order."""
    return {key: OmegaConf.select(config, key) for key in OmegaConf.select(config, "hydra.sweeper.params") or {}}


def end(config: DictConfig, job_return: JobReturn) -> None:
    """After the trial: its MLflow run marked FAILED if it failed, and tagged with its folder."""
    for key in (RESUME_ENV, NAME_ENV):  # the basic launcher runs the next trial in this process
        os.environ.pop(key, None)
    from klbench.console.logfile import stop_copy
    stop_copy()  # the next trial's prints go to its own klbench.log
    if config.logger.get("kind") != "mlflow":
        return
    from mlflow import MlflowClient

    run_dir = Path(config.hydra.runtime.output_dir)
    client = MlflowClient(config.logger.tracking_uri)
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    err = getattr(job_return, "_return_value", None)  # JobReturn.return_value re-raises
    # SystemExit & co. are control flow (submitit requeueing a job, a kill): the trial goes on elsewhere
    from klbench.config.schema import ConfigError
    if job_return.status == JobStatus.FAILED and isinstance(err, ConfigError):
        log.error("trial not run: %s", err)  # stopped before anything was built: no MLflow run
    elif job_return.status == JobStatus.FAILED and isinstance(err, Exception):
        run_id = record_failure(client, config, err, run_id)
    if run_id:
        client.set_tag(run_id, "klbench.run_dir", str(run_dir))


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def own_checkpoint(config: DictConfig) -> bool:
    """True when this trial's folder holds a last.ckpt that this same trial wrote (a requeued job).

    A folder can also be another trial's: a restarted sweep given a fixed hydra.sweep.dir numbers its
    jobs from 0 again. That trial's checkpoint and MLflow run id are then not this trial's to resume.
    """
    run_dir = Path(config.hydra.runtime.output_dir)
    me = redact("\n".join(config.hydra.overrides.task))  # a file in the run folder: no password in it
    marker = run_dir / JOB_FILE
    if marker.is_file() and marker.read_text() == me:
        if (Path(config.paths.ckpt_dir) / "last.ckpt").is_file():
            log.info("resuming this trial from %s", Path(config.paths.ckpt_dir) / "last.ckpt")
            return True
        close_attempt(config, run_dir / RUN_ID_FILE, "an earlier attempt of this trial saved no checkpoint")
    else:
        close_attempt(config, run_dir / RUN_ID_FILE, "the folder belonged to another trial")
    marker.write_text(me)
    return False


def close_attempt(config: DictConfig, id_file: Path, why: str) -> None:
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


def record_failure(client, config: DictConfig, err: Exception, run_id: str | None) -> str | None:
    """Marks the failed trial's MLflow run FAILED. Lightning does that for exceptions inside fit; this
    covers the rest (non-finite final metrics, errors before the logger existed, where it creates one)."""
    from mlflow.entities import Param
    message = redact(f"{type(err).__name__}: {err}")[:5000]
    if run_id is None:
        parent = os.environ.get(PARENT_ENV)
        from klbench.record.store import ensure_experiment
        lg = config.logger
        exp_id = ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
        tags = {"mlflow.parentRunId": parent} if parent else {}
        overrides = list(config.hydra.overrides.task)
        run_id = client.create_run(exp_id, run_name=redact("failed-" + "-".join(overrides))[:200],
                                   tags=tags).info.run_id
        client.log_batch(run_id, params=[Param(o.split("=", 1)[0], redact(o.split("=", 1)[-1])[:6000])
                                         for o in overrides if "=" in o])
    client.set_terminated(run_id, "FAILED")
    client.set_tag(run_id, "klbench.error", message)
    log.error("trial failed (%s); MLflow run %s marked FAILED", message[:300], run_id)
    return run_id
