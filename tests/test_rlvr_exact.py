"""The GRPO family on the tabular model, exactly (klbench/exact/grpo.py): which objective each advantage and KL
placement follows, and that fusing the KL into the reward before grpo's normalisation follows none."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.exact.grpo import (binary_grpo_coefficient, expected_gradient, grpo_objective, jacobian_asymmetry,
                                rl_surrogate, success_probability)
from klbench.exact.tabular import DTYPE, TabularModel

N_SAMPLES, BETA = 3, 0.3


@pytest.fixture(scope="module")
def setting():
    model = TabularModel(K=3, T=2, eos=0, seed=0)
    theta = model.random_policy(seed=1)
    gen = torch.Generator().manual_seed(2)
    reward = (torch.rand(model.N, generator=gen, dtype=DTYPE) < 0.5).to(DTYPE)  # a 0/1 verifiable reward
    assert 0 < reward.sum() < model.N
    return model, theta, reward


def grads(model, theta, reward):
    """grad E[r], grad p (the same for 0/1 r), grad KL(pi || pi_ref)."""
    t = theta.detach().clone().requires_grad_()
    g_r = torch.autograd.grad(success_probability(model, t, reward), t)[0]
    g_kl = torch.autograd.grad(model.kl_pi_ref(t), t)[0]
    return g_r, g_kl


def field(model, reward, adv, kl_norm, beta=BETA):
    return lambda th: expected_gradient(model, th, reward, N_SAMPLES, rl_surrogate(adv, kl_norm, beta))


def test_rloo_after_and_fused_follow_the_regularised_objective(setting):
    model, theta, reward = setting
    g_r, g_kl = grads(model, theta, reward)
    for kl_norm in ("after", "before"):
        assert torch.allclose(field(model, reward, "rloo", kl_norm)(theta), -(g_r - BETA * g_kl), atol=1e-10)


def test_dr_grpo_shrinks_by_one_minus_one_over_n_where_the_kl_is(setting):
    model, theta, reward = setting
    g_r, g_kl = grads(model, theta, reward)
    s = 1 - 1 / N_SAMPLES
    assert torch.allclose(field(model, reward, "dr_grpo", "after")(theta), -s * g_r + BETA * g_kl, atol=1e-10)
    assert torch.allclose(field(model, reward, "dr_grpo", "before")(theta), -s * (g_r - BETA * g_kl), atol=1e-10)


def test_grpo_after_is_the_gradient_of_F_n_of_accuracy_minus_beta_kl(setting):
    model, theta, reward = setting
    g_r, g_kl = grads(model, theta, reward)
    p = float(success_probability(model, theta, reward))
    c = binary_grpo_coefficient(p, N_SAMPLES)
    assert torch.allclose(field(model, reward, "grpo", "after")(theta), -c * g_r + BETA * g_kl, atol=1e-10)
    # F_n' = c_n: the closed-form integral against a central difference
    h = 1e-6
    assert math.isclose((grpo_objective(p + h, N_SAMPLES) - grpo_objective(p - h, N_SAMPLES)) / (2 * h), c,
                        rel_tol=1e-6)
    # at n = 3, c_n is the constant 2/sqrt(3) (up to eps): grpo is then RLOO's gradient scaled; from n = 4 on it
    # weighs accuracy by how near 0 or 1 it is (F_n is not linear in p)
    assert all(math.isclose(binary_grpo_coefficient(q, 3), 2 / math.sqrt(3), rel_tol=1e-5) for q in (0.05, 0.5, 0.9))
    assert binary_grpo_coefficient(0.5, 8) < binary_grpo_coefficient(0.05, 8) - 0.5


def test_frpo_return_to_go_after_grpo_is_the_same_objective(setting):
    """estimator=frpo (k1's return-to-go after the normalisation) has the sequence placement's expected gradient."""
    model, theta, reward = setting
    g_r, g_kl = grads(model, theta, reward)
    c = binary_grpo_coefficient(float(success_probability(model, theta, reward)), N_SAMPLES)
    frpo = expected_gradient(model, theta, reward, N_SAMPLES, rl_surrogate("grpo", "after", BETA, form="reward_to_go"))
    assert torch.allclose(frpo, -c * g_r + BETA * g_kl, atol=1e-10)


def test_fusing_before_grpo_normalisation_is_the_gradient_of_no_objective(setting):
    model, theta, reward = setting
    after = jacobian_asymmetry(field(model, reward, "grpo", "after"), theta)
    fused = jacobian_asymmetry(field(model, reward, "grpo", "before"), theta)
    assert after < 1e-6, after  # a gradient field (F_n(p) - beta KL)
    assert fused > 1e-2, fused  # no function has this gradient
    # and with rloo fusing changes nothing, so both are gradient fields
    assert jacobian_asymmetry(field(model, reward, "rloo", "before"), theta) < 1e-6


def test_grpo_fused_is_not_after_at_any_beta(setting):
    """Not a rescaled beta either: the fused field leaves the plane of grad p and grad KL."""
    model, theta, reward = setting
    g_r, g_kl = grads(model, theta, reward)
    g = field(model, reward, "grpo", "before")(theta).reshape(-1)
    basis = torch.stack([g_r.reshape(-1), g_kl.reshape(-1)], 1)  # [D, 2]
    coef = torch.linalg.lstsq(basis, g.unsqueeze(-1)).solution
    resid = torch.linalg.norm(basis @ coef - g.unsqueeze(-1)) / torch.linalg.norm(g)
    assert resid > 1e-3, float(resid)


def test_aggregation_cells_of_the_audit_in_klbench_terms():
    """What moves TRL's loss_type=grpo cell to "none of the above" and scales dr_grpo's (docs/rlvr.md): the same
    KL loss (k3 in the loss, TRL's use_bias_correction_kl=False) aggregated as seq_sum, seq_mean_token_mean
    (1/|y| per sequence: a sample-dependent weight) and seq_sum_norm (a constant 1/L_max)."""
    from klbench.estimators import gradient_estimator
    from klbench.estimators.advantages import aggregate
    from klbench.estimators.placement import value_terms
    from klbench.exact.tabular import audit

    def per_sequence(kind):
        def loss(batch):  # [B]: each sequence aggregated on its own, as the audit calls a library per sequence
            terms, _ = value_terms(batch, "k3", 1.0, "token")  # [B, T]
            return torch.stack([aggregate(terms[i:i + 1], batch.mask[i:i + 1], kind, max_len=8)
                                for i in range(len(terms))])
        return loss

    assert audit(lambda b: gradient_estimator("in_loss", value="k3", ratio="none")(b)).match == "partial_kl_ref_pi"
    assert audit(per_sequence("seq_sum")).match == "partial_kl_ref_pi"
    assert audit(per_sequence("seq_sum_norm")).match == "0.125 x partial_kl_ref_pi"
    assert audit(per_sequence("seq_mean_token_mean")).match == "none of the above"
