"""The architectures instruct models ship in (tiny random Llama, Qwen2, Qwen3, Gemma2, Gemma3 text, Mistral, Phi3,
built by tests/tiny_lms.py into the session's cache). For each: the rollout engine draws generate()'s tokens (at
T = 1 and at T = 0.7 with top-p 0.9, with the folder's two stop ids), scoring gives a plain forward's log-probs,
bf16 log-probs agree between sampler and scorer with eager attention, and a short RL run (on chat-templated
prompts) and a distillation run train."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.estimators.sampling import Sampling
from klbench.models.hf import generation_defaults, load_causal_lm
from klbench.models.policies import LMPolicy
from klbench.models.rollout import PLAIN, generate_sample, kv_cache_sample
from test_config import compose_cfg
from tiny_lms import ARCHITECTURES

ARCHS = list(ARCHITECTURES)
# prompts of different lengths: left-padded; with 24 new tokens a sequence outgrows the sliding window of 8
PROMPTS = ["The movie", "I did not like it at all, the plot was thin"]


@pytest.mark.parametrize("sampling", [PLAIN, Sampling(0.7, 0, 0.9)], ids=["T1", "T0.7-p0.9"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollout_is_generate_token_for_token(arch, sampling, tiny_arch, single_thread):
    """Under one seed: the same tokens as generate(do_sample=True, temperature=, top_p=) with the folder's stop-id
    list (</s> and <|im_end|>), and the same RNG state after."""
    model, tok = load_causal_lm(tiny_arch(arch)[0])
    stops = generation_defaults(model)[0]
    assert len(stops) == 2
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, attn = enc.input_ids.repeat_interleave(4, 0), enc.attention_mask.repeat_interleave(4, 0)  # [8, P]
    assert (attn == 0).any(), "the prompts must be left-padded"
    for seed in range(2):
        torch.manual_seed(seed)
        ref = generate_sample(model, ids, attn, 24, stops, tok.pad_token_id, sampling).tokens  # [8, <= 24]
        after_ref = torch.rand(4)
        torch.manual_seed(seed)
        got = kv_cache_sample(model, ids, attn, 24, stops, tok.pad_token_id, sampling).tokens
        assert torch.equal(got, ref), arch
        assert torch.equal(torch.rand(4), after_ref)
        assert len(set(got[:, 0].tolist())) > 1  # samples, not one repeated token


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_is_a_plain_forward(arch, tiny_arch, single_thread):
    """LMPolicy.score's log-probs (one left-padded batch, positions from the mask) are those of each sequence
    alone, unpadded, through the model's forward and log_softmax: padding and positions change nothing."""
    model, tok = load_causal_lm(tiny_arch(arch)[0])
    ref, _ = load_causal_lm(tiny_arch(arch)[1])
    policy = LMPolicy(model, ref, tok, max_new_tokens=32)
    for seed in range(20):  # the first seed under which some row ends (EOS) before the others: pads after it
        torch.manual_seed(seed)
        ro = policy.rollout(PROMPTS, 8)
        if (~ro.mask).any():
            break
    assert (~ro.mask).any(), "no row ended early"
    batch = policy.score(ro)
    P = ro.prompt_len
    for i in range(ro.tokens.shape[0]):
        real = ro.attention[i].bool()  # the row's prompt without its left pads, then its response up to EOS
        seq = ro.tokens[i][real][None]  # [1, n]
        n_resp = int(ro.mask[i].sum())
        for m, got in ((model, batch.logp[i]), (ref, batch.ref_logp[i])):
            with torch.no_grad():
                logp = torch.log_softmax(m(input_ids=seq).logits.float(), -1)[0]  # [n, V]
            want = logp[:-1].gather(-1, seq[0, 1:, None]).squeeze(-1)[-n_resp:]  # [n_resp] the response tokens'
            torch.testing.assert_close(got[:n_resp].detach(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(ro.tokens[:, P:][~ro.mask], torch.full_like(ro.tokens[:, P:][~ro.mask], tok.pad_token_id))


def _short_run(tmp_path, *overrides):
    from klbench.tasks.train import run_task
    cfg = compose_cfg(tmp_path, ["model=hf", "logger=none", "task.max_steps=2", "task.val_every=2",
                                 "task.prompts_per_step=2", "task.n_samples=2", "task.val_prompts=2",
                                 "task.max_new_tokens=8", *overrides])
    return run_task(cfg)


@pytest.mark.parametrize("arch", ARCHS)
def test_short_rl_and_distill_runs(arch, tiny_arch, tmp_path, single_thread):
    student, teacher = tiny_arch(arch)
    rl = _short_run(tmp_path / "rl", f"model.name_or_path={student}", "dataset.chat_template=true",
                    "dataset.system_prompt=Write a review.")
    assert all(math.isfinite(v) for v in rl.values()) and rl["val/response_len"] > 0
    distill = _short_run(tmp_path / "distill", "task=distill", "reward=none", "estimator.beta=1.0",
                         f"model.name_or_path={student}", "model@teacher=hf", f"teacher.name_or_path={teacher}")
    assert distill["val/seq_kl"] > 0.5  # two differently initialised models: a clearly positive KL


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_sampler_and_scorer_agree_with_eager_attention(arch, tiny_arch, single_thread):
    """In bfloat16 the sampler's log-probs (one query per step over the KV cache) and the scoring pass's (one
    forward over prompt + response) agree to float32 rounding with model.attn_implementation=eager; with SDPA
    they differ by hundredths of a nat (docs/instruct.md, "Sampler and scorer"). Gemma2 has no SDPA."""
    gaps = {}
    for attn in ("eager", "sdpa") if arch != "gemma2" else ("eager",):
        model, tok = load_causal_lm(tiny_arch(arch)[0], "bfloat16", attn_implementation=attn)
        policy = LMPolicy(model, model, tok, max_new_tokens=32)
        torch.manual_seed(0)
        ro = policy.rollout(PROMPTS, 4)
        with torch.no_grad():
            gaps[attn] = float((ro.sampled_logp - policy.score(ro).logp).abs()[ro.mask].max())
    assert gaps["eager"] < 1e-5, gaps
    if "sdpa" in gaps:
        assert gaps["sdpa"] > 1e-3, gaps  # the reason eager is the setting to use in bf16
