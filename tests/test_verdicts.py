"""docs/verdicts.md: each verdict's exact audit (klbench/exact/verdicts.py), pinned, and the CLI that writes it."""
from __future__ import annotations

import pytest

from klbench.exact import verdicts


@pytest.fixture(scope="module")
def results():
    return {v.title: v for v in verdicts.run()}


def _holds(v) -> bool:
    return v.holds(v.results[len(v.results) - len(v.cases):])


def test_k3_in_rloo_reward_is_biased_exactly_as_stated(results):
    v = results["k3 in RLOO's reward"]
    assert not _holds(v)
    assert [r["on"] for r in v.results][0::2] == ["none of the above", "kl_pi_ref"]
    assert float(v.results[1]["on"].split()[2]) < 1e-12  # = grad kl_pi_ref - grad partial_kl_ref_pi


def test_k2_in_the_loss_follows_the_prefix_fixed_gradient_only(results):
    v = results["k2 in the loss is unbiased"]
    assert not _holds(v)
    assert [r["on"] for r in v.results] == ["partial_kl_pi_ref"] * 3
    assert v.results[2]["off"] == "partial_kl_pi_ref@old"


def test_k1_and_k3_in_the_reward_differ_even_under_the_blogs_conditions(results):
    v = results["k1 and k3 in the reward have identical expected gradients"]
    assert not _holds(v)
    gap = [float(r["on"].split()[2]) for r in v.results[:4]]
    assert gap[0] > 0.5 and gap[1] < 1e-12 and gap[3] > 0.5  # the difference is exactly -grad partial_kl_ref_pi
    assert float(v.results[2]["on"].split()[-1].rstrip(")")) < 0.1  # near pi_ref k3's gradient nearly vanishes


def test_trl_per_token_ratio_under_sequence_is(results):
    v = results["the per-token ratio for TRL's bias correction under sequence-level IS"]
    assert _holds(v) and (v.results[-1]["on"], v.results[-1]["off"]) == ("partial_kl_pi_ref", "partial_kl_pi_ref@old")


def test_cli_writes_the_page(tmp_path, capsys):
    from klbench.libraries.cli import main

    assert main(["--verdicts", str(tmp_path / "verdicts.md")]) == 0
    page = (tmp_path / "verdicts.md").read_text()
    assert page.count("**Verdict: ") == 4 and "## k3 in RLOO's reward (TRL PR #7096)" in page
    assert "k2 in the loss is unbiased: does not hold" in capsys.readouterr().out
