"""Issue 53 item 3: klbench's PG corrections (klbench/estimators/pg_correction.py) against the libraries' own, exactly.

On the exact mismatch axis (klbench/exact/mismatch.py) each option's expected gradient, by enumeration, equals the
expected gradient of the library setting it mirrors (its installed correction code, klbench/libraries/mismatch.py),
and so the audit's verdict for it. Each test also checks that the comparison has teeth: dropping the weight, using
the scorer's log-probs in place of the engine's, or dropping the cap moves the gradient off the library's."""
from __future__ import annotations

import pytest
import torch

from klbench.estimators.pg_correction import PGCorrection, corrected_per_sequence, corrected_reward_loss
from klbench.exact.mismatch import AXIS, audit_mismatch
from klbench.exact.tabular import TabularReward, default_instances

TOL = 1e-5  # the mismatch report's (float32 libraries); the gradients themselves agree to ~1e-12


def _expected(loss, mismatch) -> list[torch.Tensor]:
    """The exact expected ascent direction -E[grad loss] [P*K] per instance, samples from pi_s = mismatch(theta) with
    the engine's log-probs as old_logp (as audit_mismatch's PG term)."""
    out = []
    for model, theta in default_instances():
        sampler = mismatch.sampler_table(model, theta)
        reward = TabularReward(model, seed=1).table
        out.append(model.gradient_moments(lambda b, r: -loss(b, r), theta, behaviour=sampler,
                                          reward=reward).mean.flatten())
    return out


def _gap(a: list, b: list) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


def _ours(corr: PGCorrection, sampler_from_scorer: bool = False):
    def loss(batch, r):
        sampler = batch.logp.detach() if sampler_from_scorer else batch.old_logp
        return corrected_per_sequence(r, batch.logp, sampler, batch.mask, corr)
    return loss


def _setting(lib: str, name: str):
    from klbench.libraries import LibraryMissing
    from klbench.libraries.mismatch import LOADERS
    try:
        return next(s for s in LOADERS[lib]() if s.name == name)
    except LibraryMissing as e:
        pytest.skip(str(e))


# token_truncate and sequence_mask (TRL's default mode) in the default set; the other three with -m slow
TRL = [pytest.param("off", marks=pytest.mark.slow), "token_truncate", pytest.param("token_mask", marks=pytest.mark.slow),
       pytest.param("sequence_truncate", marks=pytest.mark.slow), "sequence_mask"]


@pytest.fixture(scope="module")
def trl_settings():
    from klbench.libraries import LibraryMissing
    from klbench.libraries.mismatch import trl_settings as load
    try:
        return {s.name.rsplit(".", 1)[1]: s for s in load()}
    except LibraryMissing as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("mode", TRL)
def test_each_option_equals_trls_setting_exactly(trl_settings, mode):
    """TRL's defaults: clip_max 3.0, clip_min None. noise 0.1: no weight reaches the cap; a one-sided T 0.8: the cap
    fires (the token modes read "none of the above" there, 1.35e-5 and 1.48e-4 off token_is_pg)."""
    lib = trl_settings[mode].terms["pg"]
    corr = PGCorrection("none" if mode == "off" else mode, cap=3.0)
    for label in ("noise 0.1", "sampler T 0.8"):
        m = AXIS[label]
        want, got = _expected(lib, m), _expected(_ours(corr), m)
        assert _gap(got, want) < 1e-10, (mode, label, _gap(got, want))
        assert audit_mismatch(_ours(corr), m, "pg", tol=TOL).match == audit_mismatch(lib, m, "pg", tol=TOL).match
        if mode == "off":
            continue
        # mutations: each moves the expected gradient off the library's
        dropped = _gap(_expected(_ours(PGCorrection("none")), m), want)
        scorer = _gap(_expected(_ours(corr, sampler_from_scorer=True), m), want)
        assert dropped > 1e-3 and scorer > 1e-3, (mode, label, dropped, scorer)
        if label == "sampler T 0.8":
            uncapped = _gap(_expected(_ours(PGCorrection(corr.mode, cap=1e9)), m), want)
            assert uncapped > 1e-6, (mode, uncapped)


def test_verdicts_of_each_mode_where_no_cap_fires():
    """The named candidates: none = uncorrected_pg, sequence_* = pg, token_* = token_is_pg, while the weights stay
    within their bounds (noise 0.1; test_mismatch.py has the staleness column for the libraries)."""
    want = {"none": "uncorrected_pg", "token_truncate": "token_is_pg", "token_mask": "token_is_pg",
            "sequence_truncate": "pg", "sequence_mask": "pg"}
    for mode, match in want.items():
        for label in ("noise 0.1",):
            assert audit_mismatch(_ours(PGCorrection(mode, cap=3.0)), AXIS[label], "pg").match == match, (mode, label)


VERL = [("decoupled_token_is", PGCorrection("token_truncate", cap=2.0)),
        ("decoupled_seq_is", PGCorrection("sequence_truncate", cap=2.0)),
        ("decoupled_token_icepop", PGCorrection("token_mask", cap=5.0, floor=0.5))]


@pytest.mark.slow
@pytest.mark.parametrize("preset,corr", VERL, ids=[v[0] for v in VERL])
def test_verl_presets_equal_their_mirror_exactly(preset, corr):
    """verl's rollout correction (TIS: clamp at the upper bound; IcePop: zero outside [lower, upper]) in its PPO-clip
    loss, one update per batch: the same expected gradient as the mirror, on every support-keeping mismatch."""
    lib = _setting("verl", f"verl.rollout_corr.{preset}").terms["pg"]
    for label, m in AXIS.items():
        if m.keeps_support:
            assert _gap(_expected(_ours(corr), m), _expected(lib, m)) < 1e-10, (preset, label)


def test_weights_follow_the_libraries_bounds():
    r = torch.tensor([[1.0, 4.0, 0.25], [2.0, 1.0, 1.0]], dtype=torch.float64)  # pi / pi_s per token
    mask = torch.tensor([[True, True, True], [True, True, False]])
    scorer = torch.zeros_like(r)
    sampler = -r.log()  # log pi_s = log pi - log r
    w = lambda mode, **k: PGCorrection(mode, **k).weights(scorer, sampler, mask)[0]  # noqa: E731
    torch.testing.assert_close(w("token_truncate", cap=3.0), torch.tensor([[1, 3, .25], [2, 1, 0]]).double())
    torch.testing.assert_close(w("token_mask", cap=3.0, floor=0.5), torch.tensor([[1, 0, 0], [2, 1, 0]]).double())
    # sequence: the product over real tokens (row 0: 1, row 1: 2), on every real token of the row
    torch.testing.assert_close(w("sequence_truncate", cap=1.5), torch.tensor([[1, 1, 1], [1.5, 1.5, 0]]).double())
    torch.testing.assert_close(w("sequence_mask", cap=1.5), torch.tensor([[1, 1, 1], [0, 0, 0]]).double())
    torch.testing.assert_close(w("none"), mask.double())
    _, stats = PGCorrection("token_truncate", cap=3.0).weights(scorer, sampler, mask)
    assert float(stats["pg_weight_bounded"]) == pytest.approx(1 / 5)  # the 4.0 of five real tokens


def test_mode_none_is_the_plain_reward_loss():
    from klbench.estimators.advantages import reward_loss
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.rand(3, 4, generator=g) > 0.3
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    for kind in ("seq_sum", "token_mean", "seq_mean_token_mean"):
        ours, _ = corrected_reward_loss(adv, logp, logp.detach() - 0.2, mask, PGCorrection("none"), kind)
        assert float(ours) == pytest.approx(float(reward_loss(adv, logp, mask, kind)), rel=1e-12)


@pytest.mark.parametrize("kwargs,words", [({"mode": "token"}, ["'token'", "token_truncate"]),
                                          ({"mode": "token_mask", "cap": 0.0}, ["cap=0.0", "> 0"]),
                                          ({"mode": "token_mask", "cap": 2.0, "floor": 3.0}, ["floor=3.0", "cap=2.0"])])
def test_bad_options_are_one_line_naming_the_key(kwargs, words):
    with pytest.raises(ValueError) as e:
        PGCorrection(**kwargs)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_sampler_logprob_that_cannot_have_been_drawn_is_refused():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="non-finite"):
        PGCorrection("token_truncate").weights(torch.zeros(1, 2), torch.tensor([[0.0, -float("inf")]]), mask)
