"""The keys, values and padding mask of klbench's own GPT-2 decode step (gpt2_decode.py), sized once
for the whole rollout and filled from the prefill's transformers cache.

    t, keys, values, mask = preallocate(cache, attention_mask, total_len)

A step writes position t into every layer's buffers and attends over the first t + 1 positions: the same
reduction length as transformers' growing cache, so the bits do not depend on the buffer's size.
"""
from __future__ import annotations

import torch


def preallocate(cache, attention_mask: torch.Tensor | None, total_len: int):
    """(t, keys, values, mask): t the positions the prefill filled; keys, values per layer [B, H_kv, total_len, D]
    with the first t filled; mask [B, 1, 1, total_len] bool, True where attended (transformers' SDPA mask for one
    query), or None where `attention_mask` ([B, P] of the prefill) is None: nothing padded, no mask."""
    t = cache.get_seq_length()
    keys, values = [], []
    for layer in cache.layers:
        for store, filled in ((keys, layer.keys), (values, layer.values)):
            buf = filled.new_empty(*filled.shape[:2], total_len, filled.shape[3])
            buf[:, :, :t] = filled
            store.append(buf)
    mask = None
    if attention_mask is not None:
        mask = torch.ones(attention_mask.shape[0], 1, 1, total_len, dtype=torch.bool, device=attention_mask.device)
        mask[:, 0, 0, :t] = attention_mask.bool()
    return t, keys, values, mask
