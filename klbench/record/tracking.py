"""The `logger` group: MLflow (default), CSV or none; run naming, config logging, the checkpoint that
commits the record, sample tables.

- Metrics wait in memory and reach MLflow when the checkpoint is written (RecordCheckpoint), so the
  record never holds a value that a resume computes again. The pending values also travel inside the
  checkpoint, so a crash between writing it and committing them loses nothing.
- A resumed run continues the same MLflow run (its id is kept in the run folder), goes back to
  RUNNING, and never logs a step twice.

How a run starts, commits and ends (its status: RUNNING, FINISHED, FAILED, KILLED) is
klbench.record.lifecycle.
"""
from __future__ import annotations

import os
import time

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from klbench.record import runs, store
from klbench.record.experiments import RUN_DIR_TAG, run_name, split_config
from klbench.record.redact import redact, redact_obj

CKPT_KEY = "klbench"  # the checkpoint's own section: config, pending metrics, step


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """Resolved config flattened with '.' (estimator.name, estimator.beta, ...); MLflow caps values at 6000 chars.
    A password in a URL (store.optuna, store.mlflow) becomes *** (klbench.record.redact). build_logger logs the
    design as params and the bookkeeping as tags (klbench.record.experiments.split_config)."""
    out: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = redact(str(node))[:6000]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


class RecordLogger(Logger):
    """One MLflow run, written only at commits (see the module docstring). Rank zero holds the client;
    other DDP ranks get a logger with none, whose methods do nothing."""

    def __init__(self, client=None, run_id: str | None = None, experiment: str = "", logged_upto=None):
        super().__init__()
        self.client, self.run_id, self._experiment = client, run_id, experiment
        self.pending: list[list] = []  # [key, value, timestamp ms, step]: JSON-like, for the checkpoint
        # per metric, the last step already in the store (a resumed run): never logged again
        self.logged_upto: dict[str, int] = dict(logged_upto or {})

    @property
    def name(self) -> str:
        return self._experiment

    @property
    def version(self) -> str | None:
        return self.run_id

    @property
    def experiment(self):
        return self.client

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # build_logger logs the whole resolved config once, when it creates the run

    @rank_zero_only
    def log_metrics(self, metrics, step: int | None = None) -> None:
        now, step = int(time.time() * 1000), int(step or 0)
        for key, value in metrics.items():
            if step > self.logged_upto.get(key, -1):
                self.pending.append([key, float(value), now, step])

    def restore(self, pending: list[list]) -> None:
        """Values a checkpoint carried: committed with the next commit unless already in the store."""
        if self.client is not None:
            self.pending = [m for m in pending if m[3] > self.logged_upto.get(m[0], -1)] + self.pending

    @rank_zero_only
    def commit(self, steps_done: int | None = None) -> None:
        from mlflow.entities import Metric
        if self.client is None:
            return
        batch = [Metric(k, v, t, s) for k, v, t, s in self.pending]
        for i in range(0, len(batch), 1000):  # MLflow's log_batch limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        for k, _, _, s in self.pending:
            self.logged_upto[k] = max(s, self.logged_upto.get(k, -1))
        self.pending = []
        if steps_done is not None:
            runs.progress(self.client, self.run_id, steps_done)

    @rank_zero_only
    def end(self, status: str, error: str | None = None) -> None:
        if self.client is None:
            return
        if error:
            self.client.set_tag(self.run_id, runs.ERROR if status == "FAILED" else runs.ENDED, redact(error)[:5000])
        self.client.set_terminated(self.run_id, status)

    def finalize(self, status: str) -> None:
        pass  # Lightning calls this after every validate() and fit(): the run's end is klbench.record.lifecycle's to say

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        pass  # RecordCheckpoint commits, once the file is in place


def _last_steps(client, run_id: str) -> dict[str, int]:
    keys = client.get_run(run_id).data.metrics
    return {k: max(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def build_logger(cfg: DictConfig, resume: bool = False):
    lg = cfg.logger
    run_dir = os.path.dirname(cfg.paths.ckpt_dir)
    if lg.kind == "none":
        return False
    if lg.kind == "csv":
        return CSVLogger(save_dir=run_dir, name="csv", version="")
    if lg.kind != "mlflow":
        raise ValueError(f"logger.kind must be mlflow, csv or none; got {lg.kind!r}")
    if rank_zero_only.rank != 0:  # DDP: only rank zero writes the record
        return RecordLogger(experiment=lg.experiment)
    import mlflow
    # a fresh store: a copy of the migrated template in the per-user cache (klbench.record.store)
    exp_id = store.ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root, cfg.paths.get("cache"))
    client = mlflow.MlflowClient(lg.tracking_uri)
    runs.reap(client, [exp_id], noticed_by=f"a run starting (pid {os.getpid()})")
    id_file = os.path.join(run_dir, runs.RUN_ID_FILE)
    tags = {**runs.owner_tags(), runs.MAX_STEPS: str(cfg.task.max_steps if "max_steps" in cfg.task else 1),  # probe: 1
            RUN_DIR_TAG: os.path.abspath(run_dir)}
    if resume and os.path.isfile(id_file):
        run_id = open(id_file).read().strip()
        try:
            old_tags = client.get_run(run_id).data.tags
        except mlflow.exceptions.MlflowException as e:
            raise ValueError(f"{id_file} names MLflow run {run_id}, which is not in {redact(lg.tracking_uri)}") from e
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        for stale in (runs.ENDED, runs.ERROR):  # how the last attempt ended; this one starts afresh
            if stale in old_tags:
                client.delete_tag(run_id, stale)
        client.update_run(run_id, status="RUNNING")
        return RecordLogger(client, run_id, lg.experiment, _last_steps(client, run_id))
    params, bookkeeping = split_config(flat_params(cfg))
    tags.update({"klbench.task": cfg.task.name, "klbench.estimator": cfg.estimator.name, runs.STEPS_DONE: "0",
                 **bookkeeping})
    if lg.get("parent_run_id"):
        tags["mlflow.parentRunId"] = lg.parent_run_id
    run_id = client.create_run(exp_id, run_name=lg.run_name or run_name(cfg), tags=tags).info.run_id
    os.makedirs(run_dir, exist_ok=True)
    with open(id_file, "w") as f:
        f.write(run_id)
    from mlflow.entities import Param
    params = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(params), 100):  # MLflow's log_batch limit for params
        client.log_batch(run_id, params=params[i:i + 100])
    client.log_text(run_id, redact(OmegaConf.to_yaml(cfg, resolve=True)), "config.yaml")
    return RecordLogger(client, run_id, lg.experiment)


class RecordCheckpoint(Callback):
    """Writes <ckpt_dir>/last.ckpt after every validation of a fit, atomically (a kill mid-write leaves
    the previous checkpoint whole), with the run's config (passwords in URLs as ***) and pending metrics;
    then commits them."""

    def __init__(self, ckpt_dir: str, config: dict):
        self.path = os.path.join(ckpt_dir, "last.ckpt")
        self.config = redact_obj(config)
        # klbench.record.resume.frozen_fingerprint of the task, set by the training runner before fit: a resume
        # onto other frozen weights (a LoRA base replaced at its path) is refused with it
        self.fingerprint: str | None = None

    @staticmethod
    def of(trainer) -> "RecordCheckpoint":
        return next(c for c in trainer.callbacks if isinstance(c, RecordCheckpoint))

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        self.save(trainer)

    def save(self, trainer) -> None:
        """Also called by the training runner after a final validation outside fit (max_steps not a multiple of
        val_every), so that a finished run's last.ckpt is at its last step and says it finished."""
        tmp = self.path + ".tmp"
        trainer.save_checkpoint(tmp, weights_only=False)
        if trainer.is_global_zero:
            os.replace(tmp, self.path)
        trainer.strategy.barrier()
        if isinstance(trainer.logger, RecordLogger):
            trainer.logger.commit(trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        record = trainer.logger if isinstance(trainer.logger, RecordLogger) else None
        checkpoint[CKPT_KEY] = {
            "config": self.config, "pending_metrics": list(record.pending) if record else [],
            "step": trainer.global_step,
            # the run this checkpoint continues: a resume into any other MLflow run is refused (klbench.record.resume)
            "mlflow_run_id": record.run_id if record else None,
            # the validation just made: a resume of a finished run answers with it instead of training
            "val_metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
            "frozen_fingerprint": self.fingerprint}


def log_params(logger, params: dict[str, str]) -> None:
    """Params a run learns once it is built (the sampling it used, where a model's generation_config chose it),
    beside the config's; MLflow only (a resumed run logs the same values again, which MLflow accepts)."""
    if isinstance(logger, RecordLogger) and logger.client is not None:
        before = logger.client.get_run(logger.run_id).data.params
        for key, value in params.items():
            value = redact(str(value))[:6000]
            if key in before and before[key] != value:  # a resume under ckpt_allow_changes: MLflow refuses a new value
                print(f"klbench: warning: the param {key} was {before[key]!r} when this run started and is {value!r} "
                      "now; MLflow keeps the first value")
                continue
            logger.client.log_param(logger.run_id, key, value)


def log_samples(logger, tables: list[tuple[int, list[dict]]], cfg: DictConfig) -> None:
    """One table of sample texts (prompt, response, reward, seq KL) per validation, with its step."""
    rows = [{"step": step, **row} for step, table in tables for row in table]
    if not rows:
        return
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    if isinstance(logger, RecordLogger):
        if logger.client is not None:
            logger.client.log_table(logger.run_id, data=columns, artifact_file="samples.json")
    else:
        import csv
        path = os.path.join(os.path.dirname(cfg.paths.ckpt_dir), "samples.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
