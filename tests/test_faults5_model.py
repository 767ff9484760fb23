"""Issue 50 (round 5), what a model or a batch size can break: non-finite logits at the first sampled token said
in one line naming the cause (item 12), a config.json's `logit_scale: "abc"` and task.prompts_per_step=1000000000
in one line (13), and temperatures at which the sampler is a point mass or uniform to float precision refused (15)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_config import compose_cfg
from test_sweeps import cli_env

import cli_inprocess

from klbench.config.schema import ConfigError, validate

RUN = ["model=hf", "task.prompts_per_step=2", "task.val_prompts=2", "task.max_new_tokens=4", "task.max_steps=1",
       "task.val_every=1", "logger=csv"]


def one_line(tmp_path, *args) -> str:
    proc = cli_inprocess.run([*RUN, *args], cwd=tmp_path, env=cli_env(tmp_path / "outputs"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc.stderr.strip()


def test_nan_weights_are_one_line_naming_the_weights(tmp_path, tiny_lm_dir):
    """Issue 50.12: a NaN lm_head entry gave a FloatingPointError of 65 to 107 lines."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path / "nan_lm"
    shutil.copytree(tiny_lm_dir, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight[:, 3] = float("nan")  # tied to wte in GPT-2: the input embedding too
    model.save_pretrained(folder)
    line = one_line(tmp_path, f"model.name_or_path={folder}")
    assert line.startswith("klbench: error: kv_cache_sample: non-finite logits at response step 0"), line
    assert "the model's weights hold NaN or inf (model.transformer.wte.weight" in line or \
        "the model's weights hold NaN or inf (transformer.wte.weight" in line, line


def test_the_cause_names_the_temperature_where_the_weights_are_finite(tiny_lm_dir):
    """Issue 50.12: task.temperature=1e-30 on an LM (now refused by the config, item 15; a folder's own sampling
    under model.generation_config=follow still reaches the rollout)."""
    from transformers import AutoModelForCausalLM

    from klbench.estimators.sampling import Sampling
    from klbench.models.nonfinite import nonfinite_cause
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dir)
    assert "task.temperature=1e-30 takes the logits / T out of float32's range" in \
        nonfinite_cause(model, Sampling(temperature=1e-30))
    assert "the model's forward made them" in nonfinite_cause(model, Sampling(temperature=0.7))


def test_a_logit_scale_that_is_no_number_is_one_line(tmp_path, tiny_lm_dir):
    """Issue 50.13: `logit_scale: "abc"` in config.json: 34 lines from read_head."""
    folder = tmp_path / "abc_lm"
    shutil.copytree(tiny_lm_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "logit_scale": "abc"}))
    line = one_line(tmp_path, f"model.name_or_path={folder}")
    assert line.startswith("klbench: error: logit_scale='abc' in ") and "config.json" in line, line


def test_a_batch_too_large_for_memory_is_one_line(tmp_path):
    """Issue 50.13: task.prompts_per_step=1000000000 was a 23-line MemoryError. 1e17 here: the same MemoryError
    at once, where 1e9 first fills 8 GB of a shared machine."""
    proc = cli_inprocess.run(["experiment=tabular", "task.prompts_per_step=100000000000000000", "task.max_steps=1"],
                             cwd=tmp_path, env=cli_env(tmp_path / "outputs"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("klbench: error: out of memory building or running the run "
                                  "(task.prompts_per_step=100000000000000000, ")


@pytest.mark.parametrize("temperature", ["1e-30", "1e-9", "1e30", "2e9"])
def test_a_temperature_at_which_the_sampler_is_degenerate_is_refused(tmp_path, temperature):
    """Issue 50.15: task.temperature=1e-30 (tabular) and 1e30 (LM) finished with loss 0 and every KL 0."""
    for base in (["experiment=tabular"], ["model=hf", "model.name_or_path=x"]):
        with pytest.raises(ConfigError) as e:
            validate(compose_cfg(tmp_path, [*base, f"task.temperature={temperature}"]))
        said = str(e.value)
        assert said.startswith("task.temperature must be a finite number > 0, within [1e-08, 1e+09]") and \
            "point mass to float precision" in said and "\n" not in said, said
    for fine in ("1e-8", "1e-3", "100", "1e9"):
        validate(compose_cfg(tmp_path, ["experiment=tabular", f"task.temperature={fine}"]))
