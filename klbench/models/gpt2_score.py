"""The scoring pass of a GPT-2 without transformers' layers: the logits of whole sequences, differentiable.

    mask = sdpa_mask(attention_mask)                                # once per batch, for every model scoring it
    logits = gpt2_logits(model, tokens, position_ids, keep, mask)   # [B, keep, V]

Every training step scores its rollout twice (the policy with grad, the reference without). At the sizes
klbench trains on CPU, transformers' forward spends a seventh of such a pass outside the kernels: module
calls, kwargs, and building the [B, 1, T, T] mask through its masking utilities. This pass makes the same
tensor calls as GPT2LMHeadModel's forward, in the same order and on the same weights (what
klbench/models/gpt2_decode.py does for one decode step), so the logits and the gradients are the same bits
(tests/test_rollout.py checks both against transformers 5.24.0, float32 and bfloat16, padded or not); a step's scoring, estimate and
backward take 0.93x to 0.94x the time (docs/embedded.md, "Scoring"). Models that
`gpt2_decode.unsupported` refuses keep transformers' forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gpt2_logits(model, tokens: torch.Tensor, position_ids: torch.Tensor, keep: int | slice,
                mask: torch.Tensor | None) -> torch.Tensor:
    """[B, keep, V] next-token logits of the last `keep` positions (or of the positions a slice names), as
    model(tokens, attention_mask=..., position_ids=..., logits_to_keep=keep).logits gives them. tokens,
    position_ids: [B, T]; mask: sdpa_mask(attention_mask)."""
    tr, cfg = model.transformer, model.config
    B, T = tokens.shape
    C, H = cfg.n_embd, cfg.n_head
    D = C // H
    x = F.embedding(tokens, tr.wte.weight) + F.embedding(position_ids, tr.wpe.weight)  # [B, T, C]
    for blk in tr.h:
        a, m = blk.attn, blk.mlp
        h = F.layer_norm(x, (C,), blk.ln_1.weight, blk.ln_1.bias, blk.ln_1.eps)
        qkv = torch.addmm(a.c_attn.bias, h.view(B * T, C), a.c_attn.weight).view(B, T, 3 * C)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(C, dim=2))  # [B, H, T, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=a.scaling,
                                           is_causal=mask is None)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(B, T, C).contiguous()
        x = torch.addmm(a.c_proj.bias, o.view(B * T, C), a.c_proj.weight).view(B, T, C) + x
        h = F.layer_norm(x, (C,), blk.ln_2.weight, blk.ln_2.bias, blk.ln_2.eps)
        h = m.act(torch.addmm(m.c_fc.bias, h.view(B * T, C), m.c_fc.weight))  # [B * T, 4C]
        x = x + torch.addmm(m.c_proj.bias, h, m.c_proj.weight).view(B, T, C)
    x = tr.ln_f(x[:, -keep:] if isinstance(keep, int) else x[:, keep])  # row-wise: the same bits as all, sliced
    return F.linear(x, model.lm_head.weight)  # [B, keep, V]


def sdpa_mask(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """transformers' SDPA mask (5.24.0's masking_utils): None where nothing is padded (SDPA's causal path), else [B, 1, T, T] bool,
    True where query i may attend key j: j <= i and j is a real token. A row with no real key (a left pad)
    stays fully masked, as there: SDPA returns zeros for it, and no real position reads it."""
    if bool(attention_mask.all()):
        return None
    T = attention_mask.shape[1]
    i = torch.arange(T, device=attention_mask.device)
    causal = i[None, :] <= i[:, None]  # [T, T]
    return (causal[None] & attention_mask.bool()[:, None, :])[:, None]
