"""`klbench`: the Hydra entry point. Returns (val/reward, val/seq_kl) for the Optuna sweeper."""
from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent
# conf/config.yaml puts ${klbench_root:}/sweeps on Hydra's search path wherever klbench is run from
OmegaConf.register_resolver("klbench_root", lambda: str(ROOT), replace=True)


@hydra.main(config_path=str(ROOT / "conf"), config_name="config",
            execution_whitelist=("klbench.*",))
def main(cfg: DictConfig) -> tuple[float, float] | None:
    from klbench.train import run
    metrics = run(cfg)
    if cfg.task.name == "pretrain":
        return None
    return metrics["val/reward"], metrics["val/seq_kl"]


if __name__ == "__main__":
    main()
