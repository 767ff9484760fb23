"""Exact (enumerated, noise-free) checks of every expected-gradient and expected-value claim in docs/kl-math.md.

Run with -s to see the variance figures that docs/estimators.md quotes.
"""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import gradient_estimator, value_estimator
from klbench.exact.examples import grpo_k3_bias_corrected_loss, grpo_k3_loss, k2_mse_loss, rloo_k1_in_reward_loss
from klbench.exact.tabular import TabularModel, audit, default_instances

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-9


def _instances() -> list[tuple[str, TabularModel, torch.Tensor]]:
    """The audit's three default instances plus two more: a sharp policy without EOS, a flat one with EOS."""
    out = [(f"default{i}(K={m.K},T={m.T},eos={m.eos})", m, th) for i, (m, th) in enumerate(default_instances())]
    sharp = TabularModel(5, 2, eos=None, seed=11)
    out.append(("sharp(K=5,T=2,eos=None)", sharp, sharp.random_policy(seed=12, scale=2.0)))
    flat = TabularModel(3, 3, eos=2, seed=13)
    out.append(("flat(K=3,T=3,eos=2)", flat, flat.random_policy(seed=14, scale=0.5)))
    return out


def _label(model: TabularModel) -> str:
    return f"K={model.K} T={model.T} eos={model.eos}"


INSTANCES = _instances()
IDS = [name for name, _, _ in INSTANCES]


@pytest.fixture(params=INSTANCES, ids=IDS)
def instance(request):
    _, model, theta = request.param
    return model, theta, model.exact_gradients(theta)


def test_instances_cover_eos_and_separate_partial_from_full():
    assert any(m.eos is None for _, m, _ in INSTANCES) and any(m.eos is not None for _, m, _ in INSTANCES)
    # pitfall 3 is only visible where the prefix-fixed gradient differs from the full one
    rel = []
    for _, m, th in INSTANCES:
        g = m.exact_gradients(th)
        rel.append(float((g["partial_kl_pi_ref"] - g["kl_pi_ref"]).norm() / g["kl_pi_ref"].norm()))
    assert max(rel) > 0.1, rel


def _assert_grad(model, theta, est, expected, n=1):
    mean = model.gradient_moments(est, theta, n=n).mean
    assert mean.shape == expected.shape
    err = float((mean - expected).abs().max())
    assert err <= TOL, f"{est!r}: max |E[g] - expected| = {err:.3e}"


# ---- gradient estimators: E[g] equals the docs/kl-math.md statement ----

@pytest.mark.parametrize("name", ["seq", "cumulative", "rb"])
def test_unbiased_gradient_estimators(instance, name):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator(name), g["kl_pi_ref"])


def test_naive_mc_expects_zero(instance):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator("naive_mc"), g["zero"])


def test_token_is_the_prefix_fixed_partial_gradient(instance):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator("token"), g["partial_kl_pi_ref"])


@pytest.mark.parametrize("lam", [1.0, 0.3, 2.0, 0.0])
def test_naive_cv_sequence_is_lam_times_kl_ref_pi(instance, lam):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator("naive_cv", level="sequence", lam=lam), lam * g["kl_ref_pi"])


@pytest.mark.parametrize("lam", [1.0, 0.3, 2.0])
def test_naive_cv_token_is_lam_times_partial_kl_ref_pi(instance, lam):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator("naive_cv", level="token", lam=lam), lam * g["partial_kl_ref_pi"])


def test_loo_n2(instance):
    model, theta, g = instance
    _assert_grad(model, theta, gradient_estimator("loo"), g["kl_pi_ref"], n=2)


@pytest.mark.parametrize("which", ["small", "default0"])
def test_loo_n3(which):
    if which == "small":
        model = TabularModel(3, 2, eos=0, seed=21)
        theta = model.random_policy(seed=22)
    else:
        _, model, theta = INSTANCES[0]
    _assert_grad(model, theta, gradient_estimator("loo"), model.exact_gradients(theta)["kl_pi_ref"], n=3)


# ---- value estimators ----

UNBIASED_VALUES = [("mc", {}), ("rb", {})] + [("cv", {"level": lv, "lam": lam})
                                              for lv in ("token", "sequence") for lam in (1.0, 0.3, 2.0)]


@pytest.mark.parametrize("name,opts", UNBIASED_VALUES, ids=[f"{n}{o}" for n, o in UNBIASED_VALUES])
def test_unbiased_values(instance, name, opts):
    model, theta, _ = instance
    mean = model.value_moments(value_estimator(name, **opts), theta).mean
    assert abs(float(mean - model.kl_pi_ref(theta))) <= TOL


def test_k2_is_biased(instance):
    model, theta, _ = instance
    mean = model.value_moments(value_estimator("k2"), theta).mean
    assert abs(float(mean - model.kl_pi_ref(theta))) > 1e-3


def test_rb_value_variance_at_most_mc(instance):
    model, theta, _ = instance
    rb = model.value_moments(value_estimator("rb"), theta).trace
    mc = model.value_moments(value_estimator("mc"), theta).trace
    print(f"\n{_label(model)} value variance: rb {rb:.4f}  mc {mc:.4f}  rb/mc {rb / mc:.3f}")
    assert rb <= mc


def test_cv_opt_runs_on_tuples(instance):
    model, theta, _ = instance
    # lam* is fitted on each 2-sample batch, so the estimate is biased; it must still be a finite number
    mo = model.value_moments(value_estimator("cv_opt"), theta, n=2)
    assert torch.isfinite(mo.mean) and mo.trace >= 0


# ---- variance ordering of the unbiased gradient family ----

def test_gradient_variance_rb_cumulative_seq(instance):
    model, theta, _ = instance
    tr = {n: model.gradient_moments(gradient_estimator(n), theta).trace for n in ("rb", "cumulative", "seq")}
    print(f"\n{_label(model)} gradient cov trace: rb {tr['rb']:.4f}  cumulative {tr['cumulative']:.4f}  "
          f"seq {tr['seq']:.4f}")
    assert tr["rb"] <= tr["cumulative"] <= tr["seq"]


# ---- the audit names the right target ----

@pytest.mark.parametrize("est,verdict", [
    (gradient_estimator("naive_cv", level="token"), "partial_kl_ref_pi"),
    (gradient_estimator("naive_cv", level="sequence", lam=0.3), "0.3 x kl_ref_pi"),
    (gradient_estimator("token"), "partial_kl_pi_ref"),
    (gradient_estimator("rb"), "kl_pi_ref"),
    (gradient_estimator("naive_mc"), "zero"),
], ids=["naive_cv_token", "naive_cv_seq_0.3", "token", "rb", "naive_mc"])
def test_audit_verdicts(est, verdict):
    assert audit(est).match == verdict


def _squared_ratio_score(batch):
    # REINFORCE with sg(rho_t)^2 as the per-token reward: follows no KL gradient
    return (batch.rho.detach() ** 2 * batch.masked_logp).sum(-1)


def test_audit_rejects_a_loss_that_matches_nothing():
    report = audit(_squared_ratio_score)
    assert report.match == "none of the above"
    assert {r.candidate for r in report.rows} == {"kl_pi_ref", "kl_ref_pi", "partial_kl_pi_ref",
                                                  "partial_kl_ref_pi", "zero"}


def test_audit_grpo_k3_is_partial_kl_ref_pi():
    report = audit(grpo_k3_loss)
    print(f"\nGRPO k3 in the loss:\n{report}")
    assert report.match == "partial_kl_ref_pi"


def test_audit_rloo_k1_in_reward_is_kl_pi_ref():
    report = audit(rloo_k1_in_reward_loss, n=2)
    print(f"\nRLOO k1 in the reward (n=2):\n{report}")
    assert report.match == "kl_pi_ref"


def test_rloo_example_equals_loo_estimator():
    # with zero reward and beta=1 the RLOO loss is the klbench `loo` surrogate, sample by sample
    model, theta = default_instances()[1]
    rows = torch.arange(model.N)
    group = rows % (model.N // 2)  # pairs (and one triple when N is odd)
    batch = model.batch(theta, rows, group=group)
    torch.testing.assert_close(rloo_k1_in_reward_loss(batch), gradient_estimator("loo")(batch), rtol=0, atol=1e-12)


@pytest.mark.parametrize("loss", [grpo_k3_bias_corrected_loss, k2_mse_loss], ids=["grpo_bias_corrected", "k2_mse"])
def test_audit_per_token_ratio_losses_are_token(loss):
    # docs/kl-math.md's table puts both on `token`: rho_t * grad l_t per token
    assert audit(loss).match == "partial_kl_pi_ref"


def test_audit_clamped_k3_follows_partial_kl_ref_pi_only_while_no_clamp_fires():
    # verl low_var_kl / OpenRLHF clamp k3 to [-10, 10]; a clamped token contributes no gradient at all
    assert audit(gradient_estimator("naive_cv", clamp=1e3)).match == "partial_kl_ref_pi"
    report = audit(gradient_estimator("naive_cv", clamp=10.0))
    assert report.match == "none of the above"
    assert max(report.rows, key=lambda r: r.cosine if r.candidate != "zero" else -1).candidate == "partial_kl_ref_pi"


# ---- the variance orderings are not laws: exact counterexamples ----

def test_variance_orderings_can_reverse():
    """rb's value variance below mc's, and rb <= cumulative <= seq for the gradient, hold on the instances above
    but are not theorems: rb = sum_t E[rho_t | y_<t] conditions each term on a different prefix, and the kappa of
    later positions can co-vary with the earlier log-ratios that mc's sum lets cancel. On this instance (K=3, T=3,
    eos=0, reference and policy at scale 2) every ordering reverses, exactly."""
    model = TabularModel(3, 3, eos=0, seed=7, ref_scale=2.0)
    theta = model.random_policy(seed=1007, scale=2.0)
    rb = model.value_moments(value_estimator("rb"), theta).trace
    mc = model.value_moments(value_estimator("mc"), theta).trace
    tr = {n: model.gradient_moments(gradient_estimator(n), theta).trace for n in ("rb", "cumulative", "seq")}
    print(f"\nvalue variance rb {rb:.4f} mc {mc:.4f}; gradient tr Cov rb {tr['rb']:.4f} "
          f"cumulative {tr['cumulative']:.4f} seq {tr['seq']:.4f}")
    assert rb > 4 * mc
    assert tr["rb"] > tr["cumulative"] > tr["seq"]
    # both still unbiased
    assert abs(float(model.value_moments(value_estimator("rb"), theta).mean - model.kl_pi_ref(theta))) <= TOL
