"""Issue 44: the training-inference mismatch axis, exact on the tabular model (docs/mismatch.md)."""
from __future__ import annotations

import pytest
import torch

from klbench.estimators import KLBatch, gradient_estimator
from klbench.estimators.mismatch import mismatch_metrics
from klbench.exact.mismatch import AXIS, Mismatch, audit_mismatch, distance
from klbench.exact.tabular import TabularModel, default_instances

SUPPORT_KEEPING = [k for k, m in AXIS.items() if m.keeps_support]


# ---- the meter ----

def _pair(seed: int, cut: bool = False):
    g = torch.Generator().manual_seed(seed)
    scorer = torch.randn(5, generator=g, dtype=torch.float64)
    sampler = scorer + 0.3 * torch.randn(5, generator=g, dtype=torch.float64)
    if cut:
        sampler[0] = -float("inf")
    return torch.log_softmax(sampler, -1), torch.log_softmax(scorer, -1)


def test_meter_token_means_are_the_exact_divergences():
    """Every token once, weighted by pi_s (enumeration): the meter's means are KL(pi_s || pi) and chi^2(pi || pi_s)."""
    ls, lq = _pair(0)
    ps, pq = ls.exp(), lq.exp()
    # one row per token, a 1-token sequence each; the weight pi_s enters through repetition-free weighting below
    per = {k: [] for k in ("mismatch_k1", "mismatch_k3", "mismatch_chi2")}
    for v in range(5):
        m = mismatch_metrics(ls[v].view(1, 1), lq[v].view(1, 1), torch.ones(1, 1, dtype=torch.bool))
        for k in per:
            per[k].append(float(m[k]))
    mean = {k: float((ps * torch.tensor(v, dtype=torch.float64)).sum()) for k, v in per.items()}
    kl = float((ps * (ls - lq)).sum())
    chi2 = float((pq ** 2 / ps).sum() - 1)
    assert mean["mismatch_k1"] == pytest.approx(kl, rel=1e-6)
    assert mean["mismatch_k3"] == pytest.approx(kl, rel=1e-6)
    assert mean["mismatch_chi2"] == pytest.approx(chi2, rel=1e-6)


def test_meter_k3_falls_short_by_the_cut_mass_where_the_sampler_cuts():
    ls, lq = _pair(1, cut=True)
    ps, pq = ls.exp(), lq.exp()
    keep = torch.isfinite(ls)
    r = (lq - ls)[keep].exp()
    k3 = float((ps[keep] * (r - 1 - (lq - ls)[keep])).sum())
    kl = float((ps[keep] * (ls - lq)[keep]).sum())
    assert k3 == pytest.approx(kl - float(pq[~keep].sum()), rel=1e-9)


def test_meter_zero_without_mismatch_and_masks_padding():
    lp = torch.log_softmax(torch.randn(2, 3, 4), -1)[..., 0]
    mask = torch.tensor([[True, True, False], [True, False, False]])
    noisy = lp.clone()
    noisy[~mask] = 5.0  # padding: never read
    m = mismatch_metrics(noisy, lp, mask)
    assert all(float(v) == 0 for v in m.values())


def test_meter_bad_shapes_are_one_line_naming_both():
    with pytest.raises(ValueError) as e:
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool))
    assert "(2, 3)" in str(e.value) and "(2, 4)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="non-finite"):
        mismatch_metrics(torch.tensor([[-float("inf")]]), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))


def test_behaviour_logp_of_the_wrong_shape_is_one_line_naming_both():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError) as e:
        KLBatch(logp, logp, torch.ones(2, 3, dtype=torch.bool), old_logp=torch.zeros(2, 4, dtype=torch.float64))
    assert "(2, 3)" in str(e.value) and "(2, 4)" in str(e.value) and "\n" not in str(e.value)


# ---- the axis ----

def test_mismatch_needs_the_exact_model_one_line():
    with pytest.raises(ValueError) as e:
        AXIS["bf16 noise"].sampler_table(object(), torch.zeros(2, 2))
    assert "no exact truth" in str(e.value) and "\n" not in str(e.value)
    for kind, size in (("bf16", 1.0), ("top_p", 1.5), ("stale", 0.5), ("temperature", 0)):
        with pytest.raises(ValueError):
            Mismatch(kind, size)


def test_every_kind_moves_the_sampler_and_only_top_p_cuts_support():
    model, theta = default_instances()[1]
    for label, m in AXIS.items():
        s = m.sampler_table(model, theta)
        assert not torch.allclose(torch.softmax(s, -1), torch.softmax(theta, -1)), label
        assert bool(torch.isfinite(s).all()) == m.keeps_support, label


# ---- the PG candidates: hand-written corrections land where their math says ----

def _seq_is(batch, r):  # REINFORCE with the sequence-level ratio: unbiased for grad E_pi[R]
    w = torch.exp(torch.where(batch.mask, batch.log_w, 0).sum(-1)).detach()
    return -(w * r * batch.masked_logp.sum(-1))


def _token_is(batch, r):
    return -(torch.where(batch.mask, torch.exp(batch.log_w), 0).sum(-1) * r)


def _none(batch, r):
    return -(r * batch.masked_logp.sum(-1))


def test_pg_candidates_tell_the_three_corrections_apart():
    m = AXIS["noise 0.1"]
    assert audit_mismatch(_seq_is, m, "pg").match == "pg"
    assert audit_mismatch(_token_is, m, "pg").match == "token_is_pg"
    assert audit_mismatch(_none, m, "pg").match == "uncorrected_pg"
    assert audit_mismatch(_none, None, "pg").match == "pg"  # no mismatch: all three coincide


# ---- the verdict's proportional match, and the two candidates that name the libraries' terms ----

def test_a_proportional_verdict_needs_a_small_scaled_relative_error_not_a_cosine():
    """A cosine within 1e-5 of 1 admits a relative error of 4.5e-3 (1 - cos ~ err^2 / 2): that must read none."""
    from klbench.exact.tabular.gradient_audit import AuditRow, _verdict, stats
    g = torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    perp = torch.tensor([2.0, -1.0, 0.0, 0.0], dtype=torch.float64)  # perp @ g = 0
    truth = torch.ones(4, dtype=torch.float64)

    def verdict(mean):
        per = {"c": [stats(mean, g, truth)], "zero": [stats(mean, torch.zeros(4, dtype=torch.float64), truth)]}
        rows = [AuditRow(k, v[0][0], v[0][1], v[0][2]) for k, v in per.items()]
        return _verdict(rows, per, 1e-5), per["c"][0]

    off, st = verdict(g + 4.4e-3 * g.norm() / perp.norm() * perp)
    assert abs(st[0] - 1) < 1e-5 and st[3] == pytest.approx(4.4e-3, rel=1e-9)
    assert off == "none of the above"
    assert verdict(0.5 * g)[0] == "0.5 x c"
    assert verdict(0.5 * g + 1e-8 * perp)[0] == "0.5 x c"


def _engine_k1_in_reward_seq_is(batch):
    """The engine's k1 charged in the reward, through REINFORCE with the exact sequence weight pi(y) / pi_s(y)."""
    m = batch.mask
    c = torch.where(m, batch.old_logp - batch.ref_logp, 0).sum(-1).detach()  # [B] the engine's k1, a cost
    w = torch.exp(torch.where(m, batch.logp - batch.old_logp, 0).sum(-1)).detach()  # [B]
    return w * c * batch.masked_logp.sum(-1)


def _k2_in_the_loss(batch):
    return torch.where(batch.mask, 0.5 * (batch.logp - batch.ref_logp) ** 2, 0).sum(-1)


@pytest.mark.parametrize("label", SUPPORT_KEEPING)
def test_engine_logprobs_in_the_reward_follow_kl_pi_ref_minus_kl_pi_s_exactly(label):
    r = audit_mismatch(_engine_k1_in_reward_seq_is, AXIS[label])
    assert r.match == "kl_pi_ref_minus_kl_pi_s", label
    assert distance(r, "kl_pi_ref_minus_kl_pi_s") < 1e-12 and distance(r, "kl_pi_ref") > 1e-4


def test_kl_pi_ref_minus_kl_pi_s_raises_the_trainers_kl_from_its_sampler():
    """Descending the candidate's gradient moves pi away from pi_s (its -grad KL(pi || pi_s) part), by enumeration."""
    from klbench.exact.mismatch import sampler_kl_gradients
    model, theta = default_instances()[0]
    sampler = AXIS["noise 0.1"].sampler_table(model, theta)
    g = sampler_kl_gradients(model, theta, sampler)["kl_pi_ref_minus_kl_pi_s"]
    x = theta.detach().clone().requires_grad_()
    g_s = torch.autograd.grad(model.pair_kl(x, sampler), x)[0]  # grad KL(pi || pi_s), pi_s fixed
    assert float((-g * g_s).sum()) < 0  # the step -g has a negative inner product with -grad: KL(pi || pi_s) rises
    assert sampler_kl_gradients(model, theta, torch.full_like(sampler, -float("inf")).masked_fill(
        torch.arange(model.K) == 0, 0.0)).keys() == {"k2@old"}  # a cut sampler: KL(pi || pi_s) is infinite


@pytest.mark.parametrize("label", list(AXIS))
def test_k2_in_the_loss_follows_k2_on_the_samplers_samples(label):
    r = audit_mismatch(_k2_in_the_loss, AXIS[label])
    assert r.match == "k2@old" and distance(r, "k2@old") < 1e-12, label
    assert audit_mismatch(_k2_in_the_loss, None).match == "partial_kl_pi_ref"  # at pi_s = pi: the prefix-fixed one


# ---- klbench's own estimators ----

@pytest.mark.parametrize("label", SUPPORT_KEEPING)
def test_rb_with_the_sampler_logprobs_is_exact_under_every_support_keeping_mismatch(label):
    r = audit_mismatch(gradient_estimator("rb"), AXIS[label])
    assert r.match == "kl_pi_ref", label


def test_rb_under_top_p_is_off_and_ignoring_the_sampler_is_off():
    from dataclasses import replace
    rb = gradient_estimator("rb")
    cut = audit_mismatch(rb, AXIS["sampler top-p 0.9"])
    assert cut.match == "none of the above" and distance(cut, "kl_pi_ref") > 0.05
    ignored = audit_mismatch(lambda b: rb(replace(b, old_logp=None)), AXIS["noise 0.1"])
    assert ignored.match == "none of the above" and 1e-3 < distance(ignored, "kl_pi_ref") < 1


def test_seq_ignoring_the_sampler_is_off_by_the_mismatch_size():
    """seq refuses a behaviour batch; fed pi_s's samples as on-policy it follows nothing, more so as pi_s moves."""
    from dataclasses import replace
    seq = gradient_estimator("seq")
    fed = lambda b: seq(replace(b, old_logp=None))  # noqa: E731
    small = distance(audit_mismatch(fed, AXIS["bf16 noise"]), "kl_pi_ref")
    large = distance(audit_mismatch(fed, AXIS["noise 0.1"]), "kl_pi_ref")
    assert 0 < small < large < 1


# ---- libraries: the installed corrections (skipped where a library is absent) ----

def _setting(lib: str, name: str):
    from klbench.libraries import LibraryMissing
    from klbench.libraries.mismatch import LOADERS
    try:
        return next(s for s in LOADERS[lib]() if s.name == name)
    except LibraryMissing as e:
        pytest.skip(str(e))


def test_verl_bypass_charges_the_sampler_in_the_reward_kl_while_its_pg_is_exact():
    s = _setting("verl", "verl.rollout_corr.bypass_pg_is")
    m = AXIS["noise 0.1"]
    assert audit_mismatch(s.terms["pg"], m, "pg", tol=1e-5).match == "pg"
    kl = audit_mismatch(s.terms["kl_reward"], m, tol=1e-5)
    assert kl.match == "kl_pi_ref_minus_kl_pi_s" and distance(kl, "kl_pi_ref") > 1e-3


@pytest.mark.slow
def test_trl_vllm_ratio_leaves_the_kl_term_uncorrected():
    s = _setting("trl", "trl.grpo.vllm_is.sequence_truncate")
    m = AXIS["noise 0.1"]
    assert audit_mismatch(s.terms["pg"], m, "pg", tol=1e-5).match == "pg"
    kl = audit_mismatch(s.terms["kl_loss"], m, tol=1e-5)
    assert kl.match == "k2@old"  # k2 on pi_s's samples, pi_s fixed: not a KL
    assert audit_mismatch(s.terms["kl_loss"], None, tol=1e-5).match == "partial_kl_pi_ref"


@pytest.mark.slow
def test_the_issue_claims_from_installed_code():
    """Each claim's verdict flips with the code: these are the 1.16.0 / 0.9.1 findings (docs/verdicts.md)."""
    from klbench.libraries import mismatch_verdicts as mv
    try:
        assert mv.trl_ratio_not_on_kl().holds is True
        assert mv.verl_bypass_feeds_rollout_logprobs().holds is True
        top_p = mv.trl_top_p_ratio_is_kept_mass()
    except ImportError as e:
        pytest.skip(str(e))
    assert top_p.holds is True and "off" in top_p.rows[-1][1]  # the corrected PG is biased under top-p
    assert mv.verl_topk_clamp().holds is None


@pytest.mark.slow
def test_every_library_setting_runs_on_the_axis_and_none_corrects_a_kl_in_the_loss():
    from klbench.libraries import mismatch_report as mr
    rows, missing = mr.run(columns=["none", "noise 0.1"])
    assert rows and not any(v.startswith("raised") for r in rows for v in r.verdicts.values())
    for r in rows:
        if r.term == "kl_loss":  # no weight for the mismatch: k2 on pi_s's samples, not a KL
            assert r.verdicts["noise 0.1"].startswith("k2@old"), r.setting
        if r.term == "pg":
            assert r.verdicts["none"] == "pg", r.setting  # every correction is the identity without mismatch
    assert any("skyrl_train" in m for m in missing)


def test_trl_token_corrections_at_a_one_sided_temperature_read_none_not_1_x():
    """Issue 53: TRL's token_truncate / token_mask PG terms at sampler T 0.8 are 1.35e-5 / 1.48e-4 off token_is_pg
    (a weight above the cap 3.0 fires): the old cosine test printed "1 x token_is_pg"."""
    for mode in ("token_truncate", "token_mask"):
        s = _setting("trl", f"trl.grpo.vllm_is.{mode}")
        r = audit_mismatch(s.terms["pg"], AXIS["sampler T 0.8"], "pg", tol=1e-5)
        assert r.match == "none of the above", (mode, r.match)
        assert 1e-5 < distance(r, "token_is_pg") < 1e-3 and distance(r, "pg") > 0.1


def test_library_kl_terms_are_named_under_a_mismatch():
    """verl's bypass mode charges the engine's k1 in the reward: kl_pi_ref_minus_kl_pi_s where its sequence weight
    stays under the cap; its KL in the loss (low_var_kl+) is k2 on pi_s's samples."""
    s = _setting("verl", "verl.rollout_corr.bypass_pg_is")
    for label in ("noise 0.1", "2 steps stale"):
        assert audit_mismatch(s.terms["kl_reward"], AXIS[label], tol=1e-5).match == "kl_pi_ref_minus_kl_pi_s", label
    assert audit_mismatch(s.terms["kl_loss"], AXIS["noise 0.1"], tol=1e-5).match == "k2@old"
