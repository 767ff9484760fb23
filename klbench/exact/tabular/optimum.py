"""The reward + beta * KL problem on the tabular model, exactly: a reward table, the closed-form optimum
pi*_beta ∝ pi_ref exp(r / beta), and the Pareto frontier of reward against kl_pi_ref that it traces.

    reward = TabularReward(model, seed=1)                # r [N] over the model's sequences
    frontier = pareto_frontier(model, reward.table)      # Frontier: betas, rewards, kls
    frontier.reward_gap(reward, kl)                      # what a policy at (reward, kl) leaves on the table
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from klbench.exact.tabular.model import DTYPE, TabularModel


class TabularReward:
    """A reward table r [N] over the tabular model's sequences: r(y) = scale * N(0, 1), fixed by seed."""

    def __init__(self, model: TabularModel, seed: int = 1, scale: float = 1.0):
        gen = torch.Generator().manual_seed(seed)
        self.table = scale * torch.randn(model.N, generator=gen, dtype=DTYPE)  # [N]

    def __call__(self, ro) -> torch.Tensor:
        """[B] the rewards of a rollout of klbench.models.policies.TabularPolicy, by its sequence ids."""
        return self.table[ro.seq_ids.cpu()]


def optimal_seq_logprob(model: TabularModel, reward: torch.Tensor, beta: float) -> torch.Tensor:
    """[N] log pi*_beta(y), pi*_beta ∝ pi_ref exp(r / beta): the maximiser of E[r] - beta KL(pi || pi_ref)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0 for the closed-form optimum, got {beta}")
    s = model.seq_logprob(model.ref_logits) + reward.to(DTYPE) / beta
    return s - torch.logsumexp(s, 0)


def table_from_seq_logprob(model: TabularModel, seq_logprob: torch.Tensor) -> torch.Tensor:
    """The autoregressive logit table [P, K] whose sequence distribution is exp(seq_logprob) [N]."""
    mass = torch.zeros(model.P, model.K, dtype=DTYPE)  # mass of sequences through (prefix, next token)
    p = seq_logprob.exp().unsqueeze(-1).expand(-1, model.T)  # [N, T]
    mass.index_put_((model.seq_prefix[model.mask], model.tokens[model.mask]), p[model.mask], accumulate=True)
    return mass.log()


def pareto_frontier(model: TabularModel, reward: torch.Tensor, betas: torch.Tensor | None = None) -> Frontier:
    """Exact reward-vs-kl_pi_ref frontier traced by pi*_beta over a beta grid (log-spaced by default)."""
    betas = torch.logspace(-3, 3, 400, dtype=DTYPE) if betas is None else betas.to(DTYPE)
    lr = model.seq_logprob(model.ref_logits)
    rewards, kls = [], []
    for beta in betas.tolist():
        ls = optimal_seq_logprob(model, reward, beta)
        rewards.append(float((ls.exp() * reward).sum()))
        kls.append(float((ls.exp() * (ls - lr)).sum()))
    return Frontier(betas, torch.tensor(rewards, dtype=DTYPE), torch.tensor(kls, dtype=DTYPE))


def rl_frontier(K: int, T: int, eos: int | None, ref_seed: int, ref_scale: float, reward_seed: int,
                reward_scale: float) -> Frontier:
    """The exact frontier of RL on the tabular model and reward with these settings (model.* and reward.* of
    `model=tabular reward=tabular`), built as klbench.models.policies and klbench.rewards.reward build them:
    what klbench-pareto draws for runs it knows only by their logged params."""
    model = TabularModel(K, T, eos=eos, seed=ref_seed, ref_scale=ref_scale)
    return pareto_frontier(model, TabularReward(model, seed=reward_seed, scale=reward_scale).table)


@dataclass
class Frontier:
    """Exact Pareto frontier: for each beta, the optimum's reward and kl_pi_ref (KL grows as beta falls)."""

    betas: torch.Tensor
    rewards: torch.Tensor
    kls: torch.Tensor

    def best_reward_at(self, kl: float) -> float:
        """Highest reward any policy reaches with kl_pi_ref <= kl (linear interpolation on the frontier)."""
        order = torch.argsort(self.kls)
        k, r = self.kls[order], self.rewards[order]
        if kl <= k[0]:
            return float(r[0])
        if kl >= k[-1]:
            return float(r[-1])
        j = int(torch.searchsorted(k, torch.tensor(kl, dtype=DTYPE)))
        f = (kl - k[j - 1]) / (k[j] - k[j - 1])
        return float(r[j - 1] + f * (r[j] - r[j - 1]))

    def reward_gap(self, reward: float, kl: float) -> float:
        """How much reward a policy at (reward, kl) leaves on the table versus the exact frontier (>= 0)."""
        return self.best_reward_at(kl) - reward
