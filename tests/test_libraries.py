"""The pinned RL libraries' own KL code, audited on the exact tabular model: one test per (setting, policy)
cell. A new library release that changes what its code follows fails here instead of silently changing
docs/libraries.md. Libraries not installed skip with the line that installs them."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.libraries import LibraryMissing, Setting, load
from klbench.libraries.audit import run, run_setting
from klbench.libraries.base import require

# (setting, policy) -> (audit verdict, a library clamp changed a value). These are issue 20's findings.
EXPECTED = {
    ("trl.grpo", "on"): ("partial_kl_pi_ref", False),  # use_bias_correction_kl defaults to True
    ("trl.grpo", "off"): ("partial_kl_pi_ref@old", True),  # clamp: the PPO clip, on a zero advantage
    ("trl.grpo.default_beta", "on"): ("zero", False),  # default beta is 0.0
    ("trl.grpo.default_beta", "off"): ("zero", True),
    ("trl.grpo.no_bias_correction", "on"): ("partial_kl_ref_pi", False),
    ("trl.grpo.no_bias_correction", "off"): ("none of the above", True),
    ("trl.grpo.sequence_is", "on"): ("none of the above", False),  # sequence ratio broadcast onto token k3
    ("trl.grpo.sequence_is", "off"): ("none of the above", True),
    ("trl.grpo.sequence_is.no_bias_correction", "on"): ("partial_kl_ref_pi", False),
    ("trl.grpo.sequence_is.no_bias_correction", "off"): ("none of the above", True),
    ("trl.grpo.loss_grpo", "on"): ("none of the above", False),  # per-sequence length normalisation
    ("trl.grpo.loss_grpo", "off"): ("none of the above", True),
    ("trl.grpo.loss_dr_grpo", "on"): ("0.00195312 x partial_kl_pi_ref", False),  # 1 / max_completion_length
    ("trl.grpo.loss_dr_grpo", "off"): ("0.00195312 x partial_kl_pi_ref@old", True),
    ("trl.rloo", "on"): ("kl_pi_ref", False),
    ("trl.rloo", "off"): ("none of the above", True),  # rollout policy's k1 in the reward, clipped ratio
    ("trl.rloo.no_clip", "on"): ("kl_pi_ref", False),
    ("trl.rloo.no_clip", "off"): ("none of the above", False),
    ("openrlhf.k1", "on"): ("zero", False),  # the default kl_estimator, in the loss
    ("openrlhf.k1", "off"): ("none of the above", False),
    ("openrlhf.k1.unbiased", "on"): ("partial_kl_pi_ref", False),
    ("openrlhf.k1.unbiased", "off"): ("partial_kl_pi_ref@old", False),
    ("openrlhf.k2", "on"): ("partial_kl_pi_ref", False),
    ("openrlhf.k2", "off"): ("none of the above", False),
    ("openrlhf.k2.unbiased", "on"): ("partial_kl_pi_ref", False),
    ("openrlhf.k2.unbiased", "off"): ("partial_kl_pi_ref@old", False),
    ("openrlhf.k3", "on"): ("none of the above", True),  # value clamped to [-10, 10]
    ("openrlhf.k3", "off"): ("none of the above", True),
    ("openrlhf.k3.unbiased", "on"): ("partial_kl_pi_ref", True),  # clamp on the detached value only
    ("openrlhf.k3.unbiased", "off"): ("partial_kl_pi_ref@old", True),
    ("areal.kl.k1", "on"): ("kl_pi_ref", False),
    ("areal.kl.k1", "off"): ("none of the above", False),
    ("areal.kl.k2", "on"): ("none of the above", False),
    ("areal.kl.k2", "off"): ("none of the above", False),
    ("areal.kl.k3", "on"): ("none of the above", True),
    ("areal.kl.k3", "off"): ("none of the above", True),
}
VERL = {"k1": ("zero", "none of the above", False), "kl": ("zero", "none of the above", False),
        "abs": ("none of the above", "none of the above", False),
        "mse": ("partial_kl_pi_ref", "none of the above", False), "k2": ("partial_kl_pi_ref", "none of the above", False),
        "low_var_kl": ("none of the above", "none of the above", True),  # clamp to [-10, 10] fires
        "k3": ("none of the above", "none of the above", True),
        "k1+": ("partial_kl_pi_ref", "none of the above", False),
        "k3+": ("partial_kl_pi_ref", "none of the above", True),  # clamp on the detached forward value only
        "low_var_kl+": ("partial_kl_pi_ref", "none of the above", True)}
# use_kl_in_reward: kl_penalty on the rollout's log-probs, return-to-go REINFORCE (klbench's surrogate)
EXPECTED[("verl.kl_in_reward.kl", "on")] = ("kl_pi_ref", False)
EXPECTED[("verl.kl_in_reward.kl", "off")] = ("none of the above", False)
EXPECTED[("verl.kl_in_reward.low_var_kl", "on")] = ("none of the above", True)
EXPECTED[("verl.kl_in_reward.low_var_kl", "off")] = ("none of the above", True)
for kind, (on, off, clamp) in VERL.items():
    EXPECTED[(f"verl.kl_penalty.{kind}", "on")] = (on, clamp)
    EXPECTED[(f"verl.kl_penalty.{kind}", "off")] = (off, clamp)
# the actor's whole ppo_loss (advantages 0) audits as kl_penalty alone: verl's KL loss takes no ratio. Its
# off-policy clamp is the policy term's PPO ratio clip (core_algos.py compute_policy_loss_vanilla), on a zero
# advantage; on-policy the ratio is 1 and only kl_penalty's own clamps can fire
for kind in ("low_var_kl", "kl", "low_var_kl+"):
    on, off, clamp = VERL[kind]
    EXPECTED[(f"verl.ppo_loss.{kind}", "on")] = (on, clamp)
    EXPECTED[(f"verl.ppo_loss.{kind}", "off")] = (off, True)
# per-sequence token mean: each sequence's KL weighed by 1 / its length, like trl.grpo.loss_grpo
EXPECTED[("verl.ppo_loss.low_var_kl.seq_mean_token_mean", "on")] = ("none of the above", True)
EXPECTED[("verl.ppo_loss.low_var_kl.seq_mean_token_mean", "off")] = ("none of the above", True)
# OpenRLHF's KL in the reward (compute_reward), return-to-go REINFORCE (klbench's): k1 is the score-function
# gradient of KL(pi||pi_ref) on-policy; off-policy the reward is pi_old's k1 (as verl.kl_in_reward.kl). k2's
# mean is not the KL, and k3's detached value drops E[grad k3] != 0 (and its [-10, 10] clamp fires).
EXPECTED[("openrlhf.reward.k1", "on")] = ("kl_pi_ref", False)
EXPECTED[("openrlhf.reward.k1", "off")] = ("none of the above", False)
EXPECTED[("openrlhf.reward.k2", "on")] = ("none of the above", False)
EXPECTED[("openrlhf.reward.k2", "off")] = ("none of the above", False)
EXPECTED[("openrlhf.reward.k3", "on")] = ("none of the above", True)
EXPECTED[("openrlhf.reward.k3", "off")] = ("none of the above", True)

# on-policy distillation (Setting.task "distill"; pi = student, pi_ref = teacher): TRL's DistillationTrainer loss
# autodiffs the full-vocabulary divergence at each sampled prefix, so beta 1 (reverse KL, the default) follows the
# prefix-fixed KL(student || teacher) and beta 0 the prefix-fixed KL(teacher || student); the JSD and a temperature
# follow none; per-token ratios are absent, so off-policy each becomes its "@old" form
EXPECTED.update({
    ("trl.distill.beta0", "on"): ("partial_kl_ref_pi", False),
    ("trl.distill.beta0", "off"): ("partial_kl_ref_pi@old", False),
    ("trl.distill.beta0.5", "on"): ("none of the above", False),
    ("trl.distill.beta0.5", "off"): ("none of the above", False),
    ("trl.distill.beta1", "on"): ("partial_kl_pi_ref", False),
    ("trl.distill.beta1", "off"): ("partial_kl_pi_ref@old", False),
    ("trl.distill.beta1.temperature2", "on"): ("none of the above", False),
    ("trl.distill.beta1.temperature2", "off"): ("none of the above", False),
})
# verl's distillation_loss: backpropagated, each estimator audits as verl's kl_penalty in the loss (k1 refused by
# verl itself); with use_policy_gradient the detached per-token loss is a per-token advantage, so only k1 (= kl)
# is the prefix-fixed KL(student || teacher); forward_kl_topk with k = V is the prefix-fixed KL(teacher || student)
# and truncated (k = 2) none; its policy-gradient form has zero expected gradient on-policy (the teacher's top-k
# KL does not depend on the sampled token). Off-policy the PPO ratio clip fires (core_algos.py compute_policy_loss_vanilla)
K1_REFUSED = "raised ValueError: Directly backpropagating k1 loss is incorrect since gradient of k1 loss wrt model weights"
VERL_DISTILL = {  # mode -> (backprop on, off), (policy gradient on, off); clamps: kl_penalty's [-10, 10] value
    # clamp (core_algos.py) for low_var_kl and k3, and off-policy with policy gradient the PPO ratio clip
    "kl": (("zero", "none of the above"), ("partial_kl_pi_ref", "none of the above")),
    "k1": ((None, None), ("partial_kl_pi_ref", "none of the above")),
    "abs": (("none of the above", "none of the above"), ("none of the above", "none of the above")),
    "mse": (("partial_kl_pi_ref", "none of the above"), ("none of the above", "none of the above")),
    "k2": (("partial_kl_pi_ref", "none of the above"), ("none of the above", "none of the above")),
    "low_var_kl": (("none of the above", "none of the above"), ("none of the above", "none of the above")),
    "k3": (("none of the above", "none of the above"), ("none of the above", "none of the above")),
    "forward_kl_topk": (("partial_kl_ref_pi", "partial_kl_ref_pi@old"), ("zero", "none of the above")),
    "forward_kl_topk.k2": (("none of the above", "none of the above"), ("zero", "none of the above")),
}
for mode, (bp, pg) in VERL_DISTILL.items():
    value_clamp = mode in ("low_var_kl", "k3")
    for suffix, (on, off) in (("", bp), (".pg", pg)):
        if on is not None:
            EXPECTED[(f"verl.distill.{mode}{suffix}", "on")] = (on, value_clamp)
            EXPECTED[(f"verl.distill.{mode}{suffix}", "off")] = (off, value_clamp or suffix == ".pg")
# skyrl-train 0.3.1: compute_approx_kl runs under @torch.no_grad(), so its KL loss has no gradient (SkyRL #1340);
# k3's value clamp to [-10, 10] fires besides
for est in ("k1", "abs", "k2", "k3"):
    EXPECTED[(f"skyrl_train.{est}", "on")] = ("zero", est == "k3")
    EXPECTED[(f"skyrl_train.{est}", "off")] = ("zero", est == "k3")

# tinker-cookbook's incorporate_kl_penalty: kl_discount_factor 0 (default) is each token's own log-ratio as its
# advantage, the prefix-fixed KL(student || teacher); 1 sums the log-ratios to come, the full gradient. Off-policy
# the advantage is the sampler's log-ratio, as in verl.kl_in_reward.kl: none of the above
EXPECTED.update({
    ("tinker_cookbook.distill.discount0", "on"): ("partial_kl_pi_ref", False),
    ("tinker_cookbook.distill.discount0", "off"): ("none of the above", False),
    ("tinker_cookbook.distill.discount1", "on"): ("kl_pi_ref", False),
    ("tinker_cookbook.distill.discount1", "off"): ("none of the above", False),
})

_LIBS: dict = {}


def _library(name: str):
    if name not in _LIBS:
        try:
            _LIBS[name] = load(name)
        except LibraryMissing as e:
            _LIBS[name] = str(e)
    if isinstance(_LIBS[name], str):
        pytest.skip(_LIBS[name])
    return _LIBS[name]


_CELLS: dict = {}


def _cell(setting: str, policy: str):
    if setting not in _CELLS:
        lib = _library(setting.split(".")[0])
        _CELLS[setting] = {c.policy: c for c in run_setting(lib.name, lib.version, lib.settings[setting])}
    return _CELLS[setting][policy]


@pytest.mark.parametrize("setting,policy", sorted(EXPECTED), ids=lambda v: v)
def test_cell(setting, policy):
    cell = _cell(setting, policy)
    match, clamp = EXPECTED[(setting, policy)]
    assert cell.match == match, f"{setting} {policy}-policy: {cell.match} (rel_errors {cell.rel_errors})"
    assert bool(cell.clamps) == clamp, f"{setting} {policy}-policy: clamps {cell.clamps}"
    assert cell.source and ".py:" in cell.source
    if cell.transcription:  # klbench's worked example of the setting audits like the library's code
        assert cell.transcription_match == cell.match, f"{cell.transcription}: {cell.transcription_match}"


def test_every_setting_has_an_expected_cell():
    names = []
    for lib in ("trl", "verl", "openrlhf", "areal", "skyrl_train", "tinker_cookbook"):
        try:
            names += list(load(lib).settings)
        except LibraryMissing:
            continue
    expected = {s for s, _ in EXPECTED} | {"verl.distill.k1"}  # refused by verl: test_verl_refuses_k1_backprop
    assert sorted({s for s in expected if s.split(".")[0] in {n.split(".")[0] for n in names}}) == sorted(names)


def test_verl_refuses_k1_backprop():
    cells = run_setting("verl", "0.9.1", _library("verl").settings["verl.distill.k1"])
    assert all(c.match.startswith(K1_REFUSED) for c in cells), [c.match for c in cells]


def test_verl_distill_default_is_the_trainer_configs():
    """verl's default OPD loss is what its trainer config composes (distillation.yaml: k3 backpropagated, no
    clamps), not DistillationLossConfig's dataclass defaults (use_policy_gradient True, clamps 10 and -10)."""
    settings = _library("verl").settings
    marked = [n for n, s in settings.items() if "trainer's defaults" in s.note]
    assert marked == ["verl.distill.k3"], marked
    note = settings["verl.distill.k3"].note
    assert "use_policy_gradient=False" in note and "distillation.yaml:" in note
    assert "loss_max_clamp=None" in note and "log_prob_min_clamp=None" in note


def test_a_settings_name_says_its_task():
    from klbench.estimators.options import setting_task

    for lib in ("trl", "verl", "openrlhf", "areal", "skyrl_train", "tinker_cookbook"):
        try:
            settings = load(lib).settings.values()
        except LibraryMissing:
            continue
        for s in settings:
            assert setting_task(s.name) == s.task, s.name
    assert setting_task("trl.distill.beta1") == "distill" and setting_task("trl.grpo") == "rl"


def test_libraries_that_cannot_run_here_are_rows_with_the_reason():
    cells = run(["slime", "skyrl"])
    assert [(c.library, c.policy) for c in cells] == [("slime", "-"), ("skyrl", "-")]
    assert cells[0].match == "skipped: slime: not on PyPI (THUDM/slime is installed from its repository inside a Megatron image)"
    assert "requires Python >=3.12" in cells[1].match


def test_rloo_off_policy_relative_errors_as_in_the_issue():
    assert _cell("trl.rloo", "off").rel_errors["kl_pi_ref"] == pytest.approx(0.58, abs=0.02)
    assert _cell("trl.rloo.no_clip", "off").rel_errors["kl_pi_ref"] == pytest.approx(0.41, abs=0.02)


def test_verl_ppo_loss_per_sequence_split_is_exact():
    """One-sequence calls sum to verl's ppo_loss on the whole padded batch with the same batch_num_tokens."""
    lib = _library("verl")
    from klbench.exact.tabular import default_instances
    from klbench.libraries import verl as adapter
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    model, theta = default_instances()[1]  # the instance with EOS: rows of different lengths
    batch = model.batch(theta.clone().requires_grad_(), torch.arange(model.N))
    per_row = lib.settings["verl.ppo_loss.low_var_kl"].loss(batch)  # [B]
    config = adapter._actor_config(ActorConfig, {})
    rows = [adapter._row_data(batch, b, batch.logp.detach(), batch.ref_logp) for b in range(batch.logp.shape[0])]
    flat = torch.cat([out["log_probs"] for out, _ in rows])  # [total_nnz] every sequence, prompt + response
    data = torch.cat([d.exclude("dp_size", "batch_num_tokens", "global_batch_size") for _, d in rows])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=1, global_batch_size=1)
    whole, _ = ppo_loss(config, {"log_probs": flat}, data)
    assert whole.item() == pytest.approx(per_row.sum().item(), rel=1e-12)
    assert bool((batch.mask.sum(-1) < batch.mask.shape[1]).any())  # padding was exercised


def test_torchtune_has_no_grpo_loss():
    with pytest.raises(LibraryMissing, match="ships no GRPOLoss"):
        load("torchtune")


def test_other_version_names_found_supported_and_pip_line():
    with pytest.raises(LibraryMissing, match=r"torch: found 2\.13\.0.*supported 0\.0\.1; pip install --no-deps"):
        require("torch", "0.0.1")
    with pytest.raises(LibraryMissing, match="not installed; supported 1.0; pip install --no-deps"):
        require("klbench-no-such-dist", "1.0")


def test_unknown_setting_names_the_valid_ones():
    _library("verl")
    with pytest.raises(ValueError, match=r"unknown setting 'verl\.kl_penalty\.k9'; valid: .*verl\.kl_penalty\.k3\+"):
        run(["verl.kl_penalty.k9"])
    with pytest.raises(ValueError, match="unknown library 'nope'"):
        run(["nope.x"])


def test_a_raising_or_non_finite_library_function_is_the_cells_result():
    def raises(batch):
        raise ValueError("Unknown kl_estimator: k9")

    def nan(batch):
        return batch.logp.sum(-1) * float("nan")

    cells = run_setting("x", "0", Setting("x.raises", raises, "x.py:1", "-"))
    assert [c.match for c in cells] == ["raised ValueError: Unknown kl_estimator: k9"] * 2
    cells = run_setting("x", "0", Setting("x.nan", nan, "x.py:1", "-"))
    assert all(c.match.startswith("raised FloatingPointError: the library returned non-finite") for c in cells)


def test_cli_prints_table_and_logs_mlflow_artifact(tmp_path, monkeypatch, capsys):
    _library("verl")
    from klbench.libraries.cli import main
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("KLBENCH_OUTPUTS", str(tmp_path))
    md = tmp_path / "libraries.md"
    assert main(["verl.kl_penalty.k3+", "torchtune", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "verl 0.9.1" in out and "partial_kl_pi_ref" in out and "skipped: torchtune 0.6.1" in out
    assert "`verl/trainer/ppo/core_algos.py:" in md.read_text()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("library-audit")
    run_ = client.search_runs([exp.experiment_id])[0]
    assert {a.path for a in client.list_artifacts(run_.info.run_id)} == {"audit.txt", "libraries.md"}
    assert not math.isnan(run_.data.metrics["audit_seconds"])


@pytest.mark.parametrize("name,match", [("trl.grpo", "partial_kl_pi_ref"),
                                        ("verl.kl_penalty.low_var_kl", "none of the above")])
def test_library_setting_as_a_gradient_estimator(name, match):
    _library(name.split(".")[0])
    from klbench.estimators import gradient_estimator
    from klbench.exact.tabular import audit
    from klbench.libraries.estimator import LibraryGradient

    est = gradient_estimator("library", setting=name)
    assert isinstance(est, LibraryGradient)
    assert audit(est, tol=1e-5).match == match
    with pytest.raises(ValueError, match=r"estimator.setting=trl\.nope: trl 1\.16\.0 has no such setting; valid: trl\.grpo"):
        LibraryGradient(setting="trl.nope")


# ---- the sampling axis (issue 29 item 3): each library scoring the raw logits its own way at T = 0.7, and at
# T = 0.7 with top-p 0.9, samples from pi_s; verdicts against every KL target's candidates (audit.SAMPLINGS) ----
SAMPLED = {
    # TRL divides policy, reference and old by T (add_fused_lm_head): its T = 1 verdict, of the tempered pair
    "trl.grpo": ("partial_kl_pi_ref of sampler = tempered", "none of the above"),
    "trl.grpo.no_bias_correction": ("partial_kl_ref_pi of sampler = tempered", "none of the above"),
    "trl.grpo.default_beta": ("zero", "zero"),
    "trl.rloo": ("kl_pi_ref of sampler = tempered", "none of the above"),
    "verl.kl_in_reward.kl": ("kl_pi_ref of sampler = tempered", "none of the above"),
    "verl.kl_penalty.k2": ("partial_kl_pi_ref of sampler = tempered", "none of the above"),
    "verl.kl_penalty.k1": ("zero", "none of the above"),  # E_{pi_s}[grad log pi_T] != 0 under top-p
    "openrlhf.reward.k1": ("kl_pi_ref of sampler = tempered", "none of the above"),
    # the value's clamp (models/utils.py) fires at T = 0.7 but the unbiased surrogate does not use the value
    "openrlhf.k2.unbiased": ("partial_kl_pi_ref of sampler = tempered (clamp fired: openrlhf/models/utils.py:113)",
                             "none of the above (clamp fired: openrlhf/models/utils.py:113)"),
    # tinker charges the tempered sampler's log-probs against the untempered teacher and its service's ratio
    # is the untempered policy's over the sampler's: none of klbench's candidates, at any target
    "tinker_cookbook.distill.discount1": ("none of the above", "none of the above"),
}


@pytest.mark.parametrize("setting", sorted(SAMPLED))
def test_sampled_cell(setting):
    cell = _cell(setting, "on")
    got = tuple(cell.sampled[label] for label in ("T = 0.7", "T = 0.7, top-p 0.9"))
    assert got == SAMPLED[setting], f"{setting}: {got}"
    assert ".py:" in cell.divides_by_t


def test_openrlhf_k2_at_temperature_hits_its_value_clamp():
    # k2 follows partial_kl_pi_ref at T = 1, but at T = 0.7 the log-ratios grow by 1/T and the value clamp to
    # [-10, 10] (models/utils.py) fires: the tempered scoring changes the verdict
    cell = _cell("openrlhf.k2", "on")
    assert cell.match == "partial_kl_pi_ref"
    assert cell.sampled["T = 0.7"].startswith("none of the above (clamp fired: openrlhf/models/utils.py:")


def test_trl_scores_policy_and_reference_at_its_temperature():
    """TRL's own scorer on the stand-in model is log_softmax(logits / T) of the sampled tokens."""
    from klbench.exact.tabular import RAW, default_instances
    from klbench.estimators.sampling import Sampling, token_logprob
    from klbench.libraries.trl import _accelerator, _grpo_trainer, _LogitsModel

    _library("trl")  # skips where TRL is absent
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    model, theta = default_instances()[1]
    raw = model.batch(theta, torch.arange(model.N), sampling=Sampling(0.7), target=RAW)
    m = _LogitsModel(model.K, theta.dtype)
    add_fused_lm_head(m, temperature=0.7)
    t = _grpo_trainer(GRPOTrainer, GRPOConfig, {}, None)
    t.accelerator = _accelerator()  # made after the config, as load() does
    b = 5
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), raw.tokens[b:b + 1]], 1)
    mask = torch.cat([torch.ones(1, 1, dtype=torch.long), raw.mask[b:b + 1].long()], 1)
    logps, _, _ = t._get_per_token_logps_and_entropies(m.holding(raw.logits[b:b + 1]), ids, mask, model.T)
    zero = torch.zeros((), dtype=theta.dtype)
    want = torch.where(raw.mask[b], token_logprob(raw.logits[b] / 0.7, raw.tokens[b]), zero)
    torch.testing.assert_close(logps[0].double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_tinker_charges_klbench_tempered_vs_raw(gamma):
    """task.kl_target=tempered_vs_raw reproduces tinker-cookbook's pairing at T != 1: the installed
    incorporate_kl_penalty, fed the tempered sampler's log-probs and the untempered teacher's, charges exactly
    klbench's tempered_vs_raw per-token k1 (its reward-to-go at discount 1); klbench's gradients on that target
    follow grad KL(pi_T || pi_ref). The tinker gradient differs only by its service's ratio (pi / pi_s, untempered
    policy), which the audit finds matches no candidate (SAMPLED)."""
    from klbench.estimators import gradient_estimator
    from klbench.estimators.sampling import Sampling, target_batch
    from klbench.exact.tabular import RAW, audit, default_instances

    lib = _library("tinker_cookbook")
    scored = lib.settings[f"tinker_cookbook.distill.discount{int(gamma)}"].scored
    s = Sampling(0.7)
    model, theta = default_instances()[2]
    rows = torch.arange(model.N)
    raw = model.batch(theta, rows, sampling=s, target=RAW)
    tvr = model.batch(theta, rows, sampling=s, target="tempered_vs_raw")
    zero = torch.zeros((), dtype=theta.dtype)
    k1 = torch.where(tvr.mask, tvr.logp - tvr.ref_logp, zero)  # [B, T] klbench's tempered_vs_raw k1
    cost = k1.flip(-1).cumsum(-1).flip(-1) if gamma else k1
    w = torch.where(raw.mask, torch.exp(raw.logp - tvr.logp), zero)  # the service's ratio pi / pi_s
    torch.testing.assert_close(scored(raw, s), (w * cost).sum(-1), rtol=0, atol=1e-5)
    assert audit(gradient_estimator("cumulative"), sampling=s, target="tempered_vs_raw").match == "kl_pi_ref"


def test_sampling_section_in_the_markdown():
    from klbench.libraries.audit import markdown

    cells = [_cell("trl.grpo", "on"), _cell("trl.grpo", "off")]
    page = markdown(cells, 1.0)
    assert "| library | setting | T = 0.7 | T = 0.7, top-p 0.9 | divides by T: policy / reference / old |" in page
    assert ("| trl 1.16.0 | `trl.grpo` | partial_kl_pi_ref of sampler = tempered | **none of the above** | policy, "
            "reference and old |") in page
    assert "- trl 1.16.0: policy, reference and old: add_fused_lm_head(" in page
