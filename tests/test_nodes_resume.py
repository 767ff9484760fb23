"""A run resumes on the number of nodes it was saved on (issue 52): another hardware.num_nodes at resume is refused
in one line, before anything is built, and the run's record stays as it was (klbench.record.resume.check_nodes)."""
from __future__ import annotations

import os
from pathlib import Path

import cli_inprocess

RUN = ["experiment=tabular", "estimator=rb", "hardware=cpu", "task.val_every=5", "logger=mlflow"]


def _klbench(tmp_path: Path, *args: str):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KLBENCH_OUTPUTS": str(tmp_path / "outputs")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return cli_inprocess.run([*RUN, f"hydra.run.dir={tmp_path / 'run'}", *args], cwd=tmp_path, env=env)


def test_another_node_count_at_resume_is_refused_and_the_run_is_unchanged(tmp_path):
    from mlflow import MlflowClient
    first = _klbench(tmp_path, "task.max_steps=10")
    assert first.returncode == 0, first.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}")
    run_id = (tmp_path / "run" / "mlflow_run_id.txt").read_text().strip()
    before = client.get_run(run_id)
    history = [(m.step, m.value) for m in client.get_metric_history(run_id, "val/reward")]
    ckpt = (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes()

    again = _klbench(tmp_path, "task.max_steps=20", "ckpt_path=last", "ckpt_allow_changes=[task.max_steps]",
                     "hardware.num_nodes=2")
    said = [line for line in (again.stdout + again.stderr).splitlines() if "hardware.num_nodes" in line]
    assert again.returncode != 0 and len(said) == 1, again.stdout[-2000:] + again.stderr[-3000:]
    assert "was saved by a run on hardware.num_nodes=1 and this one asks for 2" in said[0]
    after = client.get_run(run_id)
    assert after.info.status == before.info.status == "FINISHED"
    assert after.data.metrics == before.data.metrics and after.data.tags == before.data.tags
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/reward")] == history
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").read_bytes() == ckpt


def test_a_node_count_that_does_not_divide_the_global_batch_names_both(tmp_path):
    """hardware=fsdp splits task.prompts_per_step over hardware.devices x hardware.num_nodes ranks (under hardware=ddp
    it is per rank, so every node count divides the global batch)."""
    import pytest

    from klbench.config.schema import ConfigError, validate
    from test_config import compose_cfg
    cfg = compose_cfg(tmp_path, ["hardware=fsdp", "hardware.devices=1", "hardware.num_nodes=3", "model=hf",
                                 "model.name_or_path=x", "task.prompts_per_step=4"])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    said = str(e.value)
    assert "\n" not in said and "task.prompts_per_step=4" in said and "hardware.num_nodes = 3 ranks" in said
    validate(compose_cfg(tmp_path, ["hardware=ddp", "hardware.devices=1", "hardware.num_nodes=3",
                                    "task.prompts_per_step=4"]))
