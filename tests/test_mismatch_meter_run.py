"""A run logs the mismatch meter (train/mismatch_*, klbench.estimators.mismatch) beside train/logp_gap_*, and its end
says so when the sampler and the scorer disagree; a behaviour tensor of the wrong shape is one line."""
from __future__ import annotations

import pytest
import torch

import klbench.tasks.rl_metrics as rl_metrics
from klbench.estimators.sampling import Sampling, target_batch
from klbench.tasks.train import run_task
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")


def test_a_run_logs_the_meter_and_names_a_large_mismatch(tmp_path, tiny_arch, capsys, monkeypatch):
    path, ref = tiny_arch("llama")
    common = ["model=hf", f"model.name_or_path={path}", f"model.ref_name_or_path={ref}", "task.max_steps=2",
              "task.val_every=2", "task.prompts_per_step=2", "task.n_samples=2", "task.max_new_tokens=6",
              "task.val_prompts=2", "task.log_every=1", "logger=csv"]
    run_task(compose_cfg(tmp_path / "a", common))
    assert "the sampler and the scorer disagree" not in capsys.readouterr().out  # float32 on a CPU: ~1e-7
    monkeypatch.setattr(rl_metrics, "MISMATCH_CHI2_LARGE", -1.0)  # any logged chi^2 is "large": the line must name it
    run_task(compose_cfg(tmp_path / "b", common))
    out = capsys.readouterr().out
    assert "klbench: the sampler and the scorer disagree: train/mismatch_chi2 " in out
    metrics = (next((tmp_path / "b").rglob("metrics.csv"))).read_text().splitlines()[0].split(",")
    assert {"train/mismatch_k1", "train/mismatch_k3", "train/mismatch_chi2"} <= set(metrics)


def test_behaviour_logprobs_of_the_wrong_shape_are_one_line():
    logits, mask = torch.randn(2, 3, 5), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"the behaviour log-probs have shape \(2, 4\), the batch's mask \(2, 3\)"):
        target_batch(logits, logits, torch.zeros(2, 3, dtype=torch.long), mask, Sampling(0.7), "model",
                     behaviour_logp=torch.zeros(2, 4))
