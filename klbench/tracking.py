"""The `logger` group: MLflow (default), CSV or none; run naming, config logging, sample tables.

MLflow >= 3.13 refuses the ./mlruns file store, so the default store is SQLite under outputs/ with an
absolute artifact root. A resumed run continues the same MLflow run (its id is kept in the run folder).
"""
from __future__ import annotations

import os

from lightning.pytorch.loggers import CSVLogger, MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

RUN_ID_FILE = "mlflow_run_id.txt"


def run_name(cfg: DictConfig) -> str:
    est = cfg.estimator
    parts = [cfg.task.name, str(cfg.model.kind), est.name]
    if "lam" in est:
        parts.append(f"lam{est.lam:g}")
    if "level" in est and est.level == "sequence":
        parts.append("seqlevel")
    parts += [f"beta{est.beta:g}", f"seed{cfg.seed}"]
    return "-".join(parts)


def flat_params(cfg: DictConfig) -> dict[str, str]:
    """Resolved config flattened with '.' (estimator.name, estimator.beta, ...); MLflow caps values at 6000 chars."""
    out: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = str(node)[:6000]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str) -> str:
    """Create the store and the experiment once (SQLite schema migration races if many processes do it)."""
    import mlflow
    if tracking_uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(tracking_uri[len("sqlite:///"):]), exist_ok=True)
    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    os.makedirs(artifact_root, exist_ok=True)
    return client.create_experiment(name, artifact_location=f"file://{os.path.abspath(artifact_root)}/{name}")


def build_logger(cfg: DictConfig, resume: bool = False):
    lg = cfg.logger
    run_dir = os.path.dirname(cfg.paths.ckpt_dir)
    if lg.kind == "none":
        return False
    if lg.kind == "csv":
        return CSVLogger(save_dir=run_dir, name="csv", version="")
    if lg.kind != "mlflow":
        raise ValueError(f"logger.kind must be mlflow, csv or none; got {lg.kind!r}")
    if rank_zero_only.rank == 0:  # DDP children get a logger that Lightning keeps silent
        ensure_experiment(lg.tracking_uri, lg.experiment, lg.artifact_root)
    id_file = os.path.join(run_dir, RUN_ID_FILE)
    run_id = open(id_file).read().strip() if resume and os.path.isfile(id_file) else None
    tags = {"klbench.task": cfg.task.name, "klbench.estimator": cfg.estimator.name}
    if lg.get("parent_run_id"):
        tags["mlflow.parentRunId"] = lg.parent_run_id
    logger = MLFlowLogger(experiment_name=lg.experiment, run_name=lg.run_name or run_name(cfg),
                          tracking_uri=lg.tracking_uri, tags=tags, run_id=run_id)
    if run_id is None and rank_zero_only.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        with open(id_file, "w") as f:
            f.write(logger.run_id)
        logger.log_hyperparams(flat_params(cfg))
        logger.experiment.log_text(logger.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
    return logger


def log_samples(logger, tables: list[tuple[int, list[dict]]], cfg: DictConfig) -> None:
    """One table of sample texts (prompt, response, reward, seq KL) per validation, with its step."""
    rows = [{"step": step, **row} for step, table in tables for row in table]
    if not rows:
        return
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    if isinstance(logger, MLFlowLogger):
        logger.experiment.log_table(logger.run_id, data=columns, artifact_file="samples.json")
    else:
        import csv
        path = os.path.join(os.path.dirname(cfg.paths.ckpt_dir), "samples.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
