"""klbench-export (issue 42, item 3): a run's checkpointed policy as a save_pretrained folder that transformers
(and peft, for an adapter) loads and that scores a batch with the checkpointed policy's log-probs; its
tokenizer, chat template and a generation_config with the run's sampling beside it; one line for bad input,
nothing overwritten."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_config import compose_cfg

import cli_inprocess

from klbench.models.policies import LMPolicy
from klbench.record import resume
from klbench.tasks.export import export, load_policy
from klbench.tasks.train import run_task

RUN = ["task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=8", "task.max_steps=4",
       "task.val_every=4", "task.log_every=1", "task.temperature=0.7", "task.top_p=0.9",
       # naive_mc's per-sample noise moves the policy off pi_ref, so that a wrong export would show
       "estimator=naive_mc", "estimator.beta=1.0"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_arch):
    """A LoRA run on the tiny chat Llama (chat template, two stop ids), recorded in a real MLflow store."""
    tmp = tmp_path_factory.mktemp("lora_run")
    run_task(compose_cfg(tmp, ["model=hf", f"model.name_or_path={tiny_arch('llama')[0]}", "model.lora.r=4", *RUN]))
    return tmp / "run"


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_lm_dir):
    """The whole tiny GPT-2 trained (no LoRA)."""
    tmp = tmp_path_factory.mktemp("full_run")
    run_task(compose_cfg(tmp, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "logger=csv", *RUN]))
    return tmp / "run"


def checkpointed(run_dir: Path):
    """The checkpointed policy, loaded as task=probe loads it, and a rollout of it to score."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    cfg = OmegaConf.create(resume.load_payload(str(ckpt))["config"])
    policy, _ = load_policy(cfg, ckpt)
    torch.manual_seed(0)
    return policy, policy.rollout(["the film was", "a slow and quiet"], 3)


def logp(model, tok, ro, policy) -> torch.Tensor:
    """log pi_s of the rollout's response tokens under `model`, scored as `policy` scores (its sampling)."""
    with torch.no_grad():
        batch = LMPolicy(model, model, tok, 8, sampling=policy.sampling, eos_ids=policy.eos_ids).score(ro)
    return batch.logp[batch.mask]


def test_the_merged_export_loads_in_transformers_and_scores_as_the_checkpoint(lora_run, tiny_arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    out = export(str(lora_run))
    assert out == lora_run / "hf" and not (out / "adapter_config.json").exists()
    policy, ro = checkpointed(lora_run)
    with torch.no_grad():
        expected = policy.score(ro)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    got = logp(model, tok, ro, policy)
    want = expected.logp[expected.mask]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # merging W + BA rounds once per weight
    assert not torch.allclose(want, expected.ref_logp[expected.mask], atol=1e-3)  # the trained policy, not the base
    assert tok.chat_template == policy.tok.chat_template and tok.chat_template
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p, gen.max_new_tokens) == (True, 0.7, 0, 0.9, 8)
    assert gen.eos_token_id == list(policy.eos_ids) and len(policy.eos_ids) == 2  # both stop ids


def test_the_adapter_export_loads_in_peft_on_its_base_and_scores_as_the_checkpoint(lora_run, tiny_arch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    out = export(str(lora_run / "checkpoints" / "last.ckpt"), adapter=True)
    assert out == lora_run / "hf-adapter" and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter alone
    policy, ro = checkpointed(lora_run)
    base = AutoModelForCausalLM.from_pretrained(tiny_arch("llama")[0], local_files_only=True)
    model = PeftModel.from_pretrained(base, out)
    got = logp(model, AutoTokenizer.from_pretrained(out, local_files_only=True), ro, policy)
    with torch.no_grad():
        expected = policy.score(ro)
    assert torch.equal(got, expected.logp[expected.mask])  # the same modules, the same arithmetic
    assert GenerationConfig.from_pretrained(out).temperature == 0.7


def test_a_whole_model_export_scores_bit_for_bit(full_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = export(str(full_run), out=str(full_run.parent / "exported" / "gpt2"))
    policy, ro = checkpointed(full_run)
    with torch.no_grad():
        expected = policy.score(ro)
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logp(model, AutoTokenizer.from_pretrained(out, local_files_only=True), ro, policy),
                       expected.logp[expected.mask])


def test_the_end_block_names_the_command(lora_run, full_run, capsys):
    from klbench.console.messages import print_run_where
    cfg = OmegaConf.create(resume.load_payload(str(lora_run / "checkpoints" / "last.ckpt"))["config"])
    print_run_where(cfg, False)
    assert f"klbench: to export   klbench-export {lora_run}   (--adapter: the LoRA adapter alone)" in capsys.readouterr().out
    cfg.paths.ckpt_dir = str(full_run.parent / "elsewhere" / "checkpoints")  # no checkpoint there: no line
    print_run_where(cfg, False)
    assert "klbench-export" not in capsys.readouterr().out


def klbench_export(*args, cwd) -> str:
    proc = cli_inprocess.run(args, cwd=cwd, env=os.environ, main="klbench.tasks.export")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith("klbench-export: error: "), proc.stderr
    return proc.stderr.strip()


def test_bad_input_is_one_line_and_nothing_is_overwritten(tmp_path, full_run):
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "notes.txt").write_text("mine")
    assert "is not a klbench run folder" in klbench_export(tmp_path / "notarun", cwd=tmp_path)
    never = tmp_path / "never"  # a run stopped before its first validation: Hydra's files only
    (never / ".hydra").mkdir(parents=True)
    (never / ".hydra" / "config.yaml").write_text("seed: 0\n")
    assert "never checkpointed" in klbench_export(never, cwd=tmp_path)
    assert "no such file or folder" in klbench_export(tmp_path / "missing", cwd=tmp_path)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    line = klbench_export(full_run, "--out", target, cwd=tmp_path)
    assert line == f"klbench-export: error: {target} exists; klbench-export never overwrites: give --out a path " \
                   "that does not exist"
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and (target / "keep.txt").read_text() == "mine"
    assert "has no adapter" in klbench_export(full_run, "--adapter", "--out", tmp_path / "new", cwd=tmp_path)
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder left
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    assert "is not a klbench checkpoint" in klbench_export(junk, cwd=tmp_path)
