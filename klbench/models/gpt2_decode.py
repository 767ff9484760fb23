"""One decode step of a GPT-2 over a preallocated KV cache: the rollout's inner loop without transformers' layers.

    step = gpt2_decoder(model, cache, attention_mask, total_len)   # None where the model is not a plain GPT-2
    logits = step(tok, pos)                                         # [B, V], as model(tok, cache=...) gives them

At the sizes klbench trains on CPU the decode step is mostly overhead: module calls, kwargs, mask building
and cache bookkeeping. This step makes the same tensor calls that GPT2LMHeadModel's forward makes, in the same
order and on the same weights (layer norms, Conv1D's addmm, SDPA over the keys so far with the same boolean
padding mask, the model's own activation module, the model's own LM head module, so that head_precision's
product applies), so the logits are the same bits (tests/test_gpt2_decode.py checks them step by step, float32
and bfloat16, against transformers ==5.24.0, the pin in pyproject.toml).

Why it is back (issue 54; removed in a28afe1 for issue 46, where it saved 1-3% of a step at >= 124M parameters):
on the embedded LM (2 layers, 64 wide, V 1,024) a default run's rollout of 32 rows x 24 tokens took 1.5x the CPU
time through the model's forward (11,605 aten calls against 8,787), and the rollout is most of the default
run's step (docs/scale.md, "The default run against 4229a51"). Anything it does not mirror keeps the forward.

Keys and values go into buffers sized for the whole rollout (klbench/models/kv_buffers.py); attention reads
the first t + 1 positions, the same reduction length as the growing cache of transformers, so the bits do not
change with the buffer's size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from klbench.models.kv_buffers import preallocate


def unsupported(model) -> str | None:
    """Why `model` cannot take the hand-written decode step (None: it can). Anything but
    a plain GPT2LMHeadModel running SDPA attention (cross-attention, eager attention, wrapped or replaced layers)
    keeps transformers' forward."""
    from transformers import GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    if type(model) is not GPT2LMHeadModel:
        return f"{type(model).__name__} is not GPT2LMHeadModel"
    cfg = model.config
    if cfg.add_cross_attention:
        return "cross-attention"
    if cfg._attn_implementation != "sdpa":
        return f"attention implementation {cfg._attn_implementation!r} (the fused step is SDPA's)"
    for i, block in enumerate(model.transformer.h):
        layers = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        norms = (block.ln_1, block.ln_2)
        if not all(type(m) is Conv1D for m in layers) or not all(type(n) is torch.nn.LayerNorm for n in norms):
            return f"block {i} has replaced layers (an adapter?)"
    if type(model.transformer.ln_f) is not torch.nn.LayerNorm:
        return "the final layer norm is replaced"
    if model.lm_head.bias is not None or type(model.lm_head) is not torch.nn.Linear:
        return "the LM head is not a bias-free Linear"
    return None


def gpt2_decoder(model, cache, attention_mask: torch.Tensor | None, total_len: int):
    """A step function over `cache` (the prefill's transformers cache), or None where `unsupported(model)`.

    attention_mask: [B, P] of the prefill, or None where nothing is padded (then no mask at all, as
    transformers does: SDPA's unmasked path, the same bits). total_len: P + the most tokens to decode.
    """
    if unsupported(model) is not None:
        return None
    return _GPT2Step(model, cache, attention_mask, total_len)


class _GPT2Step:
    def __init__(self, model, cache, attention_mask, total_len):
        tr, cfg = model.transformer, model.config
        # the head as a module: head_precision (klbench.models.head) may have replaced its forward for the rollout
        self.wte, self.wpe, self.ln_f, self.head = tr.wte.weight, tr.wpe.weight, tr.ln_f, model.lm_head
        self.C, self.H = cfg.n_embd, cfg.n_head
        self.D = self.C // self.H
        self.blocks = list(tr.h)
        # keys, values per layer [B, H, total_len, D]; mask [B, 1, 1, total_len] or None
        self.t, self.k, self.v, self.mask = preallocate(cache, attention_mask, total_len)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tok, pos: [B] the last sampled token and its position. Returns [B, V] next-token logits."""
        C, H, D, t = self.C, self.H, self.D, self.t
        B = tok.shape[0]
        x = F.embedding(tok[:, None], self.wte) + F.embedding(pos[:, None], self.wpe)  # [B, 1, C]
        mask = None if self.mask is None else self.mask[..., : t + 1]  # [B, 1, 1, t + 1]
        for blk, k, v in zip(self.blocks, self.k, self.v):
            a, m = blk.attn, blk.mlp
            h = F.layer_norm(x, (C,), blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps)
            qkv = torch.addmm(a.c_attn.bias, h.view(B, C), a.c_attn.weight)  # [B, 3C]
            q, kt, vt = qkv.view(B, 1, 3 * C).split(C, dim=2)
            k[:, :, t] = kt.view(B, H, D)
            v[:, :, t] = vt.view(B, H, D)
            o = F.scaled_dot_product_attention(q.view(B, 1, H, D).transpose(1, 2), k[:, :, : t + 1], v[:, :, : t + 1],
                                               attn_mask=mask, dropout_p=0.0, scale=a.scaling)  # [B, H, 1, D]
            o = o.transpose(1, 2).reshape(B, 1, C).contiguous()
            x = torch.addmm(a.c_proj.bias, o.view(B, C), a.c_proj.weight).view(B, 1, C) + x
            h = F.layer_norm(x, (C,), blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps)
            h = m.act(torch.addmm(m.c_fc.bias, h.view(B, C), m.c_fc.weight))  # [B, 4C]
            x = x + torch.addmm(m.c_proj.bias, h, m.c_proj.weight).view(B, 1, C)
        self.t = t + 1
        x = self.ln_f(x)
        return self.head(x)[:, -1]  # [B, V]
