"""model.lora: one copy of the weights (pi_ref = the base with the adapter off, bit for bit), checkpoints that
hold the adapter only and resume exactly, a LoRA student in distillation, and the bad-input lines."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from klbench.config.schema import ConfigError, validate
from klbench.models.hf import load_causal_lm
from klbench.models.policies import LMPolicy, build_policy
from klbench.tasks.train import run_task
from test_config import compose_cfg


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_arch):
    """The session's tiny random Llama (RoPE, RMSNorm, GQA; tests/tiny_lms.py), saved with save_pretrained."""
    return tiny_arch("llama")[0]


@pytest.fixture(scope="module")
def tiny_llama_teacher_dir(tiny_arch):
    return tiny_arch("llama")[1]


def _lora_cfg(tmp_path, path, *extra):
    return compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={path}", "model.lora.r=4",
                                  "task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=8",
                                  "task.val_every=4", "task.log_every=1", *extra])


def test_reference_is_the_base_bit_for_bit_and_one_copy(tmp_path, tiny_llama_dir):
    cfg = _lora_cfg(tmp_path, tiny_llama_dir)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    trainable = dict((n, p) for n, p in policy.model.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    # one copy: every parameter the reference computes with is a policy parameter
    ids = {id(p) for p in policy.model.parameters()}
    assert all(id(p) in ids for p in policy.ref.parameters())
    with torch.no_grad():  # a trained adapter: B starts at zero, so move it
        for n, p in trainable.items():
            p.add_(0.5 * torch.randn_like(p))
    ro = policy.rollout(["the film was", "a slow"], 3)
    batch = policy.score(ro)
    base, tok = load_causal_lm(tiny_llama_dir)  # the base, loaded on its own, scores the same rollout
    # on the same scoring path as the policy's (model.scoring_path and model.logits_budget pick it)
    ref_logp = LMPolicy(base, base, tok, cfg.task.max_new_tokens, logits_budget=policy.logits_budget,
                        scoring_path=policy.scoring_path).score(ro).ref_logp
    m = batch.mask
    assert torch.equal(batch.ref_logp[m], ref_logp[m])  # pi_ref is the separately loaded base, bit for bit
    assert not torch.allclose(batch.logp[m], batch.ref_logp[m])  # and the policy is not


def test_checkpoint_holds_the_adapter_only_and_resumes_exactly(tmp_path, tiny_llama_dir):
    # naive_mc's per-sample noise moves the adapter off pi_ref (every sound KL gradient is zero at pi == pi_ref,
    # and the random model earns no reward), so that the resumed run has something to match
    moving = ["estimator=naive_mc", "estimator.beta=1.0", "logger=none"]
    straight = run_task(_lora_cfg(tmp_path / "a", tiny_llama_dir, "task.max_steps=8", *moving))
    run_task(_lora_cfg(tmp_path / "b", tiny_llama_dir, "task.max_steps=4", *moving))
    ckpt = torch.load(tmp_path / "b" / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    keys = [k for k in ckpt["state_dict"] if k.startswith("policy.")]
    assert keys and all("lora_" in k for k in keys), keys[:5]
    resumed = run_task(_lora_cfg(tmp_path / "b", tiny_llama_dir, "task.max_steps=8", *moving, "ckpt_path=last",
                            "ckpt_allow_changes=[task.max_steps]"))
    for key in ("val/seq_kl", "val/reward"):
        assert math.isclose(resumed[key], straight[key], rel_tol=1e-9), key
    assert straight["val/seq_kl"] > 0


def test_distill_with_a_lora_student(tmp_path, tiny_llama_dir, tiny_llama_teacher_dir):
    # the teacher is a separate model (another tiny Llama on the same tokenizer); the student trains its adapter
    cfg = compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator=loo", "estimator.beta=1.0", "model=hf",
                                 f"model.name_or_path={tiny_llama_dir}", "model.lora.r=4", "model@teacher=hf",
                                 f"teacher.name_or_path={tiny_llama_teacher_dir}", "task.max_steps=4", "task.val_every=2",
                                 "task.prompts_per_step=2", "task.val_prompts=4", "task.max_new_tokens=8",
                                 "logger=none"])
    validate(cfg)
    out = run_task(cfg)
    assert math.isfinite(out["val/seq_kl"]) and out["val/seq_kl"] > 0


@pytest.mark.parametrize("extra,starts", [
    (["model.lora.target_modules=[nonexistent_proj]"], "model.lora.target_modules"),
    (["model.lora.dropout=0.1"], "model.lora.dropout"),
])
def test_bad_lora_options_name_the_setting(tmp_path, tiny_llama_dir, extra, starts):
    cfg = _lora_cfg(tmp_path, tiny_llama_dir, *extra)
    with pytest.raises(ConfigError) as e:
        build_policy(cfg.model, cfg.task.max_new_tokens)
    assert str(e.value).startswith(starts), str(e.value)
    if "target_modules" in starts:
        assert "q_proj" in str(e.value)  # the names it found


def test_lora_rank_must_be_positive_and_teacher_has_none(tmp_path, tiny_llama_dir, tiny_lm_dir):
    with pytest.raises(ConfigError) as e:
        validate(_lora_cfg(tmp_path, tiny_llama_dir, "model.lora.r=0"))
    assert "model.lora.r" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, ["task=distill", "reward=none", "estimator.beta=1.0", "model@teacher=hf",
                                        f"teacher.name_or_path={tiny_lm_dir}", "teacher.lora.r=4"]))
    assert str(e.value).startswith("teacher.lora.r=4")


def test_prompt_order_is_the_shuffled_loaders_and_a_resume_continues_it():
    """EpochShuffle gives DataLoader(shuffle=True, generator=manual_seed(seed))'s batches as Lightning drew them
    (the same prompts in the same steps as before it existed), and started at step s it continues them."""
    from torch.utils.data import DataLoader

    from klbench.data.prompts import EpochShuffle
    n, bs, seed = 23, 4, 7
    old = DataLoader(list(range(n)), batch_size=bs, shuffle=True, drop_last=True, collate_fn=list,
                     generator=torch.Generator().manual_seed(seed))
    # Lightning stops each epoch at len(), leaving the iterator unfinished
    straight = [b for _ in range(3) for b in itertools.islice(iter(old), n // bs)]

    def batches(start, epochs):
        s = EpochShuffle(n, bs, seed, start)
        loader = DataLoader(list(range(n)), batch_size=bs, sampler=s, drop_last=True, collate_fn=list)
        out = []
        for e in range(start // (n // bs), epochs):
            s.set_epoch(e)
            out += list(itertools.islice(iter(loader), n // bs))
        return out
    assert batches(0, 3) == straight
    assert batches(7, 3) == straight[7:]  # a resume at step 7 (epoch 1, batch 2) draws what the run would have
