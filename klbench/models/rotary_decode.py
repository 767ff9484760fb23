"""One decode step of a rotary decoder (Llama, Mistral, Qwen2, Qwen3) through the model's own modules, over
preallocated keys and values: the rollout's inner loop without transformers' per-step scaffolding.

    reason = unsupported(model, total_len)                            # None: the step below is exact for it
    step = rotary_decoder(model, cache, attention_mask, total_len)    # None where unsupported
    logits = step(tok, pos)                                           # [B, V], the bits model(tok, cache=...) gives

What a transformers decode step does around its kernels (the peer job's Llama, docs/scale.md "Speed beyond
GPT-2"): build the mask through its masking utilities, re-derive every kwarg, route each layer through
decorators and the attention interface, and grow each layer's cache with torch.cat. This step calls the same
modules in the same order (the model's embedding, rotary embedding, norms, projections, MLP and LM head, and
transformers' own apply_rotary_pos_emb and SDPA attention function), so the logits are the same bits
(tests/test_rotary_decode.py, float32 and bfloat16, padded or not), and so it is generic in what the modules do:
a LoRA-wrapped projection, a Qwen3's q_norm/k_norm, any RoPE variant the model's rotary module computes. Only the
layer's wiring is written here, which is why the model class must be one of ARCHITECTURES: those whose forward
does nothing between the layers that this wiring would miss (in transformers 5.24.0 Gemma 2 and 3 add norms
around each sublayer and soft-cap their logits, Phi3 fuses its projections; they and anything else keep the
model's forward).

Keys and values go into buffers sized for the whole rollout, as GPT-2's step has them
(klbench/models/kv_buffers.py).
"""
from __future__ import annotations

import sys

import torch

from klbench.models.kv_buffers import preallocate

# causal LMs whose forward is embed -> rotary -> [pre-norm attention, pre-norm MLP] x N -> norm -> LM head
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_HEAD_NORMS = {"q_norm", "k_norm"}  # Qwen3: an RMSNorm over each head's q and k before RoPE


def _base(model):
    """The transformers model under a peft wrapper (a LoRA policy), else the model itself."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def unsupported(model, total_len: int) -> str | None:
    """Why the step cannot stand in for `model`'s forward over `total_len` positions (None: it can)."""
    peft = getattr(model, "active_peft_config", None)
    if peft is not None and getattr(peft, "is_prompt_learning", False):
        return f"a {type(peft).__name__} adapter: its virtual tokens enter through the model's forward"
    base = _base(model)
    name = type(base).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    cfg = base.config
    if cfg._attn_implementation != "sdpa":
        return f"attention implementation {cfg._attn_implementation!r} (the step calls transformers' SDPA attention)"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window < total_len and "sliding_attention" in (getattr(cfg, "layer_types", None)
                                                                           or ["sliding_attention"]):
        return f"a sliding window of {window} positions, shorter than the rollout's {total_len}"
    inner = base.model
    if {n for n, _ in inner.named_children()} != {"embed_tokens", "layers", "norm", "rotary_emb"}:
        return f"{type(inner).__name__} has other parts than embed_tokens, layers, norm, rotary_emb"
    for i, layer in enumerate(inner.layers):
        attn = {n for n, _ in layer.self_attn.named_children()}
        if {n for n, _ in layer.named_children()} != _LAYER or not _ATTENTION <= attn <= _ATTENTION | _HEAD_NORMS:
            return f"layer {i} is not wired as {type(inner.layers[0]).__name__} is"
    return None


def rotary_decoder(model, cache, attention_mask: torch.Tensor | None, total_len: int):
    """A step function over `cache` (the prefill's transformers cache), or None where `unsupported`.

    attention_mask: [B, P] of the prefill, or None where nothing is padded (then no mask, as transformers
    passes none: SDPA's GQA path). total_len: P + the most tokens to decode.
    """
    if unsupported(model, total_len) is not None:
        return None
    return _RotaryStep(_base(model), cache, attention_mask, total_len)


class _RotaryStep:
    def __init__(self, model, cache, attention_mask, total_len):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        self.model, self.inner, self.attend = model, model.model, sdpa_attention_forward
        # the very apply_rotary_pos_emb the model's attention calls (each modeling file has its own)
        self.rope = sys.modules[type(self.inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
        # keys, values per layer [B, H_kv, total_len, D]; mask [B, 1, 1, total_len] or None
        self.t, self.k, self.v, self.mask = preallocate(cache, attention_mask, total_len)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok, pos: [B] the last sampled token and its position. Returns [B, V] next-token logits."""
        t, B = self.t, tok.shape[0]
        mask = None if self.mask is None else self.mask[..., : t + 1]  # [B, 1, 1, t + 1]
        x = self.inner.embed_tokens(tok[:, None])  # [B, 1, C]
        cos, sin = self.inner.rotary_emb(x, pos[:, None])  # [B, 1, D] each
        for layer, k_buf, v_buf in zip(self.inner.layers, self.k, self.v):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            shape = (B, 1, -1, a.head_dim)
            q, k, v = a.q_proj(h).view(shape), a.k_proj(h).view(shape), a.v_proj(h).view(shape)  # [B, 1, H, D]
            if hasattr(a, "q_norm"):
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, 1, D]
            k_buf[:, :, t] = k[:, :, 0]
            v_buf[:, :, t] = v[:, 0]
            o, _ = self.attend(a, q, k_buf[:, :, : t + 1], v_buf[:, :, : t + 1], mask, dropout=0.0,
                               scaling=a.scaling)  # [B, 1, H, D]
            x = x + a.o_proj(o.reshape(B, 1, -1).contiguous())
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.t = t + 1
        return self.model.lm_head(self.inner.norm(x))[:, -1]  # [B, V]
