"""Exact (enumerated) checks of what every gradient and value estimator follows under each KL target
(klbench.estimators.sampling) at T in {0.5, 0.7, 1.5} and under top-k / top-p truncation: docs/sampling.md.

Samples come from pi_s (the tabular table processed as generate() processes logits), batches are built by
target_batch, and the exact truth is that of the target's pair (TabularModel.target_gradients / target_kl).
Run with -s to see the biases that docs/sampling.md quotes (scripts/sampling_bias.py draws them).
"""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import gradient_estimator, value_estimator
from klbench.estimators.placement import value_terms
from klbench.estimators.sampling import Sampling, check_target
from klbench.exact.tabular import (TabularModel, TabularReward, audit, default_instances, optimal_seq_logprob,
                                   pareto_frontier, table_from_seq_logprob)
from klbench.models.policies import TabularPolicy

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 1e-9
TEMPERATURES = [Sampling(temperature=t) for t in (0.5, 0.7, 1.5)]
TRUNCATIONS = [Sampling(top_k=2), Sampling(top_p=0.8), Sampling(temperature=0.7, top_p=0.9)]
SAMPLINGS = TEMPERATURES + TRUNCATIONS
SIDS = [s.describe() for s in SAMPLINGS]


def _instances() -> list[tuple[str, TabularModel, torch.Tensor]]:
    out = [(f"default{i}(K={m.K},T={m.T},eos={m.eos})", m, th) for i, (m, th) in enumerate(default_instances())]
    flat = TabularModel(4, 3, eos=2, seed=13)
    out.append(("flat(K=4,T=3,eos=2)", flat, flat.random_policy(seed=14, scale=0.5)))
    return out


INSTANCES = _instances()


@pytest.fixture(params=INSTANCES, ids=[n for n, _, _ in INSTANCES])
def instance(request):
    return request.param[1:]


def _assert_grad(model, theta, est, expected, sampling, target, n=1):
    mean = model.gradient_moments(est, theta, n=n, sampling=sampling, target=target).mean
    err = float((mean - expected).abs().max())
    assert err <= TOL, f"{est!r} {sampling.describe()} target={target}: max |E[g] - expected| = {err:.3e}"


def grad_mean_value(model, theta, value, sampling, target, lam=1.0, level="token"):
    """Exact grad_theta E_{y ~ pi_s}[v(y; theta)] [P, K], the sampling differentiated too (for the k2 cells)."""
    t = theta.detach().clone().requires_grad_()
    rows = torch.arange(model.N)[model.sample_probs(theta, sampling=sampling) > 0]
    terms, per_token = value_terms(model.batch(t, rows, sampling=sampling, target=target), value, lam, level)
    v = terms.sum(-1) if per_token else terms  # [N']
    p = model.seq_prob(model.target_tables(t, sampling, target)[0])[rows]  # pi_s = the target's policy here
    return torch.autograd.grad((p * v).sum(), t)[0]


def test_the_settings_cut_and_the_candidates_differ():
    # truncation cuts tokens on every instance, and the target's candidate gradients are distinguishable
    for _, m, th in INSTANCES:
        for s in TRUNCATIONS:
            assert not bool(s.keep(th).all()), (s.describe(), m.K)
        for s in SAMPLINGS:
            g = m.exact_gradients(th, sampling=s, target="sampler")
            names = [k for k in g if k != "zero"]
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    assert float((g[a] - g[b]).norm()) > 1e-3 * float(g["kl_pi_ref"].norm()), (s.describe(), a, b)


# ---- targets where y ~ the target's own policy: every T = 1 claim holds with the target's pair ----
# sampler at every setting; tempered = sampler without truncation (checked below); tempered_vs_raw at a
# temperature alone (pi_s = pi_T, compared with the raw pi_ref)

ON_TARGET = [(s, "sampler") for s in SAMPLINGS] + [(s, "tempered_vs_raw") for s in TEMPERATURES]
OIDS = [f"{t}-{s.describe()}" for s, t in ON_TARGET]

CLAIMS = [  # (estimator, options, n, expected gradient from the target's candidates)
    ("seq", {}, 1, lambda g: g["kl_pi_ref"]),
    ("cumulative", {}, 1, lambda g: g["kl_pi_ref"]),
    ("rb", {}, 1, lambda g: g["kl_pi_ref"]),
    ("loo", {}, 2, lambda g: g["kl_pi_ref"]),
    ("naive_mc", {}, 1, lambda g: g["zero"]),
    ("token", {}, 1, lambda g: g["partial_kl_pi_ref"]),
    ("naive_cv", {"lam": 0.3}, 1, lambda g: 0.3 * g["partial_kl_ref_pi"]),
    ("naive_cv", {"level": "sequence", "lam": 2.0}, 1, lambda g: 2.0 * g["kl_ref_pi"]),
    ("in_reward", {"value": "k3"}, 1, lambda g: g["kl_pi_ref"] - g["partial_kl_ref_pi"]),
    ("in_reward", {"value": "k1", "form": "reward_to_go", "baseline": "loo"}, 2, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k2"}, 1, lambda g: g["E_k2"] - g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k2"}, 1, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio_grad": "differentiable"}, 1, lambda g: g["partial_kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k2", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, lambda g: g["E_k2"]),
    # the OPD estimators (klbench/estimators/opd.py); topk_trunc is biased on purpose (tests/test_opd_estimators.py)
    ("vopd", {}, 1, lambda g: g["kl_pi_ref"]),
    ("vopd", {"form": "token"}, 1, lambda g: g["partial_kl_pi_ref"]),
    ("topk_tail", {"k": 1}, 1, lambda g: g["kl_pi_ref"]),
    ("topk_tail", {"k": 2}, 1, lambda g: g["kl_pi_ref"]),
]


def _uses_k3(name: str, opts: dict) -> bool:
    return name in ("naive_cv", "cv") or opts.get("value") == "k3"


@pytest.mark.parametrize("sampling,target", ON_TARGET, ids=OIDS)
def test_every_gradient_claim_holds_on_target(instance, sampling, target):
    # under truncation the sampler target's reference keeps its whole vocabulary, so k3's E[pi_ref / pi_s] = 1
    # fails and the claims built on it with it (test_k3_under_truncation_is_biased_by_the_cut_reference_mass)
    model, theta = instance
    g = model.exact_gradients(theta, sampling=sampling, target=target)
    g["E_k2"] = grad_mean_value(model, theta, "k2", sampling, target)
    for name, opts, n, expected in CLAIMS:
        if sampling.truncates and _uses_k3(name, opts):
            continue
        _assert_grad(model, theta, gradient_estimator(name, **opts), expected(g), sampling, target, n=n)


UNBIASED_VALUES = [("mc", {}), ("rb", {}), ("cv", {}), ("cv", {"level": "sequence", "lam": 0.3})]


@pytest.mark.parametrize("sampling,target", ON_TARGET, ids=OIDS)
def test_values_are_unbiased_for_the_target_kl(instance, sampling, target):
    model, theta = instance
    kl = float(model.target_kl(theta, sampling, target))
    for name, opts in UNBIASED_VALUES:
        if sampling.truncates and _uses_k3(name, opts):
            continue
        mean = float(model.value_moments(value_estimator(name, **opts), theta, sampling=sampling, target=target).mean)
        assert abs(mean - kl) <= TOL, (name, opts, mean, kl)
    k2 = float(model.value_moments(value_estimator("k2"), theta, sampling=sampling, target=target).mean)
    assert abs(k2 - kl) > 1e-3  # k2 stays biased


@pytest.mark.parametrize("sampling", TEMPERATURES, ids=[s.describe() for s in TEMPERATURES])
def test_tempered_is_the_sampler_target_without_truncation(instance, sampling):
    model, theta = instance
    rows = torch.arange(model.N)
    a = model.batch(theta, rows, sampling=sampling, target="sampler")
    b = model.batch(theta, rows, sampling=sampling, target="tempered")
    for key in ("logp", "ref_logp", "logits", "ref_logits"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert a.old_logp is None and b.old_logp is None


def test_plain_sampling_is_the_plain_batch(instance):
    # at T = 1 without truncation every target is the one pair, scored as before (up to the last bit or two)
    model, theta = instance
    rows = torch.arange(model.N)
    plain = model.batch(theta, rows)
    for target in ("sampler", "model", "tempered", "tempered_vs_raw"):
        b = model.batch(theta, rows, sampling=Sampling(), target=target)
        torch.testing.assert_close(b.logp, plain.logp, rtol=0, atol=1e-14)
        assert torch.equal(b.logits, plain.logits) and b.old_logp is None


# ---- target=model: pi_s is a behaviour policy; only the off-policy estimators serve, and they are exact ----

MODEL_CLAIMS = [
    ("rb", {}, 1, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1"}, 1, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1", "form": "reward_to_go"}, 1, lambda g: g["kl_pi_ref"]),
    ("in_reward", {"value": "k1", "baseline": "loo"}, 2, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k1", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, 1, lambda g: g["kl_pi_ref"]),
    ("in_loss", {"value": "k2"}, 1, lambda g: g["partial_kl_pi_ref@old"]),
    ("in_loss", {"value": "k3"}, 1, lambda g: g["partial_kl_ref_pi@old"]),
    ("in_loss", {"value": "k3", "ratio_grad": "differentiable"}, 1, lambda g: g["partial_kl_pi_ref@old"]),
    ("in_loss", {"value": "k3", "ratio": "sequence"}, 1, lambda g: g["partial_kl_ref_pi"]),
]
ON_POLICY_ONLY = ["seq", "cumulative", "loo", "token", "naive_mc", "naive_cv"]


@pytest.mark.parametrize("sampling", TEMPERATURES, ids=[s.describe() for s in TEMPERATURES])
def test_model_target_off_policy_estimators_are_exact(instance, sampling):
    model, theta = instance
    g = model.exact_gradients(theta, sampling=sampling, target="model")
    plain = model.exact_gradients(theta)
    torch.testing.assert_close(g["kl_pi_ref"], plain["kl_pi_ref"], rtol=0, atol=1e-12)  # the untempered KL
    for name, opts, n, expected in MODEL_CLAIMS:
        _assert_grad(model, theta, gradient_estimator(name, **opts), expected(g), sampling, "model", n=n)


@pytest.mark.parametrize("sampling", TEMPERATURES, ids=[s.describe() for s in TEMPERATURES])
def test_model_target_on_policy_estimators_refuse(sampling):
    model, theta = default_instances()[1]
    for name in ON_POLICY_ONLY:
        with pytest.raises(ValueError, match="assumes y ~ pi"):
            model.gradient_moments(gradient_estimator(name), theta, n=2, sampling=sampling, target="model")
    for name in ("mc", "k2", "cv", "cv_opt"):  # every value estimator but rb assumes y ~ pi
        with pytest.raises(ValueError, match="assumes y ~ pi"):
            model.value_moments(value_estimator(name), theta, n=2, sampling=sampling, target="model")


@pytest.mark.parametrize("sampling", TEMPERATURES, ids=[s.describe() for s in TEMPERATURES])
def test_model_target_rb_value_is_unbiased(instance, sampling):
    # rb weights each position's exact KL by its prefix's importance ratio: what val/seq_kl reads at target=model
    model, theta = instance
    mean = model.value_moments(value_estimator("rb"), theta, sampling=sampling, target="model").mean
    assert abs(float(mean - model.kl_pi_ref(theta))) <= TOL


@pytest.mark.parametrize("sampling", TRUNCATIONS, ids=[s.describe() for s in TRUNCATIONS])
def test_model_target_under_truncation_is_refused(sampling):
    model, theta = default_instances()[0]
    with pytest.raises(ValueError, match="task.kl_target=model .* no importance weight"):
        model.gradient_moments(gradient_estimator("rb"), theta, sampling=sampling, target="model")
    with pytest.raises(ValueError, match="task.kl_target=model"):
        TabularPolicy(model, sampling=sampling, kl_target="model")


# ---- tempered targets under truncation: samples from pi_s != pi_T, every estimator biased (measured) ----

BIASED_GRADIENTS = [("seq", {}, 1), ("cumulative", {}, 1), ("loo", {}, 2), ("rb", {}, 1),
                    ("in_reward", {"value": "k1"}, 1),
                    ("in_loss", {"value": "k3", "ratio": "sequence", "ratio_grad": "differentiable"}, 1)]


def bias_table(model, theta, sampling, target) -> dict[str, float]:
    """Relative bias |E[g] - grad KL| / |grad KL| of the kl_pi_ref gradient estimators, and (E[v] - KL) / KL of
    the unbiased-on-target values, against the target's exact KL (what docs/sampling.md tabulates)."""
    g = model.exact_gradients(theta, sampling=sampling, target=target)["kl_pi_ref"]
    out = {}
    for name, opts, n in BIASED_GRADIENTS:
        mean = model.gradient_moments(gradient_estimator(name, **opts), theta, n=n, sampling=sampling,
                                      target=target).mean
        out[f"grad {name}{opts or ''}"] = float((mean - g).norm() / g.norm())
    kl = float(model.target_kl(theta, sampling, target))
    for name, opts in UNBIASED_VALUES:
        v = model.value_moments(value_estimator(name, **opts), theta, sampling=sampling, target=target).mean
        out[f"value {name}{opts or ''}"] = (float(v) - kl) / kl
    return out


@pytest.mark.parametrize("target", ["tempered", "tempered_vs_raw"])
@pytest.mark.parametrize("sampling", TRUNCATIONS, ids=[s.describe() for s in TRUNCATIONS])
def test_tempered_targets_under_truncation_are_biased(instance, sampling, target):
    model, theta = instance
    assert "biased" in check_target(sampling, target)
    table = bias_table(model, theta, sampling, target)
    print(f"\n{target} {sampling.describe()} K={model.K} T={model.T}: "
          + "  ".join(f"{k} {v:+.3f}" for k, v in table.items()))
    for key, bias in table.items():
        assert abs(bias) > 1e-3, (key, bias)  # every one of them is off its target


def test_audit_names_the_target_pair():
    s = Sampling(temperature=0.7, top_p=0.9)
    assert audit(gradient_estimator("rb"), sampling=s, target="sampler").match == "kl_pi_ref"
    assert audit(gradient_estimator("token"), sampling=s, target="sampler").match == "partial_kl_pi_ref"
    assert audit(gradient_estimator("rb"), sampling=s, target="tempered").match == "none of the above"
    report = audit(gradient_estimator("in_loss", value="k3"), sampling=Sampling(0.5), target="model")
    assert report.match == "partial_kl_ref_pi@old" and report.off_policy
    assert str(report).startswith("samples from pi_s (temperature=0.5, task.kl_target=model)")


# ---- the sampler target under truncation: pi_s against the whole tempered reference ----

@pytest.mark.parametrize("sampling", TRUNCATIONS, ids=[s.describe() for s in TRUNCATIONS])
def test_k3_under_truncation_is_biased_by_the_cut_reference_mass(instance, sampling):
    # KL(pi_s || pi_ref,T): E_{pi_s}[pi_ref,T / pi_s] = Z_t, the reference mass on the kept tokens, not 1, so k3
    # (rho + r - 1 per token) is biased by exactly E_{pi_s}[sum_t (Z_t - 1)] < 0; mc and rb stay exact (above)
    model, theta = instance
    kl = float(model.target_kl(theta, sampling, "sampler"))
    ref_t = model.ref_logits / sampling.temperature
    z = torch.softmax(ref_t, -1).masked_fill(~sampling.keep(theta), 0).sum(-1)  # [P] kept reference mass
    bias = float((model.reach(model.sampler_table(theta, sampling)) * (z - 1)).sum())
    k3 = float(model.value_moments(value_estimator("cv"), theta, sampling=sampling, target="sampler").mean)
    assert k3 - kl == pytest.approx(bias, abs=TOL) and bias < -1e-3
    assert "k3" in check_target(sampling, "sampler")


def test_the_sampler_target_charges_a_policy_that_keeps_one_token():
    # a sharp policy whose top-p set is one token on every prefix it reaches pays -log pi_ref,T of those tokens,
    # which a reference restricted to the kept set (and renormalised there) would forgive entirely
    s = Sampling(temperature=0.7, top_p=0.9)
    for model, theta in default_instances():
        sharp = 30 * theta
        reach = model.reach(model.sampler_table(sharp, s))  # [P]
        assert bool((s.keep(sharp).sum(-1)[reach > 0] == 1).all())
        ref_t = torch.log_softmax(model.ref_logits / 0.7, -1)  # [P, K]
        charged = float(-(reach.unsqueeze(-1) * torch.softmax(model.sampler_table(sharp, s), -1) * ref_t).sum())
        assert float(model.target_kl(sharp, s, "sampler")) == pytest.approx(charged, rel=1e-9) and charged > 1


# ---- the tinker-cookbook #689 pairing: KL(pi_T || pi_ref) ----

@pytest.mark.parametrize("sampling", TEMPERATURES, ids=[s.describe() for s in TEMPERATURES])
def test_tempered_vs_raw_pairing_moves_the_policy_off_its_reference(instance, sampling):
    model, _ = instance
    ref, t = model.ref_logits, sampling.temperature
    # at pi = pi_ref the sampler's own KL is 0 with a zero gradient; the pairing's is > 0 and pushes pi away
    assert float(model.target_kl(ref, sampling, "sampler")) == pytest.approx(0, abs=1e-12)
    g0 = model.exact_gradients(ref, sampling=sampling, target="sampler")["kl_pi_ref"]
    assert float(g0.abs().max()) <= 1e-12
    assert float(model.target_kl(ref, sampling, "tempered_vs_raw")) > 1e-3
    g = model.exact_gradients(ref, sampling=sampling, target="tempered_vs_raw")["kl_pi_ref"]
    assert float(g.norm()) > 1e-3
    # its minimum, KL = 0, is theta = T * pi_ref's logits: pi_T = pi_ref, and the model itself sits at
    # KL(pi || pi_ref) > 0 (sharpened at T < 1, flattened at T > 1): the pairing's cost without any reward
    fixed = t * ref
    assert float(model.target_kl(fixed, sampling, "tempered_vs_raw")) == pytest.approx(0, abs=1e-12)
    assert float(model.exact_gradients(fixed, sampling=sampling, target="tempered_vs_raw")["kl_pi_ref"].abs().max()) \
        <= 1e-12
    assert float(model.kl_pi_ref(fixed)) > 1e-3


# ---- TabularPolicy samples pi_s and scores the target ----

def test_tabular_policy_samples_pi_s_and_scores_the_target():
    model, theta = default_instances()[1]
    s = Sampling(temperature=0.7, top_p=0.9)
    policy = TabularPolicy(model, theta, sampling=s, kl_target="sampler")
    torch.manual_seed(0)
    ro = policy.rollout(["<tabular>"], 4000)
    probs = model.sample_probs(theta, sampling=s)  # [N]
    assert bool((probs[ro.seq_ids] > 0).all())  # never a sequence through a cut token
    assert int((probs == 0).sum()) > 0 and int((probs > 0).sum()) < model.N
    freq = torch.bincount(ro.seq_ids, minlength=model.N).double() / len(ro.seq_ids)
    # multinomial noise at 4000 draws: every frequency within 5 standard errors of pi_s
    assert bool(((freq - probs).abs() <= 5 * (probs * (1 - probs) / 4000).sqrt() + 1e-12).all())
    batch = policy.score(ro)
    ref = model.batch(theta, ro.seq_ids, sampling=s, target="sampler")
    assert torch.equal(batch.logp, ref.logp) and torch.equal(batch.ref_logp, ref.ref_logp)
    exact = policy.exact_metrics()
    assert exact["seq_kl"] == pytest.approx(float(model.target_kl(theta, s, "sampler")), abs=1e-12)
    assert exact["model_kl"] == pytest.approx(float(model.kl_pi_ref(theta)), abs=1e-12)
    g = policy.exact_gradients()
    torch.testing.assert_close(g["kl_pi_ref"], model.target_gradients(theta, s, "sampler")["kl_pi_ref"])


def test_tabular_policy_plain_sampling_is_unchanged():
    model, theta = default_instances()[0]
    policy = TabularPolicy(model, theta)
    torch.manual_seed(3)
    ro = policy.rollout(["<tabular>"], 64)
    torch.manual_seed(3)
    ids = torch.multinomial(model.seq_logprob(theta).exp(), 64, replacement=True)
    assert torch.equal(ro.seq_ids, ids)
    b = policy.score(ro)
    assert b.old_logp is None and set(policy.exact_metrics()) == {"seq_kl", "kl_ref_pi"}


@pytest.mark.parametrize("target", ["sampler", "tempered", "tempered_vs_raw"])
def test_tempered_frontier_is_reached_by_the_tempered_optimum(target):
    # temperature alone: pi_T ranges over every table, so the optimum of E_{pi_T}[r] - beta KL(pi_T || q) is
    # q exp(r / beta) normalised, q = pi_ref,T (sampler, tempered) or pi_ref (tempered_vs_raw); theta = T x
    # its logits puts the run on the frontier, gap 0 (at a beta of the frontier's grid: no interpolation)
    model = TabularModel(3, 3, eos=0, seed=101)
    reward = TabularReward(model, seed=5)
    s = Sampling(temperature=0.7)
    q = model if target == "tempered_vs_raw" else TabularModel(3, 3, model.ref_logits / 0.7, eos=0)
    beta = float(TabularPolicy(model, sampling=s, kl_target=target).exact_frontier(reward).betas[200])
    opt = table_from_seq_logprob(q, optimal_seq_logprob(q, reward.table, beta))  # [P, K] the sampler's optimum
    policy = TabularPolicy(model, 0.7 * opt, sampling=s, kl_target=target)
    m = policy.exact_metrics(reward)
    assert abs(m["frontier_gap"]) <= 1e-6
    off = TabularPolicy(model, model.random_policy(seed=9), sampling=s, kl_target=target).exact_metrics(reward)
    assert off["frontier_gap"] > 1e-3


def test_no_frontier_where_it_has_no_closed_form():
    model = TabularModel(3, 3, eos=0, seed=101)
    reward = TabularReward(model, seed=5)
    for s, target in [(Sampling(0.7), "model"), (Sampling(top_p=0.8), "sampler"), (Sampling(top_k=2), "tempered")]:
        m = TabularPolicy(model, model.random_policy(seed=9), sampling=s, kl_target=target).exact_metrics(reward)
        assert "frontier_gap" not in m and "reward" in m, (s, target)
        if target == "model":  # seq_kl is the model's KL: no second key for it
            assert "model_kl" not in m and m["seq_kl"] == pytest.approx(float(model.kl_pi_ref(model.random_policy(
                seed=9))), abs=1e-12)


def test_the_frontier_cache_follows_the_sampling():
    # a shallow copy of the policy with another sampling (a view that samples pi itself) gets its own frontier
    import copy
    model = TabularModel(3, 3, eos=0, seed=101)
    reward = TabularReward(model, seed=5)
    policy = TabularPolicy(model, sampling=Sampling(0.7), kl_target="sampler")
    tempered = policy.exact_frontier(reward)
    view = copy.copy(policy)
    view.sampling = Sampling()
    plain = view.exact_frontier(reward)
    assert not torch.equal(tempered.kls, plain.kls)
    torch.testing.assert_close(plain.kls, pareto_frontier(model, reward.table).kls, rtol=0, atol=0)


def test_audit_targets_names_the_pair_a_scoring_follows():
    """audit_targets (the audit's sampling axis): a loss that scores the raw logits itself is audited against every
    target's candidates. REINFORCE on k1 with both logits divided by T follows the sampler = tempered pair; with only
    the policy's divided, tempered_vs_raw; undivided, nothing; `model` is not a candidate under truncation."""
    from klbench.estimators.sampling import token_logprob
    from klbench.exact.tabular import audit_targets

    def k1_reinforce(t_policy, t_ref):
        def loss(batch):
            lp = token_logprob(batch.logits / t_policy, batch.tokens)  # [B, T]
            rp = token_logprob(batch.ref_logits / t_ref, batch.tokens)
            zero = torch.zeros((), dtype=lp.dtype)
            k1 = torch.where(batch.mask, lp - rp, zero).sum(-1)
            return torch.where(batch.mask, lp, zero).sum(-1) * k1.detach()
        return loss

    s = Sampling(0.7)
    got = {name: {t: r.match for t, r in audit_targets(k1_reinforce(*ts), s).items()}
           for name, ts in {"both": (0.7, 0.7), "policy": (0.7, 1.0), "neither": (1.0, 1.0)}.items()}
    assert got["both"] == {"sampler": "kl_pi_ref", "model": "none of the above", "tempered": "kl_pi_ref",
                           "tempered_vs_raw": "none of the above"}
    assert [t for t, m in got["policy"].items() if m == "kl_pi_ref"] == ["tempered_vs_raw"]
    assert set(got["neither"].values()) == {"none of the above"}
    assert set(audit_targets(k1_reinforce(0.7, 0.7), Sampling(0.7, top_p=0.9))) == {"sampler", "tempered",
                                                                                   "tempered_vs_raw"}
