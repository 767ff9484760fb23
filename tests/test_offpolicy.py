"""Samples from a behaviour policy pi_old != pi (KLBatch.old_logp): exact expected gradients under y ~ pi_old on
the tabular model, refusals by the estimators that assume y ~ pi, and the audit with a behaviour policy."""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

from klbench.estimators import GRADIENT_ESTIMATORS, VALUE_ESTIMATORS, KLBatch, gradient_estimator, value_estimator
from klbench.exact.examples import grpo_k3_bias_corrected_loss, grpo_k3_loss, openrlhf_unbiased_gradient_loss
from klbench.exact.tabular import TabularModel, audit, behaviour_tables, default_instances

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-9


def _instances():
    """Instances with their behaviour policy: pi_old a perturbation of pi, small and large, EOS or not."""
    out = []
    for i, (m, th) in enumerate(default_instances()):
        out.append((f"default{i}(K={m.K},T={m.T},eos={m.eos})-old0.5", m, th, th + m.random_policy(400 + i, 0.5)))
    flat = TabularModel(3, 3, eos=2, seed=13)
    th = flat.random_policy(seed=14, scale=0.5)
    out.append(("flat(K=3,T=3,eos=2)-old1.5", flat, th, th + flat.random_policy(15, 1.5)))
    return out


INSTANCES = _instances()


@pytest.fixture(params=INSTANCES, ids=[n for n, *_ in INSTANCES])
def instance(request):
    _, model, theta, old = request.param
    return model, theta, old, model.exact_gradients(theta, behaviour=old)


def _mean(model, theta, old, est, n=1):
    return model.gradient_moments(est, theta, n=n, behaviour=old).mean


def _assert_grad(model, theta, old, est, expected, n=1):
    err = float((_mean(model, theta, old, est, n) - expected).abs().max())
    assert err <= TOL, f"{est!r}: max |E_old[g] - expected| = {err:.3e}"


def test_behaviour_moves_every_candidate():
    # off-policy checks only mean something where pi_old's prefixes change the partial gradients
    for _, m, th, old in INSTANCES:
        g = m.exact_gradients(th, behaviour=old)
        for kind in ("partial_kl_pi_ref", "partial_kl_ref_pi"):
            assert float((g[kind] - g[kind + "@old"]).norm()) > 1e-2 * float(g[kind].norm()), kind


OFF_POLICY_CELLS = [
    # importance weights keep the on-policy contract of in_reward and rb
    ("rb", {}, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1"}, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1", "form": "reward_to_go"}, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k3"}, lambda g: g["kl_pi_ref"] - g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "k3", "form": "reward_to_go"}, lambda g: g["kl_pi_ref"] - g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "cv", "lam": 2.0, "level": "sequence"}, lambda g: g["kl_pi_ref"] - 2.0 * g["kl_ref_pi"]),
    ("in_reward", {"value": "k1", "max_weight": 1e6}, lambda g: g["kl_pi_ref"]),
    # a detached per-token ratio: the on-policy meaning, with prefixes from pi_old
    ("in_loss", {"value": "k1"}, lambda g: g["zero"]),
    ("in_loss", {"value": "k2"}, lambda g: g["partial_kl_pi_ref@old"]),
    ("in_loss", {"value": "k3"}, lambda g: g["partial_kl_ref_pi@old"]),
    ("in_loss", {"value": "cv", "lam": 0.3}, lambda g: 0.3 * g["partial_kl_ref_pi@old"]),
    # a differentiable per-token ratio (TRL use_bias_correction_kl for k3)
    ("in_loss", {"value": "k1", "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref@old"]),
    ("in_loss", {"value": "k3", "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref@old"]),
    ("in_loss", {"value": "cv", "lam": 0.3, "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref@old"]),
    # a detached sequence ratio corrects the prefixes too: the on-policy path-wise part
    ("in_loss", {"value": "k2", "ratio": "sequence"}, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio": "sequence"}, lambda g: g["partial_kl_ref_pi"]),
    # a differentiable sequence ratio: the whole gradient of E_pi[v], grad kl_pi_ref for every unbiased value
    ("in_loss", {"value": "k1", "ratio": "sequence", "ratio_grad": "differentiable"}, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "cv", "lam": 2.0, "level": "sequence", "ratio": "sequence", "ratio_grad": "differentiable"},
     lambda g: g["kl_pi_ref"]),
]


@pytest.mark.parametrize("name,opts,expected", OFF_POLICY_CELLS, ids=[f"{n}{o}" for n, o, _ in OFF_POLICY_CELLS])
def test_off_policy_expected_gradient(instance, name, opts, expected):
    model, theta, old, g = instance
    _assert_grad(model, theta, old, gradient_estimator(name, **opts), expected(g))


@pytest.mark.parametrize("form", ["sequence", "reward_to_go"])
def test_in_reward_loo_off_policy(form):
    _, model, theta, old = INSTANCES[1]
    est = gradient_estimator("in_reward", form=form, baseline="loo")
    _assert_grad(model, theta, old, est, model.exact_gradients(theta)["kl_pi_ref"], n=2)


# ---- truncated weights: counted, and biased once they fire ----

@pytest.mark.parametrize("name,opts", [("in_reward", {}), ("in_reward", {"form": "reward_to_go"}),
                                       ("in_loss", {"value": "k3", "ratio_grad": "differentiable"}),
                                       ("in_loss", {"value": "k1", "ratio": "sequence", "ratio_grad": "differentiable"})])
def test_truncation_is_counted_and_biased(name, opts):
    _, model, theta, old = INSTANCES[3]  # the strongly off-policy instance
    batch = model.batch(theta.clone().requires_grad_(), torch.arange(model.N), behaviour=old)
    out = gradient_estimator(name, max_weight=1.2, **opts).estimate(batch)
    surrogate, n = out.values, out.n_clamped
    w_tok = torch.exp(batch.log_w.detach())  # [N, T]
    if opts.get("ratio") == "sequence" or (name == "in_reward" and "form" not in opts):
        expected_n = int((w_tok.prod(-1) > 1.2).sum())  # sequences
    elif name == "in_reward":
        expected_n = int(((w_tok.cumprod(-1) > 1.2) & batch.mask).sum())  # prefix weights W_<=t
    else:
        expected_n = int(((w_tok > 1.2) & batch.mask).sum())  # tokens
    assert n == expected_n > 0 and surrogate.shape == (model.N,)
    exact = model.gradient_moments(gradient_estimator(name, **opts), theta, behaviour=old).mean
    truncated = model.gradient_moments(gradient_estimator(name, max_weight=1.2, **opts), theta, behaviour=old).mean
    assert float((truncated - exact).norm()) > 1e-3 * float(exact.norm())


def test_on_policy_call_with_max_weight_reports_zero():
    model, theta = default_instances()[0]
    batch = model.batch(theta, torch.arange(model.N))
    assert gradient_estimator("in_reward", max_weight=2.0).estimate(batch).n_clamped == 0


# ---- old_logp == logp is on-policy: every estimator gives exactly what it gives without old_logp ----

@pytest.mark.parametrize("name", sorted(GRADIENT_ESTIMATORS))
def test_old_logp_equal_to_logp_changes_nothing(name):
    model, theta = default_instances()[1]
    t = theta.clone().requires_grad_()
    rows = torch.arange(model.N)
    batch = model.batch(t, rows, group=rows % (model.N // 2))
    same = replace(batch, old_logp=batch.logp.detach())
    assert not same.is_off_policy
    est = gradient_estimator(name)
    a, b = est(batch), est(same)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    ga = torch.autograd.grad(a.sum(), t, retain_graph=True)[0]
    gb = torch.autograd.grad(b.sum(), t)[0]
    torch.testing.assert_close(gb, ga, rtol=0, atol=0)


# ---- estimators that assume y ~ pi refuse off-policy samples ----

def _off_batch():
    _, model, theta, old = INSTANCES[0]
    rows = torch.arange(model.N)
    return model.batch(theta, rows, group=rows % (model.N // 2), behaviour=old)


ON_POLICY_ONLY = ([("gradient", n, {}) for n, c in GRADIENT_ESTIMATORS.items() if not c.off_policy]
                  + [("gradient", "in_loss", {"ratio": "none"})]
                  + [("value", n, {}) for n, c in VALUE_ESTIMATORS.items() if not c.off_policy])


@pytest.mark.parametrize("kind,name,opts", ON_POLICY_ONLY, ids=[f"{k}-{n}{o}" for k, n, o in ON_POLICY_ONLY])
def test_on_policy_estimators_refuse_old_logp(kind, name, opts):
    est = (gradient_estimator if kind == "gradient" else value_estimator)(name, **opts)
    assert not est.supports_off_policy()
    with pytest.raises(ValueError, match=r"assumes y ~ pi, but KLBatch.old_logp differs from logp"):
        est(_off_batch())


def test_the_refusing_list_is_not_empty_and_the_others_accept():
    refusing = {n for k, n, o in ON_POLICY_ONLY if k == "gradient" and not o}
    assert {"seq", "cumulative", "loo", "token", "naive_mc", "naive_cv"} <= refusing
    batch = _off_batch()
    for name in ("rb", "in_reward", "in_loss"):
        assert torch.isfinite(gradient_estimator(name)(batch)).all()


@pytest.mark.parametrize("name", ["seq", "cumulative", "token", "naive_mc", "naive_cv"])
def test_ignoring_old_logp_follows_no_kl_gradient(name):
    # what an on-policy estimator would do with pi_old's samples if old_logp were withheld from it
    est = gradient_estimator(name)
    report = audit(lambda b: est(replace(b, old_logp=None)), behaviour=0.5)
    assert report.match == "none of the above"


# ---- KLBatch.old_logp validation ----

def _batch(**over) -> KLBatch:
    logp = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, 0.0]], dtype=torch.float64)
    kw = dict(logp=logp, ref_logp=logp - 0.1, mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool))
    kw.update(over)
    return KLBatch(**kw)


@pytest.mark.parametrize("old,msg", [
    (torch.zeros(2, 4, dtype=torch.float64), r"old_logp must be a torch.float64 tensor of shape \(2, 3\)"),
    (torch.zeros(2, 3, dtype=torch.float32), "old_logp must be a torch.float64 tensor"),
    ([[0.0]], "got list"),
    (torch.zeros(2, 3, dtype=torch.float64, requires_grad=True), "old_logp requires grad"),
    (torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64), "old_logp has non-finite"),
])
def test_old_logp_validation(old, msg):
    with pytest.raises(ValueError, match=msg):
        _batch(old_logp=old)


def test_old_logp_padding_is_not_read():
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.3, -0.7, -math.inf]], dtype=torch.float64)  # -inf on padding
    batch = _batch(old_logp=old)
    assert not batch.is_off_policy and torch.isfinite(batch.log_w).all()
    assert _batch(old_logp=old - 0.1).is_off_policy


# ---- the audit with a behaviour policy ----

def test_audit_trl_bias_corrected_k3_off_policy():
    report = audit(grpo_k3_bias_corrected_loss, behaviour=0.5)
    print(f"\nTRL use_bias_correction_kl, y ~ pi_old:\n{report}")
    assert report.off_policy and report.match == "partial_kl_pi_ref@old"
    assert audit(grpo_k3_bias_corrected_loss).match == "partial_kl_pi_ref"  # on-policy: `token`


def test_audit_openrlhf_unbiased_gradient():
    report = audit(openrlhf_unbiased_gradient_loss, behaviour=0.5)
    print(f"\nOpenRLHF unbiased_gradient (no clamp), y ~ pi_old:\n{report}")
    assert report.match == "partial_kl_pi_ref@old"
    clamped = audit(functools.partial(openrlhf_unbiased_gradient_loss, max_weight=1.2), behaviour=0.5)
    print(f"\nOpenRLHF unbiased_gradient, weight clamped at 1.2, y ~ pi_old:\n{clamped}")
    assert clamped.match == "none of the above"


def test_audit_plain_k3_in_loss_at_ratio_not_1():
    report = audit(grpo_k3_loss, behaviour=0.5)
    print(f"\nplain k3 in the loss, y ~ pi_old:\n{report}")
    assert report.match == "none of the above"


def test_openrlhf_example_equals_in_loss_k2_token_ratio_in_gradient():
    _, model, theta, old = INSTANCES[0]
    t = theta.clone().requires_grad_()
    batch = model.batch(t, torch.arange(model.N), behaviour=old)
    ga = torch.autograd.grad(openrlhf_unbiased_gradient_loss(batch).sum(), t, retain_graph=True)[0]
    gb = torch.autograd.grad(gradient_estimator("in_loss", value="k2")(batch).sum(), t)[0]
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-12)


@pytest.mark.parametrize("behaviour,msg", [(0.0, "> 0"), ([torch.zeros(2, 2)], "tables for 3 instances"),
                                           (lambda m, th: th[:1], r"behaviour table must be \[P, K\]")])
def test_audit_rejects_bad_behaviour(behaviour, msg):
    with pytest.raises(ValueError, match=msg):
        behaviour_tables(default_instances(), behaviour)


def test_rb_value_off_policy_is_unbiased(instance):
    # sum_t W_<t kappa_t: each position's exact KL weighted by its prefix's ratio; E_{pi_old}[.] = kl_pi_ref
    model, theta, old, _ = instance
    mean = model.value_moments(value_estimator("rb"), theta, behaviour=old).mean
    assert abs(float(mean - model.kl_pi_ref(theta))) <= 1e-9
    # and it is the on-policy value, sample by sample, when pi_old = pi
    batch = model.batch(theta, torch.arange(model.N))
    same = replace(batch, old_logp=batch.logp.detach().clone(), token_kl=None)
    torch.testing.assert_close(value_estimator("rb")(same), value_estimator("rb")(batch), rtol=0, atol=1e-12)
