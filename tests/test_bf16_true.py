"""hardware=bf16_true: bfloat16 weights through Lightning's bf16-true; refused in one line on a GPU without bf16."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.tasks.train import check_config, run_task
from test_config import compose_cfg

pytestmark = pytest.mark.usefixtures("single_thread")


def test_bf16_true_is_refused_on_a_gpu_without_bfloat16(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla T4")
    with pytest.raises(ValueError, match=r"hardware.precision=bf16-true \(hardware=bf16 or bf16_true\) but this GPU "
                                         r"\(Tesla T4\) does not support bfloat16: use hardware=gpu"):
        check_config(compose_cfg(tmp_path, ["hardware=bf16_true"]))


def test_a_bf16_true_run_trains_from_hidden_states(tmp_path, tiny_arch, capsys):
    path, ref = tiny_arch("llama")
    out = run_task(compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", f"model.ref_name_or_path={ref}",
                                     "hardware=bf16_true", "task.max_steps=2", "task.val_every=2",
                                     "task.prompts_per_step=2", "task.n_samples=2", "task.max_new_tokens=6",
                                     "task.val_prompts=2", "logger=csv", "estimator=rb",
                                     "model.scoring_path=hidden"]))
    assert math.isfinite(out["val/seq_kl"]) and out["val/seq_kl"] > 0
    assert "klbench: scoring from final hidden states" in capsys.readouterr().out
