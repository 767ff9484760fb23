"""A model's logits, and a way to compute them again a row block at a time from its last hidden states.

    logits, rows = logits_and_rows(model, lambda: model(...).logits, L)   # rows(i) == logits[i], [B, L, V]

rb's gradient d kappa / d z = p (log p - log q - kappa) reads the reference's log q at every vocabulary entry
in backward. Kept whole, that is one [B, T, V] more than loo holds at its peak (1.47x loo's at V = 151,936,
docs/scale.md). The reference's last hidden states are [B, T, H], H a few thousand at most against V's
150k-260k: keeping them and its LM head, backward projects one row block at a time
(klbench.estimators.chunked.token_scores).

Generic: the hidden states are what the model's own output embedding (`get_output_embeddings()`) received
during its forward, caught by a forward hook, so transformers' forward of any architecture and klbench's GPT-2
pass (gpt2_score.gpt2_logits calls the same module) both serve. Offered only where the logits are that
module's output as is: an `nn.Linear` head, and logits that share its storage. A model that post-processes
them (Gemma 2's final softcapping, Cohere's logit scale) or a LoRA-wrapped head gets no `rows`; it then keeps
the whole reference logits to backward, as before: more memory, the same numbers.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

# positions projected at once: the blocks callers ask for are a few rows at V = 150k (a cache-sized working set),
# and a matmul of so few rows reads the whole [V, H] head each time: 1.69x loo's step time, measured, against
# 1.0x with spans of 2^24 elements (64 MiB in float32)
SPAN_ELEMENTS = 2 ** 24
Rows = Callable[[tuple], torch.Tensor]  # an index of [B, T] (klbench.estimators.chunked row blocks) -> [c, V]


def output_head(model) -> nn.Module | None:
    """The module that projects the last hidden states onto the vocabulary, or None."""
    get = getattr(model, "get_output_embeddings", None)
    if get is None and hasattr(model, "peft_model"):  # klbench.models.lora.WithoutAdapter
        get = model.peft_model.get_output_embeddings
    return get() if get is not None else None


def logits_and_rows(model, run: Callable[[], torch.Tensor], L: int) -> tuple[torch.Tensor, Rows | None]:
    """(logits [B, L, V], rows): `run()`'s logits of the response, and rows(i), which gives logits[i] again for an
    index i of [B, L] from the head's input (None where that is not exact). `run()` gives those L positions, or
    every position of the sequence (a model that ignores logits_to_keep): then the L before the last are taken.
    rows runs under the autocast state of this forward, so that it reproduces its dtype in backward too."""
    head = output_head(model)
    if type(head) is not nn.Linear:
        return _response(run(), L), None
    seen = {}
    hook = head.register_forward_hook(lambda mod, args, out: seen.update(h=args[0], out=out))
    try:
        logits = run()
    finally:
        hook.remove()
    if "out" not in seen or logits.untyped_storage().data_ptr() != seen["out"].untyped_storage().data_ptr():
        return _response(logits, L), None  # post-processed, or the head ran more than once: not its output as is
    h = _response(seen["h"].detach(), L)  # [B, L, H]
    dev = h.device.type
    auto = torch.is_autocast_enabled(dev)
    dtype = torch.get_autocast_dtype(dev) if auto else None

    span = max(1, SPAN_ELEMENTS // logits.shape[-1])
    last = {}  # the latest projected span: (b, t0, t1, [t1 - t0, V])

    buf = []  # one [span, V] output block, reused: a fresh 64 MiB block per span is mapped and faulted in anew

    def project(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(dev, dtype) if auto else nullcontext():
            if auto or x.dim() != 2:
                return head(x)
            if not buf or buf[0].shape[0] < x.shape[0]:
                buf[:] = [x.new_empty(max(span, x.shape[0]), head.out_features)]
            out = buf[0][: x.shape[0]]  # [c, V]
            w = head.weight.t()  # F.linear's own kernels: mm, or addmm with a bias
            return torch.mm(x, w, out=out) if head.bias is None else torch.addmm(head.bias, x, w, out=out)

    def rows(i: tuple) -> torch.Tensor:
        if len(i) == 1:  # the whole [B, T]
            return project(h[i])
        b, s = i
        if not (last and last["b"] == b and last["t0"] <= s.start and s.stop <= last["t1"]):
            t1 = min(s.start + max(span, s.stop - s.start), h.shape[1])
            last.update(b=b, t0=s.start, t1=t1, out=project(h[b, s.start:t1]))
        return last["out"][s.start - last["t0"]: s.stop - last["t0"]]  # [c, V]

    return _response(logits, L), rows


def _response(x: torch.Tensor, L: int) -> torch.Tensor:
    """[B, L, ...]: x itself, or the L positions before the last where x holds the whole sequence."""
    return x if x.shape[1] == L else x[:, -(L + 1):-1]
