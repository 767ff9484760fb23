"""The config a `klbench` command line runs with, composed outside a run: for tests and docs scripts.

    compose(overrides=(), outputs=None, run_dir=None, hydra=False, multirun=False) -> DictConfig

The one place, besides the `klbench` entry point itself, that sets Hydra up.
"""
from __future__ import annotations

from pathlib import Path

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from klbench.config.choices import named_options, refuse_unknown_options
from klbench.config.resolvers import ROOT, register


def compose(overrides=(), outputs: str | Path | None = None, run_dir: str | Path | None = None,
            hydra: bool = False, multirun: bool = False) -> DictConfig:
    """conf/config.yaml with `overrides` (strings as on the command line), as `klbench` composes it; an
    option that is no config of its group raises ConfigError, as `klbench` refuses it (config/choices.py).

    outputs: a folder in place of paths.outputs ($KLBENCH_OUTPUTS or ./outputs), so that the MLflow
        and Optuna stores and the artifacts that follow it land there (unless $MLFLOW_TRACKING_URI is
        set).
    run_dir: the run folder, in place of Hydra's, which exists only in a run: paths.ckpt_dir becomes
        <run_dir>/checkpoints (default with `outputs`: <outputs>/run).
    hydra: keep the `hydra` node and make it the current HydraConfig, as a run does, so that
        ${hydra:...} interpolations and the sweeper and launcher settings can be read.
    multirun: as `klbench -m` composes the sweep's own config: sweeps over values (`seed=0,1`) are kept
        in hydra.overrides and not applied, and the check covers each of their values.
    """
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), job_name="klbench"):
        # hydra.compose() as a run composes: the repository it read stays active for the check below
        cfg = GlobalHydra.instance().hydra.compose_config(
            "config", overrides=list(overrides), run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN,
            from_shell=False, activate_config_repository=True)
        # what the CLI's callback checks before a run or sweep starts
        refuse_unknown_options(named_options(cfg.hydra.overrides, OmegaConf.select(cfg, "hydra.sweeper.params")),
                               "config")
    if not hydra:
        with open_dict(cfg):
            del cfg["hydra"]
    if run_dir is None and outputs is not None:
        run_dir = Path(outputs) / "run"
    with open_dict(cfg):
        if outputs is not None:
            cfg.paths.outputs = str(Path(outputs).resolve())
        if run_dir is not None:
            cfg.paths.ckpt_dir = str(Path(run_dir).resolve() / "checkpoints")
    if hydra:
        HydraConfig.instance().set_config(cfg)
    return cfg
