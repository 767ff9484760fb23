"""klbench's decode step for rotary decoders (klbench/models/rotary_decode.py) against the model's own forward:
the same logits, bit for bit, at every step, for each architecture it takes (tiny random Llama, Qwen2, Qwen3 and
a Mistral whose window covers the rollout), float32 and bfloat16, padded or not, and with a LoRA adapter on and
off; every other architecture keeps the forward and is told why."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from klbench.models.hf import load_causal_lm
from klbench.models.rollout import kv_cache_sample
from klbench.models.rotary_decode import rotary_decoder, unsupported
from test_rollout import decode_matches_forward

PROMPTS = ["The movie", "I did not like it at all, the plot was thin"]


@pytest.fixture(scope="module")
def wide_mistral(tiny_arch, tmp_path_factory):
    """The tiny Mistral with a sliding window of 128 positions instead of 8: wider than any rollout here."""
    import transformers
    model, tok = load_causal_lm(tiny_arch("mistral")[0])
    config = copy.deepcopy(model.config)
    config.sliding_window = 128
    path = tmp_path_factory.mktemp("mistral-wide")
    wide = transformers.MistralForCausalLM(config)
    wide.load_state_dict(model.state_dict())
    wide.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _folder(arch, tiny_arch, wide_mistral):
    return wide_mistral if arch == "mistral" else tiny_arch(arch)[0]


def _steps_agree(model, tok, padded: bool, lora_off: bool = False, device: str = "cpu"):
    """The step's logits against model(...)'s at each of 12 steps over one prefill of PROMPTS (padded) or of their
    last 3 tokens (nothing padded), on `device`; lora_off: with the peft adapter disabled."""
    model.to(device)
    enc = tok(PROMPTS, return_tensors="pt", padding=True).to(device)
    ids, attn = enc.input_ids, enc.attention_mask
    if not padded:
        ids, attn = ids[:, -3:], attn[:, -3:]
    assert bool((attn == 0).any()) == padded
    assert unsupported(model, ids.shape[1] + 40) is None
    with model.disable_adapter() if lora_off else contextlib.nullcontext():
        decode_matches_forward(model, rotary_decoder, ids, attn)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_step_gives_the_forward_bits(arch, dtype, padded, tiny_arch, wide_mistral, single_thread):
    model, tok = load_causal_lm(_folder(arch, tiny_arch, wide_mistral), dtype)
    _steps_agree(model, tok, padded)


@pytest.mark.parametrize("adapter", ["on", "off"])
def test_step_gives_the_forward_bits_with_lora(adapter, tiny_arch, single_thread):
    """A LoRA policy decodes through the same step: its projections are peft's modules, called as the forward
    calls them; with the adapter disabled (the reference) the base's bits."""
    from klbench.models.lora import add_lora
    model, tok = load_causal_lm(tiny_arch("llama")[0])
    model = add_lora(model, r=4, alpha=8, dropout=0.0, target_modules=None)
    with torch.no_grad():  # a trained adapter: peft initialises B at zero, which would make it the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    _steps_agree(model, tok, padded=True, lora_off=adapter == "off")


@pytest.mark.parametrize("arch,why", [("gemma2", "is not one of"), ("gemma3", "is not one of"),
                                      ("phi3", "is not one of"), ("mistral", "sliding window of 8")])
def test_other_models_keep_the_forward_and_say_why(arch, why, tiny_arch):
    model, _ = load_causal_lm(tiny_arch(arch)[0])
    assert why in unsupported(model, 40)
    assert rotary_decoder(model, None, None, 40) is None


def test_prompt_learning_adapters_keep_the_forward(tiny_arch):
    """A prefix-tuning adapter adds virtual keys and values in the forward, which the step would miss."""
    import peft
    model, _ = load_causal_lm(tiny_arch("llama")[0])
    prefixed = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert "PrefixTuningConfig adapter" in unsupported(prefixed, 40)


def test_eager_attention_and_rewired_layers_keep_the_forward(tiny_arch):
    from transformers import AutoModelForCausalLM
    eager = AutoModelForCausalLM.from_pretrained(tiny_arch("llama")[0], attn_implementation="eager")
    assert "'eager'" in unsupported(eager, 40)
    model, _ = load_causal_lm(tiny_arch("llama")[0])
    model.model.layers[1].extra = torch.nn.Identity()  # a layer with a part the step would not call
    assert "layer 1" in unsupported(model, 40)


def test_rollout_draws_the_same_tokens_either_way(tiny_arch, single_thread):
    """kv_cache_sample with the step (fused=True) and through the forward (fused=False): one seed, one draw."""
    model, tok = load_causal_lm(tiny_arch("qwen3")[0])
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, attn = enc.input_ids.repeat_interleave(4, 0), enc.attention_mask.repeat_interleave(4, 0)
    draws = []
    for fused in (True, False):
        torch.manual_seed(0)
        draws.append(kv_cache_sample(model, ids, attn, 24, tok.eos_token_id, tok.pad_token_id, fused=fused))
    assert torch.equal(draws[0].tokens, draws[1].tokens) and torch.equal(draws[0].logp, draws[1].logp)
