"""kl_ctl: the adaptive KL controller (klbench/kl_control.py) and its wiring.

The controller's update rule and state; on the tabular model, where val/seq_kl is the exact
KL(pi || pi_ref), it brings the KL to its target and holds it there for two targets; a resumed run
continues the same beta trajectory; bad input stops before anything is built; `fixed` leaves beta alone;
the rl_target_kl sweep composes and (slow) runs.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
from omegaconf import open_dict

from klbench.kl_control import SIGNALS, AdaptiveKL, FixedKL, build_kl_control
from klbench.schema import ConfigError, validate
from klbench.train import run
from test_config import compose_cfg

ROOT = Path(__file__).resolve().parent.parent


def history(cfg, key: str) -> list[tuple[int, float]]:
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment).experiment_id])
    return sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, key))


# ---- the controller alone ----

def test_update_is_the_proportional_rule():
    ctl = AdaptiveKL(init_beta=0.1, target=2.0, horizon=1000, clip=0.2)
    beta = 0.1
    for kl in (2.5, 1.0, 100.0, -3.0, 2.0):  # inside the clip, clipped above and below, on target
        err = min(max(kl / 2.0 - 1, -0.2), 0.2)
        beta *= 1 + err * 64 / 1000
        assert ctl.update(kl, 64) == pytest.approx(beta, rel=1e-15)
    assert ctl.error(100.0) == 0.2 and ctl.error(-3.0) == -0.2 and ctl.error(2.0) == 0.0


def test_state_round_trip_and_kind_check():
    a = AdaptiveKL(init_beta=0.3, target=1.0, horizon=500)
    for kl in (0.2, 0.4, 3.0):
        a.update(kl, 32)
    b = AdaptiveKL(init_beta=0.3, target=1.0, horizon=500)
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta != 0.3
    with pytest.raises(ValueError, match="'adaptive', this run's is 'fixed'"):
        FixedKL(0.05).load_state_dict(a.state_dict())


def test_fixed_never_moves_and_keeps_the_configs_beta_on_resume():
    ctl = build_kl_control({"name": "fixed"}, 0.05)
    assert ctl.update(10.0, 64) == 0.05 and ctl.signal is None
    ctl.load_state_dict({"name": "fixed", "beta": 0.7})  # ckpt_allow_changes=[estimator.beta]: the new one wins
    assert ctl.beta == 0.05
    assert build_kl_control(None, 0.2).beta == 0.2  # callers from before the group: fixed


def test_controller_refuses_what_would_break_beta():
    ctl = AdaptiveKL(init_beta=0.1, target=1.0, horizon=10, clip=0.2)
    with pytest.raises(ValueError, match="raise kl_ctl.horizon above 12.8"):
        ctl.update(0.0, 64)  # factor 1 - 0.2 * 64 / 10 < 0
    with pytest.raises(FloatingPointError, match="beta cannot be adapted"):
        ctl.update(float("nan"), 4)
    with pytest.raises(ValueError, match="kl_ctl.signal='k9' is unknown"):
        AdaptiveKL(init_beta=0.1, target=1.0, horizon=10, signal="k9")


def test_signals_are_the_logged_value_estimators():
    from typing import get_args

    from klbench.schema import KL_SIGNALS
    from klbench.tasks.rl import LOGGED_VALUES
    assert set(SIGNALS) == set(LOGGED_VALUES) == set(get_args(KL_SIGNALS))


# ---- bad input: the schema, and the CLI before anything heavy ----

@pytest.mark.parametrize("overrides,match", [
    (["kl_ctl.target=0"], "kl_ctl.target must be a finite number > 0, got 0"),
    (["kl_ctl.target=-1.5"], "kl_ctl.target must be a finite number > 0"),
    (["kl_ctl.horizon=0"], "kl_ctl.horizon must be a finite number > 0"),
    (["kl_ctl.horizon=-100"], "kl_ctl.horizon must be a finite number > 0"),
    (["kl_ctl.horizon=5"], r"kl_ctl.horizon=5 must exceed kl_ctl.clip x sequences per step = 0.2 x 32"),
    (["kl_ctl.signal=k4"], "kl_ctl.signal must be one of 'mc', 'k2', 'k3', 'cv_seq', 'cv_opt', 'rb', got 'k4'"),
    (["kl_ctl.init_beta=0"], "kl_ctl.init_beta must be a finite number > 0"),
    (["estimator.beta=0"], "kl_ctl.init_beta must be a finite number > 0"),  # its default follows estimator.beta
    (["kl_ctl.clip=0"], "kl_ctl.clip must be a finite number > 0"),
    (["+kl_ctl.gain=2"], "kl_ctl.gain does not apply to kl_ctl 'adaptive'"),
    (["experiment=distill_tabular"], "task=distill .* beta stays fixed at 1, so kl_ctl must be fixed"),
    (["kl_ctl.signal=cv_opt", "task.prompts_per_step=1", "task.n_samples=1", "task.reward_coef=0"],
     "cv_opt .* needs at least 2 sequences per step"),
])
def test_schema_rejects(tmp_path, overrides, match):
    cfg = compose_cfg(tmp_path, ["kl_ctl=adaptive", *overrides])
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_schema_accepts_every_signal_and_fixed_options_stay_closed(tmp_path):
    for signal in SIGNALS:
        validate(compose_cfg(tmp_path, ["kl_ctl=adaptive", f"kl_ctl.signal={signal}"]))
    validate(compose_cfg(tmp_path, ["experiment=distill_tabular"]))  # fixed: distillation as before
    with pytest.raises(ConfigError, match="kl_ctl.target does not apply to kl_ctl 'fixed'"):
        validate(compose_cfg(tmp_path, ["+kl_ctl.target=2"]))
    with pytest.raises(ConfigError, match="kl_ctl.name='pid' is unknown; valid: fixed, adaptive"):
        validate(compose_cfg(tmp_path, ["kl_ctl.name=pid"]))


@pytest.mark.parametrize("overrides,field", [
    (["kl_ctl.target=0"], "kl_ctl.target"), (["kl_ctl.horizon=-1"], "kl_ctl.horizon"),
    (["kl_ctl.signal=kl"], "kl_ctl.signal"), (["experiment=distill"], "task=distill"),
])
def test_cli_stops_bad_kl_ctl_before_anything_is_built(tmp_path, overrides, field):
    outputs = tmp_path / "outputs"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID",
                                                            "KLBENCH_RESUME_CKPT")}
    env.update(KLBENCH_OUTPUTS=str(outputs), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "klbench.cli", "kl_ctl=adaptive", *overrides], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"klbench: error: {field}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and time.time() - t0 < 30  # no torch: seconds even on a busy machine
    assert not outputs.exists() or not any(outputs.rglob("*"))


# ---- runs on the tabular model: val/seq_kl is the exact KL(pi || pi_ref) ----

# lr 0.03 (the tabular preset has 0.1): at 0.1 the policy's own SGD noise moves the exact KL by about
# +-15% between validations even at a fixed beta, more than the tolerance. horizon 4000 (64 sequences a
# step: beta moves at most 0.32% a step) keeps the loop from oscillating against the policy's lag.
HOLD = ["experiment=tabular", "kl_ctl=adaptive", "task.lr=0.03", "task.max_steps=600", "task.val_every=10",
        "kl_ctl.horizon=4000"]


@pytest.mark.parametrize("target,init_beta", [(0.5, 0.5), (2.0, 1.0)])  # the beta each holds is far from both
def test_adaptive_reaches_and_holds_the_target_exact_kl(tmp_path, target, init_beta):
    """Exact KL averaged over each 100-step window of the last 300 steps (10 validations each) within
    +-10% of the target, for two targets 4x apart; beta ends far from where it started."""
    cfg = compose_cfg(tmp_path, HOLD + [f"kl_ctl.target={target}", f"kl_ctl.init_beta={init_beta}"])
    run(cfg)
    kl = history(cfg, "val/seq_kl")
    assert kl[0] == (0, 0.0) and kl[-1][0] == 600
    for lo in (300, 400, 500):
        window = [v for s, v in kl if lo < s <= lo + 100]
        assert len(window) == 10
        mean = sum(window) / len(window)
        assert abs(mean / target - 1) < 0.10, (lo, mean, kl)
    betas = history(cfg, "train/beta")
    assert [s for s, _ in betas] == list(range(600))  # every step
    assert betas[0][1] == init_beta and abs(math.log(betas[-1][1] / init_beta)) > 0.15
    signal = history(cfg, "train/kl_ctl_signal")
    assert len(signal) == 600 and all(math.isfinite(v) for _, v in signal)


SHORT = ["experiment=tabular", "kl_ctl=adaptive", "kl_ctl.target=0.5", "kl_ctl.horizon=400", "task.val_every=10",
         "task.log_every=1", "kl_ctl.signal=mc"]


def test_resume_continues_the_beta_trajectory_exactly(tmp_path):
    """30 steps straight == 10, stop, resume to 30: same beta every step (the controller's state travels in
    the checkpoint; without it the resumed run would restart from init_beta), same metrics."""
    straight = compose_cfg(tmp_path / "a", SHORT + ["task.max_steps=30"])
    full = run(straight)
    run(compose_cfg(tmp_path / "b", SHORT + ["task.max_steps=10"]))
    ckpt = torch.load(tmp_path / "b" / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["kl_ctl"]["name"] == "adaptive" and ckpt["kl_ctl"]["beta"] != 0.5
    resumed = compose_cfg(tmp_path / "b", SHORT + ["task.max_steps=30", "ckpt_path=last",
                                                   "ckpt_allow_changes=[task.max_steps]"])
    out = run(resumed)
    a, b = history(straight, "train/beta"), history(resumed, "train/beta")
    assert [s for s, _ in b] == list(range(30)) and a == b
    assert a[-1][1] != a[10][1] != a[0][1]  # beta moved both before and after the interruption
    for key in ("train/kl_ctl_signal", "train/kl_mc", "train/loss"):
        (sa, va), (sb, vb) = zip(*history(straight, key)), zip(*history(resumed, key))
        assert sa == sb == tuple(range(30)) and va == pytest.approx(vb, rel=1e-9), key
    assert out["val/seq_kl"] == pytest.approx(full["val/seq_kl"], rel=1e-9)


def test_fixed_logs_a_constant_beta_and_resume_refuses_a_controller_change(tmp_path):
    fixed = compose_cfg(tmp_path, ["experiment=tabular", "task.max_steps=10", "task.val_every=10",
                                   "estimator.beta=0.3"])
    run(fixed)
    steps, betas = zip(*history(fixed, "train/beta"))
    assert steps == tuple(range(10)) and betas == pytest.approx([0.3] * 10, rel=1e-7)  # logged as float32
    assert history(fixed, "train/kl_ctl_signal") == []
    from klbench.resume import ResumeError
    other = compose_cfg(tmp_path, ["experiment=tabular", "task.max_steps=20", "task.val_every=10",
                                   "estimator.beta=0.3", "kl_ctl=adaptive", "ckpt_path=last",
                                   "ckpt_allow_changes=[task.max_steps]"])
    with pytest.raises(ResumeError, match=r"kl_ctl.name \('fixed' in the checkpoint, 'adaptive' now\)"):
        run(other)


def test_checkpoint_from_before_kl_ctl_resumes_as_fixed():
    from klbench.resume import config_changes
    cfg = compose_cfg(Path("/nonexistent"), ["experiment=tabular"])
    from omegaconf import OmegaConf
    saved = OmegaConf.to_container(cfg, resolve=True)
    del saved["kl_ctl"]
    assert config_changes(saved, cfg) == []
    with open_dict(cfg):
        cfg.kl_ctl = {"name": "adaptive", "target": 1.0, "horizon": 1000, "init_beta": 0.5, "clip": 0.2,
                      "signal": "rb"}
    assert any(c.startswith("kl_ctl.name ('fixed'") for c in config_changes(saved, cfg))


def test_adaptive_on_a_language_model(tmp_path, tiny_lm_dir):
    """The LM path: k3 on token log-ratios, DDP-safe reduce, run name with the target and signal."""
    cfg = compose_cfg(tmp_path, ["model=hf", f"model.name_or_path={tiny_lm_dir}", "task.max_steps=4",
                                 "task.val_every=2", "task.prompts_per_step=4", "task.val_prompts=4",
                                 "task.max_new_tokens=8", "estimator=naive_mc", "estimator.beta=1.0",
                                 "kl_ctl=adaptive", "kl_ctl.signal=k3", "kl_ctl.target=0.01", "kl_ctl.horizon=100"])
    run(cfg)
    client = mlflow.MlflowClient(cfg.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment).experiment_id])
    assert r.info.run_name == "rl-hf-naive_mc-kltarget0.01-k3-seed0"
    betas = [v for _, v in history(cfg, "train/beta")]
    signal = [v for _, v in history(cfg, "train/kl_ctl_signal")]
    assert len(betas) == len(signal) == 4 and betas[0] == 1.0
    for i in range(3):  # beta follows the rule from the logged signal
        err = min(max(signal[i] / 0.01 - 1, -0.2), 0.2)
        assert betas[i + 1] == pytest.approx(betas[i] * (1 + err * 16 / 100), rel=1e-6)


# ---- the sweep over targets ----

def test_rl_target_kl_sweep_composes(tmp_path, monkeypatch):
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from klbench.compose import compose
    for var in ("MLFLOW_TRACKING_URI", "KLBENCH_PARENT_RUN_ID", "KLBENCH_RESUME_CKPT"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose(["sweep=rl_target_kl", "experiment=tabular", "kl_ctl.signal=mc"], outputs=tmp_path / "outputs",
                  hydra=True)
    sw = cfg.hydra.sweeper
    assert cfg.kl_ctl.name == "adaptive" and cfg.kl_ctl.signal == "mc"
    assert sw.study_name == "klbench-rl_target_kl-rb-mc-tabular" and cfg.logger.experiment == "sweep-rl_target_kl-tabular"
    assert list(sw.direction) == ["maximize", "minimize"] and list(cfg.optimized_metrics) == ["val/reward", "val/seq_kl"]
    assert cfg.hydra.callbacks.sweep_tracking._target_ == "klbench.sweep.callback.SweepTracking"
    dists, fixed, _ = create_params_from_overrides([f"{k}={v}" for k, v in sw.params.items()])
    assert list(dists) == ["kl_ctl.target"] and not fixed and dists["kl_ctl.target"].log
    validate(cfg)


@pytest.mark.slow
def test_rl_target_kl_sweep_runs_two_trials(tmp_path):
    """Two tabular trials: children of one parent run, each with its own sampled target, a Pareto plot
    on the parent as for the other sweeps."""
    from test_sweeps import children, klbench_multirun, mlflow_client
    outputs = tmp_path / "outputs"
    klbench_multirun(outputs, "sweep=rl_target_kl", "experiment=tabular", "task.max_steps=40", "task.val_every=20",
                     "kl_ctl.horizon=2000", "hydra.sweeper.n_trials=2", timeout=600)
    client = mlflow_client(outputs)
    exp = client.get_experiment_by_name("sweep-rl_target_kl-tabular")
    (parent,) = client.search_runs([exp.experiment_id], "tags.klbench.sweep = 'rl_target_kl'")
    assert parent.info.status == "FINISHED"
    kids = children(client, parent.info.run_id)
    assert len(kids) == 2 and {k.info.status for k in kids} == {"FINISHED"}
    targets = {float(k.data.params["kl_ctl.target"]) for k in kids}
    assert len(targets) == 2 and all(0.1 <= t <= 10 for t in targets)
    assert all(k.info.run_name.startswith("rl-tabular-rb-kltarget") for k in kids)
    assert {"pareto.png", "pareto.csv"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
