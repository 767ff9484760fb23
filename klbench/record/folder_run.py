"""A run folder's MLflow run, read and settled outside the logger: whether it finished (a resume of a finished run
answers without training), its state (which checkpoint a resume takes), whether a resume writes to the store it
started in, and a refused resume's run marked KILLED when its process is gone (klbench.tasks.train)."""
from __future__ import annotations

import logging

from omegaconf import DictConfig

from klbench.record import runs, store
from klbench.record.redact import redact


def _folder_run(cfg: DictConfig):
    """(client, run) of the MLflow run this run folder belongs to, or None (no id file, another logger)."""
    from klbench.record.resume import folder_run_id
    if cfg.logger.get("kind") != "mlflow" or not (run_id := folder_run_id(cfg)):
        return None
    import mlflow
    store.open_store(cfg.logger.tracking_uri, create=False)  # a client would create an absent SQLite store
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    return client, client.get_run(run_id)


def check_resume_store(cfg: DictConfig, payload: dict) -> None:
    """The MLflow run a resume continues (the folder's mlflow_run_id.txt) is in the store this resume writes
    to: checked before a store is opened or created, so that a resume pointed at another store (another
    $MLFLOW_TRACKING_URI or $KLBENCH_OUTPUTS) is refused in one line and leaves no empty store behind."""
    from klbench.record.resume import ResumeError, folder_run_id
    if cfg.logger.get("kind") != "mlflow" or not (run_id := folder_run_id(cfg)):
        return
    import mlflow
    uri = cfg.logger.tracking_uri
    try:
        store.open_store(uri, create=False)
        mlflow.MlflowClient(uri).get_run(run_id)
    except (store.StoreError, mlflow.exceptions.MlflowException):
        was = (payload.get("config") or {}).get("logger", {}).get("tracking_uri")
        started = f", and the run started with {was}" if was and was != redact(uri) else ""
        raise ResumeError(f"this run folder's MLflow run {run_id} is not in {redact(uri)}, the store this resume "
                          f"writes to{started}: resume with the store the run started with (MLFLOW_TRACKING_URI, "
                          f"KLBENCH_OUTPUTS)") from None


def run_finished(cfg: DictConfig) -> bool:
    """Whether this run folder's record says FINISHED; with no MLflow record, the checkpoint alone decides."""
    from mlflow.exceptions import MlflowException
    try:
        found = _folder_run(cfg)
    except (MlflowException, store.StoreError):  # the folder names a run this store lacks: build_logger says so
        return False
    return found is None or found[1].info.status == "FINISHED"


def folder_run_state(cfg: DictConfig) -> tuple[str, str, int] | None:
    """(MLflow run id, status, klbench.steps_done) of this run folder's run, or None (no record, no store)."""
    from mlflow.exceptions import MlflowException
    try:
        found = _folder_run(cfg)
    except (MlflowException, store.StoreError):
        return None
    if found is None:
        return None
    run = found[1]
    steps = run.data.tags.get(runs.STEPS_DONE, "0")
    return run.info.run_id, run.info.status, int(steps) if steps.isdigit() else 0


def settle_folder_run(cfg: DictConfig, why: str) -> None:
    """A resume that is refused leaves no run RUNNING behind it: the folder's MLflow run, if its process
    is gone, is marked KILLED now (instead of by the next fresh start). Never masks the refusal."""
    from mlflow.exceptions import MlflowException
    try:
        found = _folder_run(cfg)
    except (store.StoreError, MlflowException):  # no store there, or not this run: nothing to settle in it
        return
    try:
        if found is None:
            return
        client, run = found
        if run.info.status == "RUNNING" and runs.owner_alive(run.data.tags) is False:
            client.set_tag(run.info.run_id, runs.ENDED, why[:5000])
            client.set_terminated(run.info.run_id, "KILLED")
    except Exception as e:  # the refusal is what the user must see
        logging.getLogger(__name__).warning("could not settle this folder's MLflow run: %s", e)
