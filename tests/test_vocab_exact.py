"""Chunked exact per-position KL at LM-like shapes against the unchunked formula: values and gradients."""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import KLBatch, exact_token_kl, exact_token_kl_naive, gradient_estimator, value_estimator
from klbench.estimators.base import reward_to_go
from klbench.estimators.vocab_exact import default_chunk_rows, exact_token_entropy

pytestmark = pytest.mark.usefixtures("single_thread")

B, T, V = 2, 33, 5003
LENGTHS = (33, 20)  # the second sequence has a 13-token padding tail


def _inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # scale 3 gives peaked distributions, so kappa spans small and large values
    logits = (3 * torch.randn(B, T, V, generator=gen)).to(dtype)  # [B, T, V]
    ref_logits = (3 * torch.randn(B, T, V, generator=gen)).to(dtype)  # [B, T, V]
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(-1)  # [B, T]
    weight = torch.rand(B, T, generator=gen, dtype=torch.float32)  # [B, T] upstream gradient, not all ones
    return logits, ref_logits, mask, weight


def _value_and_grad(fn, logits, ref_logits, mask, weight, **kw):
    z = logits.clone().requires_grad_()
    kappa = fn(z, ref_logits, mask, **kw)  # [B, T]
    (grad,) = torch.autograd.grad((kappa * weight.to(kappa.dtype)).sum(), z)
    return kappa.detach(), grad


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_float32_matches_naive(chunk_rows):
    logits, ref_logits, mask, weight = _inputs(torch.float32)
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=chunk_rows)
    kappa_n, grad_n = _value_and_grad(exact_token_kl_naive, logits, ref_logits, mask, weight)
    assert kappa.dtype == torch.float32 and grad.dtype == torch.float32
    assert kappa.min() >= 0 and kappa.max() > 1  # a real spread, not a vacuous comparison
    torch.testing.assert_close(kappa, kappa_n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_n, rtol=1e-5, atol=1e-6 * float(grad_n.abs().max()))
    assert (kappa[~mask] == 0).all() and (grad[~mask] == 0).all()


@pytest.mark.parametrize("chunk_rows", [1, 7, 1000])
def test_bfloat16_matches_naive_on_same_logits(chunk_rows):
    logits, ref_logits, mask, weight = _inputs(torch.bfloat16)
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=chunk_rows)
    kappa_n, grad_n = _value_and_grad(exact_token_kl_naive, logits, ref_logits, mask, weight)
    assert kappa.dtype == torch.float32  # upcast inside the chunk, so the KL itself is float32
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(kappa, kappa_n, rtol=1e-5, atol=1e-5)
    # both round a float32 gradient to bf16 at the end; allow about one bf16 ulp
    torch.testing.assert_close(grad.float(), grad_n.float(), rtol=1e-2, atol=1e-3 * float(grad_n.abs().max()))
    assert (grad[~mask] == 0).all()


def test_float64_is_exact():
    logits, ref_logits, mask, weight = _inputs(torch.float64)
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=5)
    kappa_n, grad_n = _value_and_grad(exact_token_kl_naive, logits, ref_logits, mask, weight)
    torch.testing.assert_close(kappa, kappa_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_n, rtol=1e-10, atol=1e-14)


def test_reference_gets_no_gradient():
    logits, ref_logits, mask, _ = _inputs(torch.float32)
    ref = ref_logits.clone().requires_grad_()
    for out in (exact_token_kl(logits.clone().requires_grad_(), ref, mask, chunk_rows=64),
                exact_token_kl_naive(logits.clone().requires_grad_(), ref, mask)):
        out.sum().backward()
        assert ref.grad is None  # pi_ref is frozen even when the caller forgot to detach it


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_rb_estimators_match_unchunked_formula(dtype, tol):
    logits, ref_logits, mask, _ = _inputs(dtype, seed=1)
    tok = torch.randint(V, (B, T, 1), generator=torch.Generator().manual_seed(2))

    def scored(z):
        # logp comes from the same logits, so the score-function term also reaches them
        logp = torch.log_softmax(z.to(torch.float64), -1).gather(-1, tok).squeeze(-1).to(dtype)  # [B, T]
        ref_logp = torch.log_softmax(ref_logits.to(torch.float64), -1).gather(-1, tok).squeeze(-1).to(dtype)
        return logp, ref_logp

    z = logits.clone().requires_grad_()
    logp, ref_logp = scored(z)
    batch = KLBatch(logp, ref_logp, mask, z, ref_logits, chunk_rows=16)
    value = value_estimator("rb")(batch)
    (grad,) = torch.autograd.grad(gradient_estimator("rb")(batch).sum(), z)

    zn = logits.clone().requires_grad_()
    logp_n, _ = scored(zn)
    kappa = exact_token_kl_naive(zn, ref_logits, mask).to(dtype)  # [B, T]
    future = (reward_to_go(kappa.detach()) - kappa.detach())  # [B, T] sum_{s>t} kappa_s
    surrogate = kappa.sum(-1) + (future * torch.where(mask, logp_n, 0)).sum(-1)
    (grad_n,) = torch.autograd.grad(surrogate.sum(), zn)

    torch.testing.assert_close(value, kappa.detach().sum(-1), rtol=tol, atol=tol)
    torch.testing.assert_close(grad, grad_n, rtol=tol, atol=tol * float(grad_n.abs().max()))


@pytest.mark.parametrize("chunk_rows", [1, 3, B * (T - 1), None])  # B * (T - 1) rows: exactly one block
def test_mask_with_holes_and_strided_logits(chunk_rows):
    # logits[:, :-1] of a model output is a strided view, and multi-turn masks have holes mid-sequence
    full, ref_full, mask, weight = _inputs(torch.float32, seed=3)
    logits, ref_logits = full[:, :-1], ref_full[:, :-1]  # [B, T-1, V], not contiguous
    mask, weight = mask[:, :-1].clone(), weight[:, :-1]
    mask[0, 5:9] = False
    mask[1, 0] = False
    assert not logits.is_contiguous()
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=chunk_rows)
    kappa_n, grad_n = _value_and_grad(exact_token_kl_naive, logits, ref_logits, mask, weight)
    torch.testing.assert_close(kappa, kappa_n, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_n, rtol=1e-5, atol=1e-6 * float(grad_n.abs().max()))
    assert (kappa[~mask] == 0).all() and (grad[~mask] == 0).all()


@pytest.mark.parametrize("chunk_rows", [1, 1000])  # per sequence, and the whole batch as one block
def test_non_finite_padding_never_reaches_value_or_gradient(chunk_rows):
    """Padding rows are never part of the answer: an inf or NaN logit there (a model's output beyond EOS)
    changes neither the KL nor the gradient of the real rows."""
    logits, ref_logits, mask, weight = _inputs(torch.float32, seed=5)
    kappa_clean, grad_clean = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=chunk_rows)
    logits[1, 25] = float("nan")  # row 1 is padding from t = 20
    ref_logits[1, 30, 0] = float("inf")
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, mask, weight, chunk_rows=chunk_rows)
    assert torch.equal(kappa, kappa_clean) and torch.equal(grad, grad_clean)
    entropy = exact_token_entropy(logits, mask, chunk_rows)
    assert torch.isfinite(entropy).all() and (entropy[~mask] == 0).all()


def test_empty_mask():
    logits, ref_logits, mask, weight = _inputs(torch.float32)
    kappa, grad = _value_and_grad(exact_token_kl, logits, ref_logits, torch.zeros_like(mask), weight)
    assert (kappa == 0).all() and (grad == 0).all()


def test_default_chunk_rows_is_resolved_by_the_batch():
    logits, ref_logits, mask, _ = _inputs(torch.float32)
    logp = torch.zeros(B, T)
    batch = KLBatch(logp, logp, mask, logits, ref_logits)
    assert batch.chunk_rows == default_chunk_rows(V, logits.device) >= 1
    assert KLBatch(logp, logp, mask).chunk_rows is None  # nothing to chunk without logits
    torch.testing.assert_close(batch.kappa, exact_token_kl(logits, ref_logits, mask, chunk_rows=7))


@pytest.mark.parametrize("chunk_rows", [1, 1000, None])
def test_entropy_matches_formula(chunk_rows):
    logits, _, mask, _ = _inputs(torch.bfloat16)
    logp = torch.log_softmax(logits.float(), -1)  # [B, T, V]
    expected = torch.where(mask, -(logp.exp() * logp).sum(-1), 0)
    torch.testing.assert_close(exact_token_entropy(logits, mask, chunk_rows), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("V", [11, 60000])  # one block; 17 rows a block (default_chunk_rows), several per sequence
def test_token_logprob_matches_gather_minus_logsumexp(dtype, V):
    """The chunked selective log-softmax against autograd's gather - logsumexp: the same forward bits, the same
    gradient, on a non-contiguous view of the logits (as scoring slices the response positions)."""
    from klbench.estimators.vocab_exact import token_logprob
    gen = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(2, 41, V, generator=gen)).to(dtype)  # [B, T + 1, V]
    tokens = torch.randint(V, (2, 40), generator=gen)  # [B, T]
    weight = torch.randn(2, 40, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    outs = []
    for chunked in (False, True):
        z = base.clone().requires_grad_()
        x = z[:, :-1]  # a view: batch stride (T + 1) V
        if chunked:
            lp = token_logprob(x, tokens)
        else:
            up = x.float() if dtype != torch.float64 else x
            lp = up.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(up, -1)
        (grad,) = torch.autograd.grad((lp * weight).sum(), z)
        outs.append((lp.detach(), grad.float()))
    assert torch.equal(outs[0][0], outs[1][0])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(outs[0][1], outs[1][1], atol=tol, rtol=0), float((outs[0][1] - outs[1][1]).abs().max())
    assert float(outs[1][1].abs().max()) > 0.1  # a real gradient
    one = token_logprob(base[0, :-1], tokens[0])  # [T, V] and [T]: one sequence, as callers pass it
    assert torch.equal(one, outs[1][0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("V", [11, 60000])
def test_token_scores_is_token_logprob_and_exact_token_kl_in_one(dtype, V):
    """token_scores' log-probs and kappa are token_logprob's and exact_token_kl's bit for bit, and its one
    gradient is the sum of theirs, for any weights on the two outputs and with a padding tail."""
    from klbench.estimators.vocab_exact import token_logprob, token_scores
    gen = torch.Generator().manual_seed(1)
    base = (3 * torch.randn(2, 41, V, generator=gen)).to(dtype)  # [B, T + 1, V]
    ref = (3 * torch.randn(2, 40, V, generator=gen)).to(dtype)  # [B, T, V]
    tokens = torch.randint(V, (2, 40), generator=gen)
    mask = torch.arange(40).unsqueeze(0) < torch.tensor([[40], [27]])  # [B, T]
    w_logp, w_kappa = (torch.randn(2, 40, generator=gen, dtype=dtype) for _ in range(2))
    outs = []
    for fused, dt in ((False, dtype), (True, dtype), (False, torch.float64)):
        z = base.to(dt).clone().requires_grad_()
        x = z[:, :-1]
        logp, kappa = token_scores(x, ref.to(dt), tokens, mask) if fused else \
            (token_logprob(x, tokens), exact_token_kl(x, ref.to(dt), mask))
        (grad,) = torch.autograd.grad((logp * w_logp.to(dt)).sum() + (kappa * w_kappa.to(dt)).sum(), z)
        outs.append((logp.detach(), kappa.detach(), grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # the gradient: within float rounding of the float64 one, as the two apart are (float32, V = 60,000:
    # 2.7e-6 of the largest entry apart, 5.1e-6 in one pass, whose backward reads no log-softmax)
    exact = outs[2][2]
    tol = (1e-12 if dtype == torch.float64 else 1e-5) * float(exact.abs().max())
    for _, _, grad in outs[:2]:
        assert torch.allclose(grad.double(), exact, atol=tol, rtol=0), float((grad.double() - exact).abs().max())
    assert float(outs[1][1][1, 27:].abs().max()) == 0  # kappa is 0 on the padding tail
