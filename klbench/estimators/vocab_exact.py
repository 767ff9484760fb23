"""Exact per-position quantities over the whole vocabulary, from logits [B, T, V], in row chunks: KL(pi || pi_ref)
(exact_token_kl), the entropy (exact_token_entropy), the sampled token's log-prob (token_logprob) and both models'
log-probs with the KL in one pass (token_scores).

The naive version materialises log_softmax of both [B, T, V] tensors in float32
and autograd keeps several of them alive for backward. Here forward keeps only
the [B, T] result and backward recomputes each chunk, so peak memory stays near
the logits themselves plus one [chunk, V] float32 working set per model. Small
chunks are also faster on CPU: the working set stays in cache, where the naive
version streams every [B, T, V] intermediate through main memory.

A batch whose B * T rows fit in one chunk (small vocabularies: the tabular model, tests) is one block,
padding rows included and masked out of the result and the gradient: a loop over sequences would cost
more Python than arithmetic there.
"""
from __future__ import annotations

import torch


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are upcast inside the chunk; float64 (tabular tests) stays exact
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows per chunk when the caller gives none: about 2^20 float32 elements (4 MiB) per [rows, V] block on
    CPU, so the few blocks alive at once stay in cache; 2^25 on accelerators, to amortise kernel launches."""
    target = 2 ** 20 if device.type == "cpu" else 2 ** 25
    return max(1, target // vocab)


def _pieces(mask: torch.Tensor, chunk_rows: int) -> list[tuple[int, int, int]]:
    """(b, t0, t1): runs of real tokens within one sequence, cut to <= chunk_rows rows.

    logits[b, t0:t1] is a view whatever the batch stride, so no chunk is ever copied (float32) and
    padding rows are never read.
    """
    m = mask.detach().to("cpu", torch.int8)  # [B, T]
    edges = torch.nn.functional.pad(m, (1, 1)).diff(dim=-1)  # [B, T+1]: +1 where a run starts, -1 where it ends
    out = []
    for (b, t0), (_, t1) in zip((edges == 1).nonzero().tolist(), (edges == -1).nonzero().tolist()):
        out.extend((b, s, min(s + chunk_rows, t1)) for s in range(t0, t1, chunk_rows))
    return out


def _pieces_or_whole(mask: torch.Tensor, chunk_rows: int) -> list[tuple] | None:
    """None when every row fits in one chunk (then the whole [B, T, V] is one block), else _pieces."""
    return None if mask.numel() <= chunk_rows else _pieces(mask, chunk_rows)


def _chunk_logprobs(logits, ref_logits, b, t0, t1, acc):
    return (torch.log_softmax(logits[b, t0:t1].to(acc), -1),  # [c, V]
            torch.log_softmax(ref_logits[b, t0:t1].to(acc), -1))  # [c, V]


def _whole_logprobs(logits, ref_logits, acc):
    return torch.log_softmax(logits.to(acc), -1), torch.log_softmax(ref_logits.to(acc), -1)  # [B, T, V] each


class _ExactTokenKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, mask, chunk_rows):
        acc = _accum_dtype(logits.dtype)
        pieces = _pieces_or_whole(mask, chunk_rows)
        if pieces is None:
            logp, logq = _whole_logprobs(logits, ref_logits, acc)
            kl = logp.exp().mul_(logp.sub_(logq)).sum(-1)  # [B, T]
            out = torch.where(mask, kl, torch.zeros((), dtype=acc, device=kl.device))  # padding may be non-finite
        else:
            out = torch.zeros(mask.shape, dtype=acc, device=logits.device)  # [B, T]
        for b, t0, t1 in pieces or ():
            logp, logq = _chunk_logprobs(logits, ref_logits, b, t0, t1, acc)
            p = logp.exp()
            out[b, t0:t1] = p.mul_(logp.sub_(logq)).sum(-1)  # in place: no third [c, V] temporary
        # a nan/inf logit in a row always makes that row's KL nan/inf (log_softmax of finite logits is
        # finite), so one check of the [B, T] result replaces an isfinite pass over every chunk
        if not torch.isfinite(out).all():
            raise ValueError("KLBatch.logits or ref_logits has non-finite values on masked-in tokens")
        ctx.save_for_backward(logits, ref_logits, out, mask)
        ctx.pieces = pieces
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, ref_logits, out, mask = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        acc = _accum_dtype(logits.dtype)
        if ctx.pieces is None:  # one block: the same formula as below, padding rows zeroed (never NaN)
            logp, logq = _whole_logprobs(logits, ref_logits, acc)
            p = logp.exp()  # before logp is overwritten in place
            g = logp.sub_(logq).sub_(out.unsqueeze(-1)).mul_(p).mul_(grad_out.to(acc).unsqueeze(-1))
            return torch.where(mask.unsqueeze(-1), g, torch.zeros((), dtype=acc, device=g.device)).to(logits.dtype), \
                None, None, None
        grad = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for b, t0, t1 in ctx.pieces:
            logp, logq = _chunk_logprobs(logits, ref_logits, b, t0, t1, acc)
            p = logp.exp()
            # d KL(p||q) / d z = p * (log p - log q - KL): the softmax Jacobian folded in, computed in place
            g = logp.sub_(logq).sub_(out[b, t0:t1].unsqueeze(-1)).mul_(p)
            grad[b, t0:t1] = g.mul_(grad_out[b, t0:t1].to(acc).unsqueeze(-1))  # cast to logits.dtype on copy
        return grad, None, None, None


def exact_token_kl(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor,
                   chunk_rows: int | None = None) -> torch.Tensor:
    """[B, T] kappa_t = sum_v pi(v) (log pi(v) - log pi_ref(v)); zero where mask is False.

    Differentiable in `logits` only (pi_ref is frozen). Float32 result for float32/bf16 logits.
    chunk_rows=None picks `default_chunk_rows` for the vocabulary and device.
    """
    rows = default_chunk_rows(logits.shape[-1], logits.device) if chunk_rows is None else int(chunk_rows)
    return _ExactTokenKL.apply(logits, ref_logits.detach(), mask, rows)


def exact_token_kl_naive(logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The unchunked formula, for tests and the benchmark: full [B, T, V] float32 log_softmax of both."""
    acc = _accum_dtype(logits.dtype)
    logp = torch.log_softmax(logits.to(acc), -1)  # [B, T, V]
    logq = torch.log_softmax(ref_logits.detach().to(acc), -1)  # [B, T, V]
    kappa = (logp.exp() * (logp - logq)).sum(-1)  # [B, T]
    return torch.where(mask, kappa, torch.zeros((), dtype=acc, device=kappa.device))


@torch.no_grad()
def exact_token_entropy(logits: torch.Tensor, mask: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """[B, T] entropy of pi(.|y_<t) in nats, zero off the mask; chunked like exact_token_kl, no gradient."""
    acc = _accum_dtype(logits.dtype)
    rows = default_chunk_rows(logits.shape[-1], logits.device) if chunk_rows is None else int(chunk_rows)
    pieces = _pieces_or_whole(mask, rows)
    if pieces is None:
        logp = torch.log_softmax(logits.to(acc), -1)  # [B, T, V]
        return torch.where(mask, -(logp.exp() * logp).sum(-1), torch.zeros((), dtype=acc, device=logp.device))
    out = torch.zeros(mask.shape, dtype=acc, device=logits.device)
    for b, t0, t1 in pieces:
        logp = torch.log_softmax(logits[b, t0:t1].to(acc), -1)  # [c, V]
        out[b, t0:t1] = -(logp.exp() * logp).sum(-1)
    return out


def _row_blocks(shape: torch.Size, rows: int) -> list[tuple]:
    """Index tuples of [B, T, ...] into blocks of <= rows positions, each a view (logits[b, t0:t1]); one block, the
    whole tensor, when every position fits."""
    B, T = shape[0], shape[1]
    if B * T <= rows:
        return [(slice(None),)]
    return [(b, slice(t0, min(t0 + rows, T))) for b in range(B) for t0 in range(0, T, rows)]


class _TokenLogprob(torch.autograd.Function):
    """log softmax(logits)[tokens], the log-normaliser computed by row blocks. Forward keeps the [B, T] normaliser;
    backward writes the one [B, T, V] gradient, softmax's part and the gather's together, block by block. Autograd's
    own version (gather - logsumexp) holds a [B, T, V] exp in logsumexp's forward and, in backward, logsumexp's
    [B, T, V] gradient, the gather's zero-filled [B, T, V] scatter and their sum."""

    @staticmethod
    def forward(ctx, logits, tokens, rows):
        acc = _accum_dtype(logits.dtype)
        blocks = _row_blocks(logits.shape, rows)
        lse = torch.empty(logits.shape[:2], dtype=acc, device=logits.device)  # [B, T]
        for i in blocks:
            lse[i] = torch.logsumexp(logits[i].to(acc), -1)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.blocks = blocks
        return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(acc) - lse  # [B, T]

    @staticmethod
    def backward(ctx, g):
        logits, tokens, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [B, T, V]
        for i in ctx.blocks:  # -g softmax(logits), in place on one [rows, V] working block
            grad[i] = (logits[i].to(lse.dtype) - lse[i].unsqueeze(-1)).exp_().mul_(-g[i].unsqueeze(-1))
        grad.scatter_add_(-1, tokens.unsqueeze(-1), g.unsqueeze(-1).to(grad.dtype))  # + g at the sampled token
        return grad, None, None


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] log softmax(logits)[tokens] in float32 (float64 stays), differentiable in logits, with no [B, T, V]
    tensor beyond the logits and their gradient (a row block of `default_chunk_rows` at a time). tokens: [B, T];
    any other leading shape [..., V] with tokens [...] is taken as one sequence."""
    if logits.dim() != 3:
        flat = token_logprob(logits.reshape(1, -1, logits.shape[-1]), tokens.reshape(1, -1))  # [1, N]
        return flat.reshape(tokens.shape)
    return _TokenLogprob.apply(logits, tokens, default_chunk_rows(logits.shape[-1], logits.device))


class _TokenScores(torch.autograd.Function):
    """token_logprob and the exact per-position KL(pi || pi_ref) of the same logits in one pass per row block, and
    one [B, T, V] gradient for both: apart, each backward recomputes its softmax and writes a [B, T, V] gradient of
    the logits, and autograd adds them. Measured (docs/scale.md): the peak is the same either way, rb's step over
    loo's 1.25x-1.27x apart against a median 1.07x in one pass.

    kappa's gradient p (log p - log q - kappa) reads the reference's logits in backward, so they are kept: one
    [B, T, V] more than token_logprob keeps. With donate, backward writes the gradient into them, block by block,
    each block read before it is written: the [B, T, V] gradient it would allocate is the reference's logits, and
    the step holds no more than loo's (docs/scale.md)."""

    @staticmethod
    def forward(ctx, logits, ref_logits, tokens, rows, donate):
        acc = _accum_dtype(logits.dtype)
        blocks = _row_blocks(logits.shape, rows)
        lse = torch.empty(logits.shape[:2], dtype=acc, device=logits.device)  # [B, T]
        lse_q, kappa = torch.empty_like(lse), torch.empty_like(lse)  # [B, T] each
        for i in blocks:
            x, r = logits[i].to(acc), ref_logits[i].to(acc)  # [c, V] each
            lse[i] = torch.logsumexp(x, -1)
            logp, logq = torch.log_softmax(x, -1), torch.log_softmax(r, -1)  # [c, V] each
            # the reference's normaliser by the very function that gives the policy's: at pi = pi_ref the two are the
            # same bits, so backward's shift, and rb's gradient there, are exactly 0 (in bf16 as in float32)
            lse_q[i] = torch.logsumexp(r, -1)
            kappa[i] = logp.exp().mul_(logp.sub_(logq)).sum(-1)  # as exact_token_kl
        # backward's log p - log q - kappa = z - r - shift, with no log-softmax of either model
        shift = lse - lse_q + kappa  # [B, T]
        ctx.save_for_backward(logits, ref_logits, tokens, lse, shift)
        ctx.blocks = blocks
        ctx.donate = donate and ref_logits.dtype == logits.dtype and ref_logits.is_contiguous()
        return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(acc) - lse, kappa

    @staticmethod
    def backward(ctx, g_logp, g_kappa):
        logits, ref_logits, tokens, lse, shift = ctx.saved_tensors
        grad = ref_logits if ctx.donate else torch.empty_like(logits)  # [B, T, V]
        for i in ctx.blocks:
            x = logits[i].to(lse.dtype)  # [c, V]
            p = (x - lse[i].unsqueeze(-1)).exp_()  # [c, V]
            # d kappa / d z = p (log p - log q - kappa); d logp(y) / d z = onehot(y) - p (the onehot added below):
            # together p (g_kappa (z - r - shift) - g_logp); the last product is written into grad's block
            same = grad.dtype == p.dtype
            out = grad[i] if same else torch.empty_like(p)  # [c, V]
            if g_kappa is None:
                torch.mul(p, -g_logp[i].unsqueeze(-1), out=out)
            else:  # g_kappa (z - r) - (g_kappa shift + g_logp): the per-row constants folded into one [c]
                c = shift[i] * g_kappa[i] + (g_logp[i] if g_logp is not None else 0)  # [c]
                d = torch.sub(x, ref_logits[i].to(lse.dtype)).mul_(g_kappa[i].unsqueeze(-1)).sub_(c.unsqueeze(-1))
                torch.mul(d, p, out=out)  # d is read whole before out (the reference's block, if donated) is written
            if not same:
                grad[i] = out
        if g_logp is not None:
            grad.scatter_add_(-1, tokens.unsqueeze(-1), g_logp.unsqueeze(-1).to(grad.dtype))
        return grad, None, None, None, None


def token_scores(logits: torch.Tensor, ref_logits: torch.Tensor, tokens: torch.Tensor,
                 mask: torch.Tensor, donate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi(y_t) [B, T], kappa_t [B, T]): token_logprob(logits, tokens) and exact_token_kl(logits, ref_logits,
    mask), both differentiable in logits, with one [B, T, V] gradient between them. kappa is 0 off the mask.
    donate: ref_logits are the caller's to give up: backward overwrites them with the gradient (where dtype and
    layout allow), so nothing may read them after backward."""
    logp, kappa = _TokenScores.apply(logits, ref_logits.detach(), tokens,
                                      default_chunk_rows(logits.shape[-1], logits.device), donate)
    kappa = torch.where(mask, kappa, torch.zeros((), dtype=kappa.dtype, device=kappa.device))
    if not torch.isfinite(kappa).all():  # as exact_token_kl: a non-finite logit on a real token
        raise ValueError("KLBatch.logits or ref_logits has non-finite values on masked-in tokens")
    return logp, kappa
