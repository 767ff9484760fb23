"""A two-rank `klbench` run as a real process (tests/test_ddp_resume.py, tests/test_fsdp.py): Lightning starts the
other rank itself, so these stay processes. The job: a tiny policy/reference pair on CPU, naive_mc at beta 1
(its noise moves the policy), a CSV record, validation every 2 steps."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def rank_args(tmp_path: Path, pair, hardware: str, prompts_per_step: int, *extra: str) -> list[str]:
    return [str(Path(sys.executable).with_name("klbench")), f"hardware={hardware}", "hardware.devices=2",
            "hardware.accelerator=cpu", "model=hf", f"model.name_or_path={pair[0]}",
            f"model.ref_name_or_path={pair[1]}", "estimator=naive_mc", "estimator.beta=1.0", "logger=csv",
            f"task.prompts_per_step={prompts_per_step}", "task.n_samples=2", "task.max_new_tokens=8",
            "task.val_prompts=4", "task.val_every=2", "task.log_every=1", f"paths.outputs={tmp_path / 'outputs'}",
            f"hydra.run.dir={tmp_path / 'run'}", *extra]


def rank_env(tmp_path: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "KLBENCH_OUTPUTS": str(tmp_path / "outputs")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def final_metrics(proc) -> dict[str, float]:
    """{val/<name>: value} of the run's closing summary lines."""
    lines = [line.split() for line in proc.stdout.splitlines() if line.startswith("val/")]
    return {parts[0]: float(parts[-1]) for parts in lines}
