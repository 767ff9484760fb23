"""Typos in every group and key get klbench's one line (issue 42, item 6), from the `klbench` command (run in
this process; the two timed refusals in a real one).

Hydra refused an unknown option of a required group (`estimator=rbb`) with its own 26-line block, and an
unknown key (`task.max_step=20`) with the advice to add it as `+task.max_step=20`, a key nothing reads. Now
klbench.cli.main tells both in one line (klbench.config.choices.explain_composition_error). A model folder
that does not exist and a LoRA target that names no module are refused before any model loads
(klbench.config.model_checks), in under 5 s.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import cli_inprocess
from test_sweeps import cli_env
from test_unknown_options import GROUPS


def klbench(tmp_path, *overrides: str, process: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI in this process (tests/cli_inprocess.py), or with `process` a real one: the refusals timed
    below include Python's start and klbench's imports."""
    outputs = tmp_path / "outputs"
    t0 = time.time()
    if not process:
        return cli_inprocess.run(overrides, cwd=tmp_path, env=cli_env(outputs)), time.time() - t0
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", *overrides], cwd=tmp_path, env=cli_env(outputs),
                          capture_output=True, text=True, timeout=120)
    return proc, time.time() - t0


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("klbench: error: "), proc.stderr
    assert "+" not in proc.stderr and "Hydra" not in proc.stderr, proc.stderr
    return proc.stderr[len("klbench: error: "):].strip()


# every group the defaults list requires (Hydra refused these itself); the optional ones (experiment, sweep,
# model@teacher) have their own test in test_unknown_options.py
@pytest.mark.parametrize("key", ["task", "estimator", "kl_ctl", "model", "dataset", "reward", "hardware", "logger",
                                 "store", "hydra/launcher"])
def test_an_unknown_option_of_any_group_is_one_line_with_the_valid_names(tmp_path, key):
    proc, _ = klbench(tmp_path, f"{key}=typo")
    line = one_line(proc)
    assert line.startswith(f"{key}=typo is unknown; valid: "), line
    valid = line.split("valid: ")[1].split(", ")
    assert set(GROUPS[key]) <= set(valid), line  # hydra/launcher: the plugins' launchers too
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("overrides,line", [
    (["task.max_step=20"], "task.max_step is no key of task=rl; did you mean task.max_steps?"),
    (["-m", "task.max_step=10,20"], "task.max_step is no key of task=rl; did you mean task.max_steps?"),
    (["model=hf", "model.lora.rr=4"], "model.lora.rr is no key of model.lora; did you mean model.lora.r?"),
    (["estimatr=rb"], "estimatr is no key of the config; did you mean estimator?"),
    # a key of another option of the group: the line says which has it
    (["kl_ctl.target=2"], "kl_ctl.target is no key of kl_ctl=fixed; its keys: name; kl_ctl=adaptive has it"),
])
def test_an_unknown_key_gets_the_nearest_valid_key_and_no_plus_advice(tmp_path, overrides, line):
    proc, _ = klbench(tmp_path, *overrides)
    assert one_line(proc) == line
    if "-m" not in overrides:  # a sweep's values are composed per trial, after Hydra wrote multirun.yaml
        assert not (tmp_path / "outputs").exists()


def test_what_klbench_cannot_tell_better_is_still_hydras(tmp_path):
    """An override Hydra cannot parse is no typo of a name: Hydra's own report stands."""
    proc, _ = klbench(tmp_path, "task.max_steps=[1")
    assert proc.returncode == 1 and "klbench: error" not in proc.stderr and "max_steps" in proc.stderr


def test_a_missing_model_folder_is_refused_before_anything_loads(tmp_path):
    proc, took = klbench(tmp_path, "model=hf", f"model.name_or_path={tmp_path}/no/such/folder", "logger=none",
                         process=True)
    assert one_line(proc).startswith(f"model.name_or_path: local path '{tmp_path}/no/such/folder' does not exist")
    assert took < 5, took


def test_a_folder_without_a_model_names_the_setting(tmp_path):
    (tmp_path / "empty").mkdir()
    proc, _ = klbench(tmp_path, "model=hf", f"model.name_or_path={tmp_path}/empty", "logger=none")
    assert one_line(proc) == (f"model.name_or_path: the folder {tmp_path}/empty is empty: no config.json; give a "
                              "folder written by save_pretrained (model and tokenizer)")


def test_a_lora_target_no_module_has_is_refused_before_the_model_loads(tmp_path, tiny_arch):
    path = tiny_arch("llama")[0]
    proc, took = klbench(tmp_path, "model=hf", f"model.name_or_path={path}", "model.lora.r=4",
                         "model.lora.target_modules=[q_proj,v_projj]", "logger=none", process=True)
    assert one_line(proc) == (f"model.lora.target_modules=['q_proj', 'v_projj']: v_projj names no module of {path}; "
                              "its modules with a weight matrix are named ['down_proj', 'embed_tokens', 'gate_proj', "
                              "'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']")
    assert "Seed set" not in proc.stdout + proc.stderr  # refused before the run began
    assert took < 5, took


def test_a_tied_output_layer_is_a_target_though_the_file_leaves_it_out(tiny_lm_dir):
    """GPT-2 ties lm_head to wte, so save_pretrained leaves lm_head out of model.safetensors: the check then
    asks the architecture itself (meta device), and a real name is never refused."""
    from klbench.config.errors import ConfigError
    from klbench.config.model_checks import check_lora_targets, saved_matrices
    assert not any(n.endswith("lm_head") for n in saved_matrices(tiny_lm_dir))
    check_lora_targets(tiny_lm_dir, ["c_attn", "lm_head"], False)
    with pytest.raises(ConfigError, match=r"c_atn names no module of .*'c_attn', 'c_fc', 'c_proj', 'lm_head'"):
        check_lora_targets(tiny_lm_dir, ["c_atn"], False)
