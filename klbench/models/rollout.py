"""Rollouts of a causal LM: ancestral sampling from pi_s (pi at a temperature, top-k/top-p cut) over its KV cache.

    kv_cache_sample(model, input_ids, attention_mask, max_new_tokens, eos_ids, pad_id, sampling=Sampling()) -> Samples
    position_ids_from_mask(attention_mask) -> positions of left-padded rows, as generate() counts them
    generate_sample(...) -> Samples            # the same draw through transformers' generate()
    SAMPLERS = {"kv_cache": ..., "generate": ...}

The sampler draws from pi_s: the float32 logits through klbench.estimators.sampling.Sampling.process
(transformers' temperature, top-k and top-p warpers with their arithmetic; nothing at all at the plain
temperature 1), a softmax, one torch.multinomial draw per row and step, no other logits processor. Which KL
a run then regularises is its KL target (klbench/estimators/sampling.py, docs/sampling.md). It draws exactly
as generate(do_sample=True, temperature=T, top_k=k, top_p=p) does in transformers 5.x: the same logits
(left-padded prefill with positions counted from each row's first real token, the mask dropped when nothing
is padded, logits of the last position only, every step through the model's own forward, or for a plain GPT-2
through klbench/models/gpt2_decode.py, the same bits in two thirds of the CPU time), the same warpers,
and multinomial's own arithmetic on the same draws. Under one seed the tokens are identical
(tests/test_rollout.py), and the RNG stream after a rollout is too, so a run's later steps do not move either.
Every id of `eos_ids` ends a row (instruct models list several: Llama-3.1's [128001, 128008, 128009]), as
generate(eos_token_id=[...]) does.

Where the time went on CPU (the peer job of docs/running.md, 32 rows x 2,000 tokens): the Exp(1)
noise behind each multinomial draw was a serial kernel as long as a whole decode step (exp_noise
draws the same values in a third of the time). Hand-written decode steps for GPT-2 and the rotary
decoders, which repeated transformers 5.24.0's internals, were removed: they saved under 1% of a step at 0.5B
parameters and above (docs/scale.md, "Decode forks"). The GPT-2 one is back (issue 54): the embedded LM's
rollout took 1.5x its CPU time without it, and the rollout is most of the default run (docs/scale.md).

What generate() does per token that this loop does not: build and run its logits-processor and
stopping-criteria lists, re-derive its model inputs from a kwargs dict, and honour the rest of the model's
generation_config (repetition penalties and the like, which no KL target describes; the run says what it
does with the config's sampling options and stop ids, klbench/models/policies.py).

The seam: a Sampler is any callable with kv_cache_sample's signature. A server-grade engine
(vLLM, SGLang) plugs in as another entry of SAMPLERS, returning the same Samples; where its
log-probs differ from the scoring pass's, Samples.logp is what an importance correction needs.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from klbench.estimators.sampling import Sampling
from klbench.models.gpt2_decode import gpt2_decoder

PLAIN = Sampling()


@dataclass
class Samples:
    tokens: torch.Tensor  # [B, L] response tokens; a row that emitted a stop id is padded with pad_id after it
    logp: torch.Tensor | None  # [B, L] float32 log pi_s of each sampled token (the sampler's own), 0 after the stop


class Sampler(Protocol):
    def __call__(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos_ids: int | Sequence[int], pad_id: int, sampling: Sampling = PLAIN) -> Samples: ...


def stop_ids(eos_ids: int | Sequence[int]) -> list[int]:
    """The ids that end a response, as a list: one id or several (every one ends it)."""
    ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_ids must be a token id or a non-empty list of ids, got {eos_ids!r}")
    return ids


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counted from each row's first real token, as generate() does with left padding.

    Pass these to forward when scoring left-padded samples, or the log-probs are not those the samples
    were drawn from (absolute position embeddings).
    """
    pos = attention_mask.long().cumsum(-1) - 1  # [B, T]
    return pos.masked_fill(attention_mask == 0, 0)  # pads: any position works, generate() uses 0


def kv_cache_sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_ids: int | Sequence[int], pad_id: int, sampling: Sampling = PLAIN,
                    threads: int | None = None, fused: bool = True) -> Samples:
    """max_new_tokens (or fewer, once every row has emitted a stop id) tokens per row, y ~ pi_s.

    input_ids, attention_mask: [B, P] left-padded prompts. Device and dtype are the model's: the same
    loop runs on CPU and GPU, in float32 or bfloat16 (the sampling softmax is always float32).
    eos_ids: one stop id or a list; every one ends a row (it is kept, then pads follow).
    sampling: temperature, top_k, top_p (klbench.estimators.sampling.Sampling); the default is plain pi.
    threads: torch threads the loop runs with on CPU, restored afterwards (None: the process's). The
    tokens do not depend on it. One thread was 12x faster on a heavily loaded 2-core machine and up to
    15% slower on a quieter one (docs/embedded.md, "Rollouts"), so the default leaves it to the process.
    fused: decode a plain GPT-2 with klbench/models/gpt2_decode.py's step (the forward's bits); other models, or
    fused=False, decode through the model's forward.
    """
    if max_new_tokens < 1:
        raise ValueError(f"kv_cache_sample: max_new_tokens must be >= 1, got {max_new_tokens}")
    previous = torch.get_num_threads()
    if threads is not None and input_ids.device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode(), attention_backends(input_ids.device):
            tokens, logp = _sample_loop(model, input_ids, attention_mask, max_new_tokens, stop_ids(eos_ids), pad_id,
                                        sampling, fused)
    finally:
        torch.set_num_threads(previous)
    bad = ~torch.isfinite(logp)  # [B, L] torch.multinomial would have refused these probabilities
    if bool(bad.any()):
        step = int(bad.any(0).int().argmax())
        from klbench.models.nonfinite import nonfinite_cause
        raise FloatingPointError(f"kv_cache_sample: non-finite logits at response step {step} "
                                 f"(rows {bad[:, step].nonzero().flatten().tolist()[:8]})"
                                 + nonfinite_cause(model, sampling))
    # out of inference mode: the scoring pass feeds these to an embedding whose backward saves its indices
    return Samples(tokens.clone(), logp.clone())


def attention_backends(device: torch.device):
    """The context klbench's passes run SDPA in: on CUDA every backend but cuDNN's, which plans each new shape
    anew, and a rollout's key length grows every step (on an H200 in bf16 a 20-step embedded run's steps took
    21 s with it and 3 s without, tests/test_rollout_gpu.py). Elsewhere nothing changes."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def exp_noise(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float32 Exp(1) noise from the device's default generator: the very values Tensor.exponential_() gives.

    On CPU that kernel is serial: -log1p(-u) per element in float64, u drawn as uniform_() draws a float64,
    then rounded to float32. Drawing the u with uniform_() (the same generator calls, so the same RNG state
    after) and transforming them in one vectorised op gives the same bits in a third of the time (0.43 ms
    against 1.41 ms for [32, 2000]; 0 mismatches in 10^8 draws, tests/test_rollout.py).
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=torch.float32, device=device).exponential_()
    u = torch.empty(shape, dtype=torch.float64).uniform_()
    return torch.log1p(u.neg_()).neg_().float()


class _ForwardStep:
    """The decode step through the model's own forward: (tok [B], pos [B]) -> [B, V] logits."""

    def __init__(self, model, cache, mask):
        self.model, self.cache, self.mask = model, cache, mask

    def __call__(self, tok, pos):
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], 1)  # [B, P + t + 1]
        out = self.model(input_ids=tok[:, None], cache=self.cache, attention_mask=self.mask,
                         position_ids=pos[:, None], use_cache=True, logits_to_keep=1)
        self.cache = out.cache
        return out.logits[:, -1]


def _sample_loop(model, input_ids, attention_mask, max_new_tokens, eos_ids, pad_id, sampling, fused=True):
    B, P = input_ids.shape
    pos = position_ids_from_mask(attention_mask)  # [B, P]
    # no padding: no mask at all, as generate() does (SDPA then takes its causal path: the same bits)
    mask = attention_mask if not bool(attention_mask.all()) else None
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    pos = pos[:, -1]  # [B] the last prompt position; each step advances it
    cache = getattr(out, "cache", None)
    if cache is None:  # transformers < 5.24, or remote code, names it past_key_values: one token without it is garbage
        import transformers
        raise ValueError(f"kv_cache_sample: {type(model).__name__} returned no KV cache under `cache` (transformers "
                         f">= 5.24 names it so; this is {transformers.__version__}): upgrade transformers "
                         "(pip install -U 'transformers>=5.24'), or, for a folder's own code "
                         "(model.trust_remote_code=true), load the architecture transformers ships "
                         "(model.trust_remote_code=false)")
    own = fused and gpt2_decoder(model, cache, mask, P + max_new_tokens)  # None: not a plain GPT-2
    decode = own or _ForwardStep(model, cache, mask)
    logits = out.logits[:, -1]  # [B, V]
    del out, cache  # the prefill's logits and cache: the decoder holds what it needs
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)  # [B] rows past their stop id
    stops = torch.tensor(eos_ids, dtype=input_ids.dtype, device=input_ids.device)  # [S]
    # the warpers of generate(): none at plain sampling (the bits of a plain softmax, as before)
    warp = (lambda x: x.float()) if sampling.is_plain else sampling.process
    pad = torch.full((B,), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    zero = torch.zeros((), dtype=torch.float32, device=input_ids.device)
    shape = (B, logits.shape[-1])
    q = exp_noise(shape, input_ids.device)  # [B, V]
    tokens, logps = [], []
    for t in range(max_new_tokens):
        probs = torch.softmax(warp(logits), -1)  # [B, V] pi_s; exactly 0 on the tokens top-k/top-p cut
        # torch.multinomial(probs, 1) in ATen's one-sample path is argmax(probs / q), q ~ Exp(1) of probs' shape
        # and dtype: the same arithmetic on the same draws, so generate()'s tokens and RNG state, with the draw
        # taken out of the call so that its noise comes from exp_noise, 3x faster on CPU
        tok = (probs / q).argmax(-1)  # [B]
        lp = probs.gather(-1, tok[:, None]).squeeze(1).log()  # [B] log pi_s, no second pass over [B, V]: a drawn p > 1e-38
        tok = torch.where(done, pad, tok)
        tokens.append(tok)
        logps.append(torch.where(done, zero, lp))
        done = done | torch.isin(tok, stops)
        if t == max_new_tokens - 1 or bool(done.all()):  # one host sync a step, as generate() on CPU/GPU
            break
        pos = pos + 1
        logits = decode(tok, pos)
        q = exp_noise(shape, input_ids.device)  # only once the loop goes on, as generate(): the same RNG state after
    return torch.stack(tokens, 1), torch.stack(logps, 1)  # [B, L], [B, L]


def generate_sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                    eos_ids: int | Sequence[int], pad_id: int, sampling: Sampling = PLAIN) -> Samples:
    """The same draw through transformers' generate(): the reference kv_cache_sample is tested against.
    No log-probs (generate() would need output_scores, a [B, V] copy per token)."""
    ids = stop_ids(eos_ids)
    with attention_backends(input_ids.device):
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                             temperature=float(sampling.temperature), top_k=sampling.top_k, top_p=float(sampling.top_p),
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                             eos_token_id=ids[0] if len(ids) == 1 else ids)
    return Samples(out[:, input_ids.shape[1]:], None)


SAMPLERS: dict[str, Sampler] = {"kv_cache": kv_cache_sample, "generate": generate_sample}
