"""The placement grid (value estimator x in_reward / in_loss), on-policy: exact expected gradients on the
tabular model, sample-by-sample equality with the well-known names, and the score + path-wise identity."""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import GRADIENT_ESTIMATORS, gradient_estimator
from klbench.estimators.placement import value_terms
from klbench.exact.tabular import TabularModel, audit, default_instances

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-9


def _instances():
    out = [(f"default{i}(K={m.K},T={m.T},eos={m.eos})", m, th) for i, (m, th) in enumerate(default_instances())]
    flat = TabularModel(3, 3, eos=2, seed=13)
    out.append(("flat(K=3,T=3,eos=2)", flat, flat.random_policy(seed=14, scale=0.5)))
    return out


INSTANCES = _instances()


@pytest.fixture(params=INSTANCES, ids=[n for n, _, _ in INSTANCES])
def instance(request):
    _, model, theta = request.param
    return model, theta, model.exact_gradients(theta)


def grad_mean_value(model: TabularModel, theta: torch.Tensor, value: str, lam: float = 1.0,
                    level: str = "token") -> torch.Tensor:
    """Exact grad_theta E_{y~pi_theta}[v(y; theta)] [P, K]: both the sampling and the value differentiated."""
    t = theta.detach().clone().requires_grad_()
    rows = torch.arange(model.N)
    terms, per_token = value_terms(model.batch(t, rows), value, lam, level)
    v = terms.sum(-1) if per_token else terms  # [N]
    return torch.autograd.grad((model.seq_logprob(t).exp() * v).sum(), t)[0]


def _assert_grad(model, theta, est, expected, n=1):
    mean = model.gradient_moments(est, theta, n=n).mean
    err = float((mean - expected).abs().max())
    assert err <= TOL, f"{est!r}: max |E[g] - expected| = {err:.3e}"


def test_instances_separate_the_candidates():
    # the contracts below are only informative where the candidate gradients differ
    assert any(m.eos is None for _, m, _ in INSTANCES) and any(m.eos is not None for _, m, _ in INSTANCES)
    for _, m, th in INSTANCES:
        g = m.exact_gradients(th)
        g["E_k2"] = grad_mean_value(m, th, "k2")
        names = list(g)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                assert float((g[a] - g[b]).norm()) > 1e-3 * float(g["kl_pi_ref"].norm()), (a, b)


# ---- each cell's documented expected gradient ----

CELLS = [
    # in_reward: the score-function part, grad E_pi[v] - E_pi[grad v]
    ("in_reward", {"value": "k1"}, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1", "form": "reward_to_go"}, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k3"}, lambda g: g["kl_pi_ref"] - g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "k3", "form": "reward_to_go"}, lambda g: g["kl_pi_ref"] - g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "cv", "lam": 0.3}, lambda g: g["kl_pi_ref"] - 0.3 * g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "cv", "lam": 2.0, "level": "sequence"}, lambda g: g["kl_pi_ref"] - 2.0 * g["kl_ref_pi"]),
    ("in_reward", {"value": "k2"}, lambda g: g["E_k2"] - g["partial_kl_pi_ref"]),
    # in_loss without a ratio (or with a detached one, 1 on-policy): the path-wise part E_pi[grad v]
    ("in_loss", {"value": "k1", "ratio": "none"}, lambda g: g["zero"]),
    ("in_loss", {"value": "k1"}, lambda g: g["zero"]),
    ("in_loss", {"value": "k2"}, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k3"}, lambda g: g["partial_kl_ref_pi"]),
    ("in_loss", {"value": "k3", "ratio": "sequence"}, lambda g: g["partial_kl_ref_pi"]),
    ("in_loss", {"value": "cv", "lam": 0.3}, lambda g: 0.3 * g["partial_kl_ref_pi"]),
    ("in_loss", {"value": "cv", "lam": 2.0, "level": "sequence", "ratio": "none"}, lambda g: 2.0 * g["kl_ref_pi"]),
    # a differentiable ratio changes the gradient although it is 1 in value
    ("in_loss", {"value": "k1", "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "cv", "lam": 0.3, "ratio_grad": "differentiable"}, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k1", "ratio": "sequence", "ratio_grad": "differentiable"}, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "cv", "lam": 2.0, "level": "sequence", "ratio": "sequence",
                 "ratio_grad": "differentiable"}, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k2", "ratio": "sequence", "ratio_grad": "differentiable"}, lambda g: g["E_k2"]),
]


@pytest.mark.parametrize("name,opts,expected", CELLS, ids=[f"{n}{o}" for n, o, _ in CELLS])
def test_cell_expected_gradient(instance, name, opts, expected):
    model, theta, g = instance
    g = {**g, "E_k2": grad_mean_value(model, theta, "k2")}
    _assert_grad(model, theta, gradient_estimator(name, **opts), expected(g))


@pytest.mark.parametrize("form", ["sequence", "reward_to_go"])
@pytest.mark.parametrize("value", ["k1", "k3"])
def test_in_reward_loo_baseline_keeps_the_mean(value, form):
    model, theta = default_instances()[1]  # EOS, 4 tokens: 2-tuples enumerated exactly
    base = model.gradient_moments(gradient_estimator("in_reward", value=value, form=form), theta).mean
    loo = model.gradient_moments(gradient_estimator("in_reward", value=value, form=form, baseline="loo"), theta, n=2)
    assert float((loo.mean - base).abs().max()) <= TOL


@pytest.mark.parametrize("value,lam,level", [("k1", 1.0, "token"), ("k2", 1.0, "token"), ("k3", 1.0, "token"),
                                             ("cv", 0.3, "token"), ("cv", 2.0, "sequence")])
def test_score_plus_pathwise_is_the_whole_gradient(instance, value, lam, level):
    # grad E_pi[v] = E[v grad log pi] (in_reward) + E[grad v] (in_loss): each placement keeps one part
    model, theta, _ = instance
    opts = {"value": value, "lam": lam, "level": level}
    score = model.gradient_moments(gradient_estimator("in_reward", **opts), theta).mean
    path = model.gradient_moments(gradient_estimator("in_loss", ratio="none", **opts), theta).mean
    whole = grad_mean_value(model, theta, value, lam, level)
    assert float((score + path - whole).abs().max()) <= TOL


@pytest.mark.parametrize("name,opts", [("in_reward", {"value": "k3"}), ("in_reward", {"value": "k2"}),
                                       ("in_loss", {"value": "k2", "ratio_grad": "differentiable"})],
                         ids=["in_reward_k3", "in_reward_k2", "in_loss_k2_diff_token"])
def test_audit_none_of_the_above(name, opts):
    assert audit(gradient_estimator(name, **opts)).match == "none of the above"


# ---- the well-known names are cells of the grid, sample by sample ----

def _all_sequences(model, theta, pairs=False):
    rows = torch.arange(model.N)
    group = rows % (model.N // 2) if pairs else None
    return model.batch(theta.clone().requires_grad_(), rows, group=group)


SAME = [
    ("seq", {}, {"value": "k1"}, "in_reward"),
    ("cumulative", {}, {"value": "k1", "form": "reward_to_go"}, "in_reward"),
    ("loo", {}, {"value": "k1", "baseline": "loo"}, "in_reward"),
    ("naive_mc", {}, {"value": "k1", "ratio": "none"}, "in_loss"),
    ("naive_mc", {}, {"value": "k1"}, "in_loss"),
    ("naive_cv", {}, {"value": "k3"}, "in_loss"),
    ("naive_cv", {"lam": 0.3}, {"value": "cv", "lam": 0.3}, "in_loss"),
    ("naive_cv", {"lam": 2.0, "level": "sequence"}, {"value": "cv", "lam": 2.0, "level": "sequence", "ratio": "none"},
     "in_loss"),
]


@pytest.mark.parametrize("old,old_opts,opts,new", SAME, ids=[f"{o}{oo}={n}{p}" for o, oo, p, n in SAME])
def test_known_names_equal_their_cells(old, old_opts, opts, new):
    model, theta = default_instances()[2]
    batch = _all_sequences(model, theta, pairs=True)
    a, b = gradient_estimator(old, **old_opts)(batch), gradient_estimator(new, **opts)(batch)
    torch.testing.assert_close(b, a, rtol=0, atol=0)  # the same arithmetic, so bit for bit


def test_in_loss_k2_has_the_token_gradient_per_sample():
    model, theta = default_instances()[2]
    t = theta.clone().requires_grad_()
    batch = model.batch(t, torch.arange(model.N))
    ga = torch.autograd.grad(gradient_estimator("in_loss", value="k2")(batch).sum(), t, retain_graph=True)[0]
    gb = torch.autograd.grad(gradient_estimator("token")(batch).sum(), t)[0]
    torch.testing.assert_close(ga, gb, rtol=0, atol=1e-12)


# ---- options ----

@pytest.mark.parametrize("name,opts,msg", [
    ("in_reward", {"value": "k4"}, "value must be one of 'k1', 'k2', 'k3', 'cv'"),
    ("in_reward", {"form": "token"}, "form must be one of 'sequence', 'reward_to_go'"),
    ("in_reward", {"baseline": "mean"}, "baseline must be one of 'none', 'loo'"),
    ("in_reward", {"value": "k1", "lam": 0.5}, "lam and level apply to value='cv' only"),
    ("in_reward", {"value": "cv", "level": "sequence", "form": "reward_to_go"}, "needs a per-token value"),
    ("in_reward", {"max_weight": 0}, "max_weight must be None or a positive number"),
    ("in_loss", {"ratio": "prefix"}, "ratio must be one of 'none', 'token', 'sequence'"),
    ("in_loss", {"ratio_grad": "yes"}, "ratio_grad must be one of 'detached', 'differentiable'"),
    ("in_loss", {"ratio": "none", "ratio_grad": "differentiable"}, "ratio='none' has no ratio"),
    ("in_loss", {"ratio": "none", "max_weight": 2.0}, "ratio='none' has no ratio"),
    ("in_loss", {"value": "cv", "level": "sequence"}, "ratio='token' needs a per-token value"),
    ("in_loss", {"alpha": 1}, r"unknown option\(s\) \['alpha'\]"),
])
def test_bad_options(name, opts, msg):
    with pytest.raises(ValueError, match=msg):
        gradient_estimator(name, **opts)


def test_loo_baseline_needs_groups():
    model, theta = default_instances()[0]
    batch = model.batch(theta, torch.arange(4))
    with pytest.raises(ValueError, match="baseline='loo' needs KLBatch.group"):
        gradient_estimator("in_reward", baseline="loo")(batch)
    with pytest.raises(ValueError, match=r"group sizes found: \[1, 3\]"):
        gradient_estimator("in_reward", baseline="loo")(model.batch(theta, torch.arange(4),
                                                                    group=torch.tensor([0, 0, 0, 1])))


def test_registered_and_repr():
    assert {"in_reward", "in_loss"} <= set(GRADIENT_ESTIMATORS)
    assert "value='k3'" in repr(gradient_estimator("in_loss", value="k3"))
