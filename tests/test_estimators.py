"""Input validation, option handling, clamping and cv_opt's fitted multiplier on hand-made batches."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.estimators import (GRADIENT_ESTIMATORS, VALUE_ESTIMATORS, KLBatch, gradient_estimator,
                                value_estimator)

pytestmark = pytest.mark.usefixtures("single_thread")

B, T, V = 3, 4, 5


def _batch(**over) -> KLBatch:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64)  # [B, T, V]
    ref_logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64)  # [B, T, V]
    tok = torch.randint(V, (B, T, 1), generator=gen)
    kw = dict(
        logp=torch.log_softmax(logits, -1).gather(-1, tok).squeeze(-1),  # [B, T]
        ref_logp=torch.log_softmax(ref_logits, -1).gather(-1, tok).squeeze(-1),  # [B, T]
        mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
        logits=logits, ref_logits=ref_logits,
    )
    kw.update(over)
    return KLBatch(**kw)


# ---- names and options ----

@pytest.mark.parametrize("factory,registry", [(value_estimator, VALUE_ESTIMATORS),
                                              (gradient_estimator, GRADIENT_ESTIMATORS)])
def test_unknown_name_lists_valid_names(factory, registry):
    with pytest.raises(ValueError, match="valid names") as err:
        factory("reinforce_kl")
    assert all(name in str(err.value) for name in registry)


def test_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=r"\['alpha'\].*valid options: clamp, lam, level"):
        value_estimator("cv", alpha=1.0)
    with pytest.raises(ValueError, match="valid options: none"):
        gradient_estimator("rb", lam=1.0)


@pytest.mark.parametrize("opts,msg", [
    ({"level": "tokens"}, "level must be 'token' or 'sequence'"),
    ({"lam": math.inf}, "lam must be a finite number"),
    ({"lam": "1"}, "lam must be a finite number"),
    ({"clamp": -1.0}, "clamp must be None or a positive number"),
])
def test_bad_option_values(opts, msg):
    with pytest.raises(ValueError, match=msg):
        gradient_estimator("naive_cv", **opts)
    with pytest.raises(ValueError, match=msg):
        value_estimator("cv", **opts)


def test_estimator_rejects_non_batch():
    with pytest.raises(ValueError, match="expects a KLBatch"):
        value_estimator("mc")({"logp": torch.zeros(2, 2)})


# ---- KLBatch validation ----

@pytest.mark.parametrize("over,msg", [
    ({"ref_logp": torch.zeros(B, T + 1, dtype=torch.float64)}, r"ref_logp has shape \(3, 5\), expected \(3, 4\)"),
    ({"mask": torch.ones(B, T + 1, dtype=torch.bool)}, "mask has shape"),
    ({"logp": torch.zeros(B, T, 2, dtype=torch.float64)}, r"logp must be \[B, T\]"),
    ({"ref_logp": torch.zeros(B, T, dtype=torch.float32)}, "ref_logp has dtype torch.float32, logp has torch.float64"),
    ({"mask": torch.ones(B, T, dtype=torch.long)}, "mask must be bool"),
    ({"ref_logp": torch.zeros(B, T, dtype=torch.float64, requires_grad=True)}, "ref_logp requires grad"),
    ({"logits": torch.zeros(B, T, V + 1, dtype=torch.float64)}, "vocabularies must match"),
    ({"logits": torch.zeros(B, T + 1, V, dtype=torch.float64)}, r"logits must be \[B, T, V\]"),
    ({"ref_logits": None}, "must be given together"),
    ({"group": torch.zeros(B + 1, dtype=torch.long)}, "group must be an int tensor"),
    ({"group": torch.zeros(B)}, "group must be an int tensor"),
    ({"chunk_rows": 0}, "chunk_rows must be >= 1"),
])
def test_batch_rejects_bad_inputs(over, msg):
    with pytest.raises(ValueError, match=msg):
        _batch(**over)


def test_ref_logits_requiring_grad():
    good = _batch()
    with pytest.raises(ValueError, match="ref_logits requires grad"):
        _batch(ref_logits=good.ref_logits.clone().requires_grad_())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logp_on_real_tokens(bad):
    logp = _batch().logp.clone()
    logp[1, 1] = bad  # mask[1, 1] is True
    with pytest.raises(ValueError, match="logp has non-finite values"):
        _batch(logp=logp)


def test_non_finite_padding_is_harmless():
    # -inf log-probs on padding are common (masked logits): they must not leak into values or gradients
    base = _batch()
    logp = base.logp.clone().requires_grad_()
    with torch.no_grad():
        logp[~base.mask] = -math.inf
    batch = _batch(logp=logp)
    for name in ("seq", "cumulative", "token", "naive_cv", "rb"):
        (g,) = torch.autograd.grad(gradient_estimator(name)(batch).sum(), logp)
        assert torch.isfinite(g).all() and (g[~base.mask] == 0).all(), name
    assert torch.isfinite(value_estimator("mc")(batch)).all()


def test_non_finite_logits_on_real_tokens():
    logits = _batch().logits.clone()
    logits[0, 2, 3] = math.nan
    with pytest.raises(ValueError, match="non-finite values on masked-in tokens"):
        value_estimator("rb")(_batch(logits=logits))
    logits = _batch().logits.clone()
    logits[2, 3, 0] = math.inf  # padding (mask[2, 3] is False): never read
    assert torch.isfinite(value_estimator("rb")(_batch(logits=logits))).all()


def test_rb_without_logits():
    batch = _batch(logits=None, ref_logits=None)
    with pytest.raises(ValueError, match="rb needs the full next-token distributions"):
        value_estimator("rb")(batch)
    with pytest.raises(ValueError, match="rb needs the full next-token distributions"):
        gradient_estimator("rb")(batch)


def test_loo_needs_group():
    with pytest.raises(ValueError, match="loo needs KLBatch.group"):
        gradient_estimator("loo")(_batch())


def test_loo_rejects_group_of_one():
    with pytest.raises(ValueError, match=r"n >= 2 samples per prompt; group sizes found: \[1, 2\]"):
        gradient_estimator("loo")(_batch(group=torch.tensor([0, 0, 1])))


# ---- clamping is counted, per token or per sequence ----

def _hand_batch():
    rho = torch.tensor([[0.1, 2.0, -3.0, 5.0], [0.5, -0.2, 9.0, 9.0]], dtype=torch.float64)  # [2, 4]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # the 5.0 and 9.0 are padding
    return KLBatch(rho.clone().requires_grad_(), torch.zeros_like(rho), mask), rho, mask


def test_clamp_token_level_counts_and_values():
    batch, rho, mask = _hand_batch()
    k3 = rho + torch.expm1(-rho)  # [2, 4]
    expected_count = int(((k3.abs() > 0.5) & mask).sum())
    assert expected_count == 2  # 2.0 -> 1.135 and -3.0 -> 16.09; the padding 5.0 must not count
    est = value_estimator("cv", clamp=0.5)
    out = est.estimate(batch)
    assert out.n_clamped == expected_count and out.fitted_lam is None
    torch.testing.assert_close(out.values, torch.where(mask, k3.clamp(-0.5, 0.5), 0).sum(-1))
    torch.testing.assert_close(est(batch), out.values)  # a plain call gives the same values, as a Tensor
    grad = gradient_estimator("naive_cv", clamp=0.5).estimate(batch)
    assert grad.n_clamped == expected_count and grad.values.requires_grad


def test_clamp_sequence_level_counts_and_values():
    batch, rho, mask = _hand_batch()
    r = torch.where(mask, rho, 0).sum(-1)  # [2]: -0.9, 0.3
    k3 = r + torch.expm1(-r)
    out = value_estimator("cv", level="sequence", clamp=0.2).estimate(batch)
    assert out.n_clamped == int((k3.abs() > 0.2).sum()) == 1
    torch.testing.assert_close(out.values, k3.clamp(-0.2, 0.2))


@pytest.mark.parametrize("kind,name,opts", [("value", "cv", {"clamp": 0.5}), ("value", "cv", {}),
                                            ("gradient", "naive_cv", {"clamp": 0.5}), ("value", "cv_opt", {}),
                                            ("gradient", "in_reward", {"max_weight": 2.0}), ("gradient", "rb", {})])
def test_every_call_returns_one_tensor_per_sequence(kind, name, opts):
    """Whatever the options, a call gives Tensor[B]; what it did on the way is in estimate()."""
    batch, _, _ = _hand_batch()
    batch = KLBatch(batch.logp, batch.ref_logp, batch.mask, torch.randn(2, 4, 3, dtype=torch.float64),
                    torch.randn(2, 4, 3, dtype=torch.float64))
    est = (value_estimator if kind == "value" else gradient_estimator)(name, **opts)
    out = est(batch)
    assert type(out) is torch.Tensor and out.shape == (2,)
    counted = est.estimate(batch).n_clamped
    assert (counted is None) == ("clamp" not in opts and "max_weight" not in opts)


def test_no_clamp_counts_nothing():
    batch, _, _ = _hand_batch()
    assert value_estimator("cv").estimate(batch).n_clamped is None


# ---- cv_opt fits the least-squares multiplier ----

def test_cv_opt_lam_is_least_squares_coefficient():
    rho = torch.tensor([[0.3, -0.1], [1.2, 0.4], [-0.5, 0.2], [0.9, -0.7], [0.05, 0.6]], dtype=torch.float64)
    batch = KLBatch(rho, torch.zeros_like(rho), torch.ones_like(rho, dtype=torch.bool))
    est = value_estimator("cv_opt")
    out = est.estimate(batch)
    values = out.values
    r = rho.sum(-1)  # [5]
    c = torch.expm1(-r)
    # regress r on [1, c]: the variance-minimising multiplier is minus the slope
    design = torch.stack([torch.ones_like(c), c], -1)  # [5, 2]
    slope = torch.linalg.lstsq(design, r.unsqueeze(-1)).solution[1, 0]
    assert abs(out.fitted_lam + float(slope)) <= 1e-12
    assert not hasattr(est, "fitted_lam")  # the estimator keeps no state between calls
    torch.testing.assert_close(values, r - slope * c)
    # at the fitted multiplier the batch variance is the smallest over a grid of multipliers
    grid = torch.linspace(-3, 3, 601, dtype=torch.float64)
    variances = torch.stack([(r + lam * c).var() for lam in grid])
    assert values.var() <= variances.min() + 1e-12


def test_cv_opt_needs_two_sequences():
    rho = torch.tensor([[0.3, -0.1]], dtype=torch.float64)
    with pytest.raises(ValueError, match="at least 2 sequences"):
        value_estimator("cv_opt")(KLBatch(rho, torch.zeros_like(rho), torch.ones_like(rho, dtype=torch.bool)))
