"""`klbench`: the Hydra entry point. Returns (val/reward, val/seq_kl) for the Optuna sweeper.

The config is checked (klbench.schema) before torch, Lightning or MLflow are imported, so a bad value
fails in about a second, leaves no MLflow run and no run folder.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from klbench import rundir, store
from klbench.embedded.cache import cache_dir

ROOT = Path(__file__).resolve().parent.parent
# conf/config.yaml puts ${klbench_root:}/sweeps on Hydra's search path wherever klbench is run from
OmegaConf.register_resolver("klbench_root", lambda: str(ROOT), replace=True)
# the sweep group's options, for `klbench --help` (conf/config.yaml, hydra.help.template)
OmegaConf.register_resolver("klbench_sweeps", lambda: ", ".join(sorted(p.stem for p in (ROOT / "sweeps" / "sweep")
                                                                      .glob("*.yaml"))), replace=True)
# one place (klbench.store) decides where the record lives, for runs, sweeps and klbench-pareto alike
OmegaConf.register_resolver("klbench_outputs", lambda: str(store.outputs_dir()), replace=True)
OmegaConf.register_resolver("klbench_tracking_uri", store.tracking_uri, replace=True)
# run and sweep folders that no other process shares (klbench/rundir.py); cached, like Hydra's `now`
OmegaConf.register_resolver("klbench_claim", rundir.claim, use_cache=True, replace=True)
# the per-user cache of embedded models (klbench.embedded.cache), shared by every outputs folder
OmegaConf.register_resolver("klbench_cache", lambda: str(cache_dir()), replace=True)


@hydra.main(config_path=str(ROOT / "conf"), config_name="config",
            execution_whitelist=("klbench.*",))
def main(cfg: DictConfig) -> tuple[float, float] | None:
    try:
        check(cfg)
    except ValueError as e:
        _discard_run_folder(Path(str(OmegaConf.select(cfg, "paths.outputs", default="") or "/")))
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # fails this trial only; the sweep records it and goes on
        sys.exit(f"klbench: error: {e}")
    from klbench.resume import ResumeError
    from klbench.train import run
    try:
        metrics = run(cfg)
    except ResumeError as e:  # said in one line: the checkpoint, and what to do instead
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise
        sys.exit(f"klbench: error: {e}")
    if cfg.task.name in ("pretrain", "probe"):
        return None
    return metrics["val/reward"], metrics["val/seq_kl"]


def check(cfg: DictConfig) -> None:
    """Everything that can be told from the config alone (no torch, no MLflow)."""
    from klbench.schema import ConfigError, validate
    hc = HydraConfig.get()
    sweep = hc.runtime.choices.get("sweep")
    if sweep and hc.mode != RunMode.MULTIRUN:
        raise ConfigError(f"sweep={sweep} is a sweep: run it with -m (klbench -m sweep={sweep} ...); "
                         "without -m it would be a single run filed under the sweep's experiment")
    validate(cfg)


def _discard_run_folder(outputs: Path) -> None:
    """A run stopped by its config leaves nothing behind: Hydra made its folder (and the empty folders
    above it, up to the outputs folder) before calling us, and it holds only Hydra's own files."""
    out = Path(HydraConfig.get().runtime.output_dir).resolve()
    if not (out.is_dir() and all(p.name in (".hydra", "klbench.log") for p in out.iterdir())):
        return
    shutil.rmtree(out, ignore_errors=True)
    outputs = outputs.resolve()
    for parent in out.parents:  # the empty date folders Hydra made, and outputs/ itself if now empty
        if parent != outputs and outputs not in parent.parents:
            break
        try:
            parent.rmdir()
        except OSError:  # not empty: other runs live here
            break


if __name__ == "__main__":
    main()
