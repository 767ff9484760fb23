"""task.inner_steps (several optimiser steps per rollout) and task.clip_eps: the unchanged path at 1, the PPO
step at ratio 1, the logged ratio statistics, exact resume, and the config rules."""
from __future__ import annotations

import math

import mlflow
import pytest
import torch

import klbench.tasks.rl as rl_module
from klbench.config.schema import ConfigError, validate
from klbench.estimators.advantages import ppo_reward_loss
from klbench.tasks.train import run_task
from test_config import compose_cfg

TABULAR = ["experiment=tabular", "task.val_every=8", "task.max_steps=16"]


def test_inner_steps_1_is_the_unchanged_path(tmp_path, monkeypatch):
    # inner_steps=1 must never reach PPO's reward loss, and gives bit for bit the run of the default config
    # (whatever task.clip_eps says: it is PPO's)
    def forbidden(*a, **k):
        raise AssertionError("ppo_reward_loss called with inner_steps=1")
    monkeypatch.setattr(rl_module, "ppo_reward_loss", forbidden)
    a = run_task(compose_cfg(tmp_path / "a", TABULAR + ["logger=none", "task.inner_steps=1", "task.clip_eps=0.05"]))
    b = run_task(compose_cfg(tmp_path / "b", TABULAR + ["logger=none"]))
    assert a == b


def _module(tmp_path, overrides):
    from klbench.models.policies import build_policy
    from klbench.rewards.reward import build_reward
    from klbench.tasks import build_task
    cfg = compose_cfg(tmp_path, TABULAR + ["logger=none", "task.log_every=1000"] + overrides)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache)
    with torch.no_grad():
        policy.theta.add_(torch.randn(policy.theta.shape, generator=torch.Generator().manual_seed(3),
                                      dtype=policy.theta.dtype))
    module = build_task(cfg, policy, build_reward(cfg.reward, policy))
    module.log_now = lambda metrics: None  # no trainer here; logging is tested through full runs below
    return module


@pytest.mark.parametrize("estimator", [["estimator=rb"], ["estimator=in_loss", "estimator.value=k3"],
                                       ["estimator=in_reward", "estimator.baseline=loo"]])
def test_first_step_of_a_rollout_is_the_on_policy_step(tmp_path, estimator):
    # at step 0 of a rollout the ratio is exactly 1: the PPO loss and the KL batch with old_logp give the
    # on-policy RLOO + estimator gradient (the loss values differ: PPO's surrogate is the ratio, not log pi)
    grads = []
    for k in (1, 4):
        module = _module(tmp_path / str(k), estimator + [f"task.inner_steps={k}"])
        torch.manual_seed(0)
        loss = module.training_step(["p"] * 16, 0)
        (g,) = torch.autograd.grad(loss, module.policy.theta)
        grads.append(g)
    assert module.cached_rollout is not None and float(grads[0].norm()) > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)


def test_ppo_reward_loss_clips_and_counts():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.9], [0.2, 0.3, 0.1]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.4, 0.3, 0.9]], dtype=torch.float64))  # ratios 2, 1 | 0.5, 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)  # the third tokens are padding
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = ppo_reward_loss(logp, old, mask, adv, clip_eps=0.2)
    # token (0,0): ratio 2 > 1.2 with A > 0 -> clipped; token (1,0): ratio 0.5 < 0.8 with A < 0 -> clipped
    assert float(stats["train/clip_frac"]) == 0.5
    assert math.isclose(float(stats["train/ratio_mean"]), (2 + 1 + 0.5 + 1) / 4)
    # clipped tokens carry no gradient, unclipped ones A * ratio
    assert math.isclose(float(loss), -((1.2 + 1) * 1 + (0.8 + 1) * -1) / 2)
    (g,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(g, torch.tensor([[0, -0.5, 0], [0, 0.5, 0]], dtype=torch.float64))


def test_off_policy_run_logs_ratios_and_resumes_exactly(tmp_path):
    over = ["task.inner_steps=4", "estimator=in_loss", "estimator.value=k3", "task.log_every=1"]
    straight = run_task(compose_cfg(tmp_path / "a", TABULAR + over + ["logger=none"]))
    first = compose_cfg(tmp_path / "b", TABULAR + over + ["task.max_steps=8"])
    run_task(first)
    resumed = compose_cfg(tmp_path / "b", TABULAR + over + ["ckpt_path=last", "ckpt_allow_changes=[task.max_steps]"])
    out = run_task(resumed)
    assert math.isclose(out["val/seq_kl"], straight["val/seq_kl"], rel_tol=1e-9)
    assert math.isclose(out["val/reward"], straight["val/reward"], rel_tol=1e-9)
    client = mlflow.MlflowClient(resumed.logger.tracking_uri)
    (r,) = client.search_runs([client.get_experiment_by_name(resumed.logger.experiment).experiment_id])

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(r.info.run_id, key)}
    ratio, clip, kl = history("train/ratio_mean"), history("train/clip_frac"), history("train/kl_mc")
    assert sorted(ratio) == sorted(clip) == list(range(16))  # one value per step, resume included
    assert sorted(kl) == [0, 4, 8, 12]  # value estimators only where the samples are on-policy
    assert all(ratio[s] == 1.0 and clip[s] == 0.0 for s in (0, 4, 8, 12))
    assert any(abs(ratio[s] - 1) > 1e-3 for s in ratio if s % 4)  # the policy moved within a rollout
    assert all(0 <= v <= 1 for v in clip.values())


@pytest.mark.parametrize("overrides,field", [
    (["task.inner_steps=0"], "task.inner_steps"),
    (["task.clip_eps=0"], "task.clip_eps"),
    (["task.inner_steps=4", "estimator=seq"], "task.inner_steps=4"),
    (["task.inner_steps=4", "estimator=in_loss", "estimator.ratio=none"], "task.inner_steps=4"),
    (["task.inner_steps=3"], "task.val_every=40"),  # 40 % 3
    (["task.inner_steps=4", "task.max_steps=122"], "task.max_steps=122"),
    (["estimator=in_reward", "estimator.lam=0.5"], "estimator.lam"),
    (["estimator=in_reward", "estimator.value=k4"], "estimator.value"),
    (["estimator=in_loss", "estimator.value=cv", "estimator.level=sequence"], "estimator.ratio=token"),
    (["estimator=in_loss", "estimator.ratio=none", "estimator.ratio_grad=differentiable"], "estimator.ratio=none"),
    (["estimator=in_reward", "estimator.baseline=loo", "task.n_samples=1"], "estimator.baseline=loo"),
])
def test_bad_off_policy_config(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, overrides))
    assert str(e.value).startswith(field), str(e.value)


@pytest.mark.parametrize("overrides", [["task.inner_steps=4"], ["task.inner_steps=4", "estimator=in_reward"],
                                       ["task.inner_steps=8", "estimator=in_loss", "estimator.ratio=sequence"]])
def test_good_off_policy_config(tmp_path, overrides):
    validate(compose_cfg(tmp_path, overrides))


def test_pareto_labels_each_placement_cell():
    from klbench.analysis.mlflow_io import estimator_label
    assert estimator_label({"estimator.name": "in_reward", "estimator.value": "k3"}) == "in_reward:k3"
    assert estimator_label({"estimator.name": "in_loss", "estimator.value": "k1"}) != "in_loss:k3"
    assert estimator_label({"estimator.name": "rb"}) == "rb"
