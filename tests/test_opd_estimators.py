"""The OPD estimators (klbench/estimators/opd.py), each docstring's expected gradient checked exactly on the
tabular model: RL instances (a random pi_ref) and distillation instances (a sharper teacher as pi_ref, a
flatter student), on-policy; their variance against rb; and topk_trunc's bias, which is the point of it."""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import KLBatch, gradient_estimator
from klbench.estimators.sampling import Sampling
from klbench.exact.tabular import TabularModel, audit, default_instances


def distill_instances() -> list:
    """Student far from a peaked teacher, as at the start of distillation; two of three with EOS."""
    out = []
    for seed, (K, T, eos) in enumerate([(3, 3, None), (4, 3, 0), (3, 4, 0)]):
        teacher = TabularModel(K, T, eos=eos, seed=500 + seed, ref_scale=3.0)
        out.append((teacher, teacher.random_policy(seed=600 + seed, scale=0.5)))
    return out


SETS = {"rl": default_instances, "distill": distill_instances}
CASES = [("vopd", {}, "kl_pi_ref"), ("vopd", {"form": "token"}, "partial_kl_pi_ref"),
         ("topk_tail", {"k": 1}, "kl_pi_ref"), ("topk_tail", {"k": 2}, "kl_pi_ref")]


@pytest.mark.parametrize("task", sorted(SETS))
@pytest.mark.parametrize("name,opts,match", CASES, ids=lambda v: str(v))
def test_expected_gradient_is_the_docstrings(task, name, opts, match):
    assert audit(gradient_estimator(name, **opts), instances=SETS[task](), tol=1e-9).match == match


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.7), Sampling(0.7, top_p=0.9), Sampling(top_k=2)],
                         ids=lambda s: s.describe())
@pytest.mark.parametrize("name,opts,match", CASES, ids=lambda v: str(v))
def test_expected_gradient_on_the_runs_scoring_path(sampling, name, opts, match):
    # the batch a run scores (klbench.estimators.sampling.target_batch: log pi(y_t) as gather - logsumexp, the
    # target sampler's pair), not a log_softmax batch: topk_tail once found the sampled token by exact equality
    # of the two log-probs and counted the k-th head token as tail here ("none of the above", 1.66 off)
    report = audit(gradient_estimator(name, **opts), sampling=sampling, target="sampler", tol=1e-9)
    assert report.match == match, report


def test_topk_tail_at_k_equal_v_is_rb_exactly_and_its_tail_costs_variance():
    for model, theta in default_instances() + distill_instances():
        rb = model.gradient_moments(gradient_estimator("rb"), theta)
        full = model.gradient_moments(gradient_estimator("topk_tail", k=model.K), theta)
        assert torch.allclose(full.mean, rb.mean, atol=1e-12) and abs(full.trace - rb.trace) < 1e-9
        one = model.gradient_moments(gradient_estimator("topk_tail", k=1), theta)
        assert torch.allclose(one.mean, rb.mean, atol=1e-10) and one.trace > rb.trace


def test_vopd_baseline_lowers_the_variance_of_the_score_term_it_corrects():
    for model, theta in default_instances() + distill_instances():
        v = model.gradient_moments(gradient_estimator("vopd"), theta).trace
        assert v < model.gradient_moments(gradient_estimator("cumulative"), theta).trace



def test_vopd_token_form_is_not_always_lower_than_the_same_term_without_its_baseline():
    """form=token against `token` (sum_t sg(rho_t) l_t, the same score term): kappa_t is E[rho_t | y_<t], not
    the variance-optimal baseline (which weighs by |grad l_t|^2), so it helps on the distillation instances,
    where the per-token KL is large, and costs a little on the RL ones (exact traces in docs/opd-estimators.md)."""
    def ratio(model, theta):
        tok = model.gradient_moments(gradient_estimator("vopd", form="token"), theta).trace
        return tok / model.gradient_moments(gradient_estimator("token"), theta).trace

    assert all(ratio(m, th) > 1 for m, th in default_instances())
    assert [ratio(m, th) < 1 for m, th in distill_instances()] == [False, True, True]


def test_topk_trunc_is_biased_below_v_and_the_partial_at_v():
    est = gradient_estimator("topk_trunc", k=1)
    for model, theta in default_instances() + distill_instances():
        exact = model.exact_gradients(theta)
        mean = model.gradient_moments(est, theta).mean
        assert (mean - exact["kl_pi_ref"]).norm() > 0.05 * exact["kl_pi_ref"].norm()
        assert (mean - exact["partial_kl_pi_ref"]).norm() > 0.05 * exact["partial_kl_pi_ref"].norm()
        for head in ("teacher", "policy"):
            full = model.gradient_moments(gradient_estimator("topk_trunc", k=model.K, head=head), theta).mean
            assert torch.allclose(full, exact["partial_kl_pi_ref"], atol=1e-12)
    assert audit(est, instances=distill_instances()).match == "none of the above"


def test_they_refuse_off_policy_samples_and_k_beyond_the_vocabulary():
    model, theta = default_instances()[0]
    batch = model.batch(theta, torch.arange(3), behaviour=theta + model.random_policy(seed=9))
    for name in ("vopd", "topk_tail", "topk_trunc"):
        with pytest.raises(ValueError, match="assumes y ~ pi"):
            gradient_estimator(name)(batch)
    on = model.batch(theta, torch.arange(3))
    with pytest.raises(ValueError, match=r"k=4 exceeds the vocabulary size V=3: k must be <= V"):
        gradient_estimator("topk_tail", k=4)(on)
    assert isinstance(on, KLBatch)
