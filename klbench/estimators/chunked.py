"""Exact per-position KL(pi || pi_ref) over the vocabulary, in row chunks.

The naive version materialises log_softmax of both [B, T, V] tensors in float32
and autograd keeps several of them alive for backward. Here forward keeps only
the [B, T] result and backward recomputes each chunk, so peak memory stays near
the logits themselves plus one [chunk, V] float32 working set per model.
"""
from __future__ import annotations

import torch


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are upcast inside the chunk; float64 (tabular tests) stays exact
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logprobs(logits, ref_logits, b, t, acc):
    z = logits[b, t].to(acc)  # [c, V]
    zr = ref_logits[b, t].to(acc)  # [c, V]
    if not (torch.isfinite(z).all() and torch.isfinite(zr).all()):
        raise ValueError("KLBatch.logits or ref_logits has non-finite values on masked-in tokens")
    return torch.log_softmax(z, -1), torch.log_softmax(zr, -1)


class _ExactTokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, mask, chunk_rows):
        acc = _accum_dtype(logits.dtype)
        b_idx, t_idx = mask.nonzero(as_tuple=True)  # [R] each: only real tokens are computed
        out = torch.zeros(mask.shape, dtype=acc, device=logits.device)  # [B, T]
        for b, t in zip(b_idx.split(chunk_rows), t_idx.split(chunk_rows)):
            logp, logq = _chunk_logprobs(logits, ref_logits, b, t, acc)
            out[b, t] = (logp.exp() * (logp - logq)).sum(-1)
        ctx.save_for_backward(logits, ref_logits, out, b_idx, t_idx)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits, out, b_idx, t_idx = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        acc = _accum_dtype(logits.dtype)
        grad = torch.zeros_like(logits)  # [B, T, V]
        for b, t in zip(b_idx.split(ctx.chunk_rows), t_idx.split(ctx.chunk_rows)):
            logp, logq = _chunk_logprobs(logits, ref_logits, b, t, acc)
            # d KL(p||q) / d z = p * (log p - log q - KL): the softmax Jacobian folded in
            g = logp.exp() * (logp - logq - out[b, t].unsqueeze(-1))
            grad[b, t] = (g * grad_out[b, t].to(acc).unsqueeze(-1)).to(logits.dtype)
        return grad, None, None, None


def exact_token_kl(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor,
                   chunk_rows: int = 256) -> torch.Tensor:
    """[B, T] kappa_t = sum_v pi(v) (log pi(v) - log pi_ref(v)); zero where mask is False.

    Differentiable in `logits` only (pi_ref is frozen). Float32 result for float32/bf16 logits.
    """
    return _ExactTokenKL.apply(logits, ref_logits.detach(), mask, int(chunk_rows))


def exact_token_kl_naive(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unchunked formula, for tests and the benchmark: full [B, T, V] float32 log_softmax of both."""
    acc = _accum_dtype(logits.dtype)
    logp = torch.log_softmax(logits.to(acc), -1)  # [B, T, V]
    logq = torch.log_softmax(ref_logits.detach().to(acc), -1)  # [B, T, V]
    kappa = (logp.exp() * (logp - logq)).sum(-1)  # [B, T]
    return torch.where(mask, kappa, torch.zeros((), dtype=acc, device=kappa.device))


@torch.no_grad()
def exact_token_entropy(logits: torch.Tensor, mask: torch.Tensor, chunk_rows: int = 256) -> torch.Tensor:
    """[B, T] entropy of pi(.|y_<t) in nats, zero off the mask; chunked like exact_token_kl, no gradient."""
    acc = _accum_dtype(logits.dtype)
    b_idx, t_idx = mask.nonzero(as_tuple=True)
    out = torch.zeros(mask.shape, dtype=acc, device=logits.device)
    for b, t in zip(b_idx.split(chunk_rows), t_idx.split(chunk_rows)):
        logp = torch.log_softmax(logits[b, t].to(acc), -1)  # [c, V]
        out[b, t] = -(logp.exp() * logp).sum(-1)
    return out
