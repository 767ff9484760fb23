"""The exact reward-vs-KL frontier of a tabular sweep, drawn on its Pareto plot and measured against
(klbench.sweep.parent.log_frontier_gaps): the tabular model's optimum, computed, not estimated."""
from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def exact_frontier(config: DictConfig):
    """The exact reward-vs-KL frontier of the tabular model and reward the trials train on (built by the
    same build_policy / build_reward the trials use); None otherwise."""
    model, reward = config.model, config.reward
    if model.kind != "tabular" or reward.kind != "tabular":
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}  # absent when composed without hydra
    swept = [k for k in params if k.split(".")[0] in ("model", "reward")
             or k in ("task.temperature", "task.top_k", "task.top_p", "task.kl_target")]
    if swept:
        log.info("no exact frontier: the sweep changes %s, so trials do not share one", swept)
        return None
    from klbench.models.policies import build_policy, task_sampling
    from klbench.rewards.reward import build_reward
    sampling, target = task_sampling(config.task)  # the trials' sampling: the frontier is that of their target
    policy = build_policy(model, max_new_tokens=1, sampling=sampling, kl_target=target)  # tabular: no disk
    return policy.exact_frontier(build_reward(reward, policy))
