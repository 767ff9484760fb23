"""task.advantage and task.loss_agg (klbench/estimators/advantages.py): each against a hand computation on one
batch; the config's refusals; the task's loss built from them."""
from __future__ import annotations

import math

import pytest
import torch

from klbench.config.schema import ConfigError, validate
from klbench.estimators.advantages import advantage, aggregate, reward_loss
from test_config import compose_cfg

# two prompts, three samples each
R = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0, 0.0], dtype=torch.float64)
G = torch.tensor([0, 0, 0, 1, 1, 1])


def test_advantages_by_hand():
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); group 1: mean 2, std 2
    s0 = math.sqrt(1 / 3)
    eps = 1e-6
    grpo = [(2 / 3) / (s0 + eps), (-1 / 3) / (s0 + eps), (-1 / 3) / (s0 + eps), 0.0, 2 / (2 + eps), -2 / (2 + eps)]
    dr = [2 / 3, -1 / 3, -1 / 3, 0.0, 2.0, -2.0]
    rloo = [1.0, -0.5, -0.5, 0.0, 3.0, -3.0]  # r_i - mean of the two others
    rf = [1 - 7 / 6, -7 / 6, -7 / 6, 2 - 7 / 6, 4 - 7 / 6, -7 / 6]  # batch mean 7/6
    for kind, want in (("grpo", grpo), ("dr_grpo", dr), ("rloo", rloo), ("reinforce", rf)):
        got = advantage(R, G, kind, eps)
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-12), kind
    # TRL's epsilon is another option value, not another formula
    assert math.isclose(float(advantage(R, G, "grpo", 1e-4)[4]), 2 / (2 + 1e-4), rel_tol=1e-12)


def test_grpo_of_a_constant_group_is_zero_not_nan():
    adv = advantage(torch.ones(4, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), "grpo")
    assert torch.equal(adv, torch.zeros(4, dtype=torch.float64))


def test_group_advantage_refuses_a_prompt_sampled_once():
    with pytest.raises(ValueError, match="n >= 2 samples per prompt"):
        advantage(R[:4], torch.tensor([0, 0, 0, 1]), "grpo")


def test_aggregations_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], dtype=torch.float64)  # 9: padding
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    want = {"seq_sum": (6 + 4) / 2, "token_mean": (6 + 4) / 4, "seq_mean_token_mean": (6 / 3 + 4 / 1) / 2,
            "seq_sum_norm": (6 + 4) / 2 / 4}
    for kind, w in want.items():
        assert math.isclose(float(aggregate(x, mask, kind, max_len=4)), w, rel_tol=1e-12), kind
    with pytest.raises(ValueError, match="task.loss_agg must be one of"):
        aggregate(x, mask, "sum")


def test_reward_loss_gradient_weights_each_token_by_its_aggregation():
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    reward_loss(adv, logp, mask, "seq_mean_token_mean").backward()
    want = -torch.tensor([[1 / 3, 1 / 3, 1 / 3], [-2.0, 0, 0]], dtype=torch.float64) / 2
    assert torch.allclose(logp.grad, want)


# ---- the config ----

TAB = ["experiment=tabular"]


@pytest.mark.parametrize("overrides,match", [
    (TAB + ["task.advantage=grpo", "task.n_samples=1"], "task.advantage=grpo normalises over the samples of a "
                                                         "prompt, but task.n_samples=1 gives no group"),
    (TAB + ["task.advantage=dr_grpo", "task.n_samples=1", "task.reward_coef=0"], "gives no group"),
    (TAB + ["task.advantage=reinforce", "task.n_samples=1", "task.prompts_per_step=1"],
     "batch mean, which needs at least 2 sequences"),
    (TAB + ["task.loss_agg=token_mean", "task.reward_coef=0"], "task.reward_coef=0 leaves none"),
    (TAB + ["reward=none", "task.advantage=grpo"], "reward=none leaves none"),
    (TAB + ["task.advantage=gspo"], "task.advantage"),
    (TAB + ["task.loss_agg=sum"], "task.loss_agg"),
    (TAB + ["task.adv_eps=0"], "task.adv_eps"),
    (TAB + ["estimator=in_reward", "estimator.kl_norm=before", "estimator.baseline=loo"],
     "estimator.kl_norm=before .* needs estimator.form=sequence, estimator.baseline=none"),
])
def test_bad_reward_term(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(compose_cfg(tmp_path, overrides))


def test_good_reward_terms(tmp_path):
    validate(compose_cfg(tmp_path, TAB + ["task.advantage=reinforce", "task.n_samples=1"]))
    validate(compose_cfg(tmp_path, TAB + ["task.advantage=grpo", "task.loss_agg=seq_mean_token_mean"]))
    # the KL fused into the reward is a reward term even without a reward
    validate(compose_cfg(tmp_path, TAB + ["reward=none", "task.advantage=grpo", "estimator=in_reward",
                                          "estimator.kl_norm=before"]))


# ---- the task's loss ----

def _task(tmp_path, overrides):
    from klbench.models.policies import build_policy
    from klbench.rewards.reward import build_reward
    from klbench.tasks import build_task
    cfg = compose_cfg(tmp_path, TAB + ["logger=none"] + overrides)
    validate(cfg)
    torch.manual_seed(0)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache)
    with torch.no_grad():
        policy.theta.add_(torch.randn_like(policy.theta))
    return build_task(cfg, policy, build_reward(cfg.reward, policy))


def _grad(module, prompts):
    torch.manual_seed(1)
    ro = module.policy.rollout(prompts, module.cfg["n_samples"])
    batch = module.policy.score(ro)
    reward = module.rewards(ro)
    adv = module.reward_advantage(batch, reward, ro.group)
    loss, _ = module.total_loss(batch, reward_loss(adv, batch.masked_logp, batch.mask, *module.loss_agg), "test")
    return torch.autograd.grad(loss, module.policy.theta, retain_graph=True)[0], ro, batch, reward


def test_fused_kl_is_in_the_advantage(tmp_path):
    """kl_norm=before: the task's loss is the reward term of A(r - beta v), v = k1 per sequence, and no separate
    KL term; with grpo it differs from kl_norm=after (the std divides the KL too)."""
    over = ["task.advantage=grpo", "estimator=in_reward", "estimator.beta=0.5"]
    fused = _task(tmp_path, over + ["estimator.kl_norm=before"])
    g, ro, batch, reward = _grad(fused, [fused.policy.fixed_prompt] * 4)
    v = batch.rho.detach().sum(-1)  # [B] k1 per sequence
    a = advantage(reward - 0.5 * v.to(reward.dtype), ro.group, "grpo")
    want = torch.autograd.grad(-(a.unsqueeze(-1) * batch.masked_logp).sum(-1).mean(), fused.policy.theta)[0]
    assert torch.allclose(g, want, atol=1e-12)
    after = _task(tmp_path, over)
    g_after, *_ = _grad(after, [after.policy.fixed_prompt] * 4)
    assert not torch.allclose(g, g_after, atol=1e-6)


def test_ppo_reward_loss_at_ratio_one_is_the_on_policy_reward_term():
    """task.inner_steps > 1 aggregates PPO's clipped term as task.loss_agg: at pi == pi_old its gradient is the
    on-policy reward term's, for every aggregation."""
    from klbench.estimators.advantages import ppo_reward_loss
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    old = torch.randn(2, 3, dtype=torch.float64)
    for kind in ("seq_sum", "token_mean", "seq_mean_token_mean", "seq_sum_norm"):
        logp = old.clone().requires_grad_()
        g_ppo = torch.autograd.grad(ppo_reward_loss(logp, old, mask, adv, 0.2, (kind, 3))[0], logp)[0]
        g_on = torch.autograd.grad(reward_loss(adv, logp, mask, kind, 3), logp)[0]
        assert torch.allclose(g_ppo, g_on, atol=1e-12), kind
