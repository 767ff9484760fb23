"""Rollouts of a causal LM: ancestral sampling at temperature 1 over the model's KV cache.

    kv_cache_sample(model, input_ids, attention_mask, max_new_tokens, eos_id, pad_id) -> Samples
    position_ids_from_mask(attention_mask) -> positions of left-padded rows, as generate() counts them
    generate_sample(...) -> Samples            # the same draw through transformers' generate()
    SAMPLERS = {"kv_cache": ..., "generate": ...}

Every estimator assumes y ~ pi exactly, so the sampler is plain: softmax of the float32 logits, one
torch.multinomial draw per row and step, no top-k/top-p, no logits processors. It draws exactly as
generate(do_sample=True, top_k=0, top_p=1.0, temperature=1.0) does in transformers 5.x: the same
forward calls (left-padded prefill with positions counted from each row's first real token, the
mask dropped when nothing is padded, logits of the last position only), the same multinomial call
on the same probabilities. Under one seed the tokens are identical (tests/test_rollout.py), and
the RNG stream after a rollout is too, so a run's later steps do not move either.

What generate() does per token that this loop does not: build and run its logits-processor and
stopping-criteria lists, re-derive its model inputs from a kwargs dict, and honour the model's
generation_config (whose processors, were any set, would bias every estimator anyway).

The seam: a Sampler is any callable with kv_cache_sample's signature. A server-grade engine
(vLLM, SGLang) plugs in as another entry of SAMPLERS, returning the same Samples; where its
log-probs differ from the scoring pass's, Samples.logp is what an importance correction needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Samples:
    tokens: torch.Tensor  # [B, L] response tokens; a row that emitted EOS is padded with pad_id after it
    logp: torch.Tensor | None  # [B, L] float32 log-prob of each sampled token under the sampling logits, 0 after EOS


class Sampler(Protocol):
    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_id: int, pad_id: int) -> Samples: ...


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counted from each row's first real token, as generate() does with left padding.

    Pass these to forward when scoring left-padded samples, or the log-probs are not those the samples
    were drawn from (absolute position embeddings).
    """
    pos = attention_mask.long().cumsum(-1) - 1  # [B, T]
    return pos.masked_fill(attention_mask == 0, 0)  # pads: any position works, generate() uses 0


def kv_cache_sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_id: int, pad_id: int, threads: int | None = None) -> Samples:
    """max_new_tokens (or fewer, once every row has emitted EOS) tokens per row, y ~ model at temperature 1.

    input_ids, attention_mask: [B, P] left-padded prompts. Device and dtype are the model's: the same
    loop runs on CPU and GPU, in float32 or bfloat16 (the sampling softmax is always float32).
    threads: torch threads the loop runs with on CPU, restored afterwards (None: the process's). The
    tokens do not depend on it. One thread was 12x faster on a heavily loaded 2-core machine and up to
    15% slower on a quieter one (docs/embedded.md, "Rollouts"), so the default leaves it to the process.
    """
    if max_new_tokens < 1:
        raise ValueError(f"kv_cache_sample: max_new_tokens must be >= 1, got {max_new_tokens}")
    previous = torch.get_num_threads()
    if threads is not None and input_ids.device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            tokens, logp = _sample_loop(model, input_ids, attention_mask, max_new_tokens, eos_id, pad_id)
    finally:
        torch.set_num_threads(previous)
    # out of inference mode: the scoring pass feeds these to an embedding whose backward saves its indices
    return Samples(tokens.clone(), logp.clone())


def _sample_loop(model, input_ids, attention_mask, max_new_tokens, eos_id, pad_id):
    B = input_ids.shape[0]
    pos = position_ids_from_mask(attention_mask)  # [B, P]
    # no padding: no mask at all, as generate() does (SDPA then takes its causal path: the same bits)
    mask = attention_mask if not bool(attention_mask.all()) else None
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    pos = pos[:, -1:]  # [B, 1] the last prompt position; each step advances it
    cache = getattr(out, "cache", None)
    if cache is None:  # e.g. remote code that still names it past_key_values: one token without it is garbage
        raise ValueError(f"kv_cache_sample: {type(model).__name__} returned no KV cache (transformers 5's `cache`); "
                         "sample it with sampler='generate'")
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)  # [B] rows past their EOS
    pad = torch.full((B,), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    zero = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1].float()  # [B, V]
        del out  # the prefill's logits go now, not at the next step
        probs = torch.softmax(logits, -1)  # [B, V]
        tok = torch.multinomial(probs, num_samples=1).squeeze(1)  # [B] generate()'s very call: same RNG draw
        lp = probs.gather(-1, tok[:, None]).squeeze(1).log()  # [B] no second pass over [B, V]: a drawn p is > 1e-38
        tok = torch.where(done, pad, tok)
        tokens.append(tok)
        logps.append(torch.where(done, zero, lp))
        done = done | (tok == eos_id)
        if t == max_new_tokens - 1 or bool(done.all()):  # one host sync a step, as generate() on CPU/GPU
            break
        pos = pos + 1
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)  # [B, P + t + 1]
        out = model(input_ids=tok[:, None], cache=cache, attention_mask=mask, position_ids=pos,
                    use_cache=True, logits_to_keep=1)
        cache = out.cache
    return torch.stack(tokens, 1), torch.stack(logps, 1)  # [B, L], [B, L]


def generate_sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_id: int, pad_id: int) -> Samples:
    """The same draw through transformers' generate(): the reference kv_cache_sample is tested against.
    No log-probs (generate() would need output_scores, a [B, V] copy per token)."""
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, top_k=0, top_p=1.0,
                         temperature=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id)
    return Samples(out[:, input_ids.shape[1]:], None)


SAMPLERS: dict[str, Sampler] = {"kv_cache": kv_cache_sample, "generate": generate_sample}
