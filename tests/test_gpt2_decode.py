"""klbench's own GPT-2 decode step (klbench/models/gpt2_decode.py, back for issue 54): the model's forward's logits,
bit for bit, at every step, float32 and bfloat16, padded or not, under head_precision's float32 head too; the same
rollout tokens as the forward; anything it does not mirror keeps the forward."""
import copy

import pytest
import torch

from klbench.models.gpt2_decode import gpt2_decoder, unsupported
from klbench.models.head import head_precision
from klbench.models.hf import load_causal_lm
from klbench.models.rollout import kv_cache_sample, position_ids_from_mask

PROMPTS = ["The movie", "I did not like it", "A"]  # of different lengths: the batch is left-padded
pytestmark = pytest.mark.usefixtures("single_thread")


def _batch(tok, n=2):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return enc.input_ids.repeat_interleave(n, 0), enc.attention_mask.repeat_interleave(n, 0)  # [B, P]


def decode_matches_forward(model, ids, attn, steps: int = 12, head_dtype=None):
    """Over one prefill of ids/attn ([B, P]), decode `steps` random tokens through the fork and through model(...):
    the same logits, bit for bit, at each step (a wider buffer than the steps need: attention reads only the
    positions filled)."""
    pos = position_ids_from_mask(attn)
    mask = attn if bool((attn == 0).any()) else None  # nothing padded: no mask, as the sampler passes
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(), head_precision(model, head_dtype):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        step = gpt2_decoder(model, copy.deepcopy(out.cache), mask, ids.shape[1] + 40)
        assert step is not None
        cache, p = out.cache, pos[:, -1]
        for _ in range(steps):
            t = torch.randint(0, model.config.vocab_size, (ids.shape[0],), generator=gen)
            p = p + 1
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(len(mask), 1)], 1)
            ref = model(input_ids=t[:, None], cache=cache, attention_mask=mask, position_ids=p[:, None],
                        use_cache=True, logits_to_keep=1)
            cache = ref.cache
            got = step(t, p)
            assert got.dtype == ref.logits.dtype and torch.equal(got, ref.logits[:, -1])


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_step_gives_the_forward_bits(tiny_lm_dir, dtype, padded):
    model, tok = load_causal_lm(tiny_lm_dir, dtype)
    ids, attn = _batch(tok)
    if not padded:
        ids, attn = ids[:, -1:], attn[:, -1:]  # one token per prompt: nothing padded, no mask
    decode_matches_forward(model, ids, attn)


def test_the_step_runs_the_heads_precision(tiny_lm_dir):
    """bf16 weights with model.head_dtype=float32 (head_precision replaces the head's forward): the fork calls the
    head module, so it gets the float32 product the forward gets."""
    model, tok = load_causal_lm(tiny_lm_dir, "bfloat16")
    decode_matches_forward(model, *_batch(tok), head_dtype=torch.float32)


def test_rollouts_draw_the_forwards_tokens(tiny_lm_dir):
    model, tok = load_causal_lm(tiny_lm_dir)
    ids, attn = _batch(tok, n=4)
    got = []
    for fused in (True, False):
        torch.manual_seed(3)
        s = kv_cache_sample(model, ids, attn, 20, eos_ids=-1, pad_id=tok.pad_token_id, fused=fused)
        got.append((s.tokens, s.logp, torch.rand(3)))  # and the RNG state after
    (a, la, ra), (b, lb, rb) = got
    assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(ra, rb)


def test_only_a_plain_gpt2_takes_the_step(tiny_lm_dir, tiny_arch):
    from transformers import AutoModelForCausalLM
    eager = AutoModelForCausalLM.from_pretrained(tiny_lm_dir, attn_implementation="eager")
    assert "eager" in unsupported(eager)
    assert gpt2_decoder(eager, None, None, 8) is None
    wrapped, _ = load_causal_lm(tiny_lm_dir)
    assert unsupported(wrapped) is None
    wrapped.transformer.h[0].mlp.c_fc = torch.nn.Linear(4, 4)  # what an adapter library does to a layer
    assert "block 0" in unsupported(wrapped)
    llama, _ = load_causal_lm(tiny_arch("llama")[0])
    assert "is not GPT2LMHeadModel" in unsupported(llama)
