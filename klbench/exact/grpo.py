"""Exact statements about the GRPO family on the tabular model (docs/rlvr.md, tests/test_rlvr_exact.py).

One prompt, n samples y_1..y_n ~ pi, a reward r(y), the KL value v(y) = sum_t log pi/pi_ref (k1) per sequence.
The RL task's loss on the group (seq_sum aggregation) is the mean over i of

    after (FRPO):  L_i = -A(r)_i sum_t l_{i,t} + beta * in_reward surrogate_i     (klbench.estimators.placement)
    fused:         L_i = -A(r - beta v)_i sum_t l_{i,t}                           (the KL inside the advantage)

with A = task.advantage (klbench.estimators.advantages). `expected_gradient` enumerates every n-tuple of
sequences (TabularModel.gradient_moments) and gives E[grad L] exactly. What it comes to, A by A:

    rloo     after and fused:  -grad (E[r] - beta KL)                    the KL-regularised objective
    dr_grpo  after:            -(1 - 1/n) grad E[r] + beta grad KL       objective (1 - 1/n) E[r] - beta KL
             fused:            -(1 - 1/n) grad (E[r] - beta KL)          objective E[r] - beta KL (scaled)
    grpo     after, binary r:  -c_n(p) grad p + beta grad KL             objective F_n(p) - beta KL, p = P(r = 1),
                                                                         F_n = integral of c_n (grpo_objective)
             fused:            a vector field with an asymmetric Jacobian: the gradient of no objective at all

c_n(p) (binary_grpo_coefficient) is E[A_i | r_i = 1] - E[A_i | r_i = 0]: the others' rewards are independent of
y_i, so E[A_i grad log pi(y_i)] = sum_y grad pi(y) E[A_i | r(y)] = c_n(p) grad p. `jacobian_asymmetry` tells a
gradient field (symmetric Jacobian) from one that is none.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from klbench.estimators import KLBatch, gradient_estimator
from klbench.estimators.advantages import advantage
from klbench.exact.tabular import DTYPE


def rl_surrogate(adv: str, kl_norm: str, beta: float, value: str = "k1", eps: float = 1e-6,
                 form: str = "sequence") -> Callable:
    """surrogate(batch, reward [B]) -> [B] per-sample L_i of the RL task's loss, as in the module docstring
    (form="reward_to_go" with kl_norm="after": FRPO's placement, estimator=frpo)."""
    est = gradient_estimator("in_reward", value=value, kl_norm=kl_norm, form=form)
    logp_sum = lambda b: b.masked_logp.sum(-1)  # noqa: E731  [B]

    def after(batch: KLBatch, reward: torch.Tensor) -> torch.Tensor:
        return -advantage(reward, batch.group, adv, eps) * logp_sum(batch) + beta * est(batch)

    def before(batch: KLBatch, reward: torch.Tensor) -> torch.Tensor:
        a = advantage(reward - beta * est.sequence_value(batch), batch.group, adv, eps)
        return -a * logp_sum(batch)

    return {"after": after, "before": before}[est.kl_norm]  # est.kl_norm: "fused" is "before"'s old name


def expected_gradient(model, theta: torch.Tensor, reward: torch.Tensor, n: int,
                      surrogate: Callable) -> torch.Tensor:
    """[P, K] E[grad (1/n) sum_i L_i] over n i.i.d. samples of pi, exactly (model: klbench.exact.tabular's)."""
    return model.gradient_moments(surrogate, theta, n, reward=reward).mean


def binary_grpo_coefficient(p: float, n: int, eps: float = 1e-6) -> float:
    """c_n(p) = E[A_i | r_i = 1] - E[A_i | r_i = 0] of grpo's advantage for a 0/1 reward with P(r = 1) = p:
    the k others correct ~ Binomial(n - 1, p); with c correct in the group, mean c/n, std sqrt(c (n-c) / (n (n-1)))."""
    out = 0.0
    for k in range(n):
        pk = math.comb(n - 1, k) * p ** k * (1 - p) ** (n - 1 - k)
        for r, sign in ((1, 1.0), (0, -1.0)):
            c = k + r
            std = math.sqrt(c * (n - c) / (n * (n - 1)))
            out += sign * pk * (r - c / n) / (std + eps)
    return out


def grpo_objective(p: float, n: int, eps: float = 1e-6) -> float:
    """F_n(p) = integral_0^p c_n(q) dq, exactly: c_n is a polynomial of degree n - 1 in q, integrated here term
    by term (Bernstein basis: integral_0^p q^k (1-q)^m dq expanded by the binomial theorem)."""
    total = 0.0
    for k in range(n):
        coef = 0.0
        for r, sign in ((1, 1.0), (0, -1.0)):
            c = k + r
            coef += sign * (r - c / n) / (math.sqrt(c * (n - c) / (n * (n - 1))) + eps)
        m = n - 1 - k
        # q^k (1-q)^m = sum_j C(m, j) (-1)^j q^(k+j)
        total += coef * math.comb(n - 1, k) * sum(math.comb(m, j) * (-1) ** j * p ** (k + j + 1) / (k + j + 1)
                                                  for j in range(m + 1))
    return total


def success_probability(model, theta: torch.Tensor, reward: torch.Tensor) -> torch.Tensor:
    """p = P_pi(r = 1) of a 0/1 reward table [N], differentiable in theta."""
    return (model.seq_logprob(theta).exp() * reward.to(DTYPE)).sum()


def jacobian_asymmetry(field: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor, h: float = 1e-5) -> float:
    """||J - J^T|| / ||J|| of the vector field theta -> field(theta) ([P, K] -> [P, K]), J by central differences.
    A gradient field has a symmetric Jacobian (~h^2 here); a clearly positive value says it is the gradient of no
    function."""
    flat = theta.detach().reshape(-1)
    cols = []
    for j in range(flat.numel()):
        e = torch.zeros_like(flat)
        e[j] = h
        up, down = field((flat + e).reshape(theta.shape)), field((flat - e).reshape(theta.shape))
        cols.append(((up - down) / (2 * h)).reshape(-1))
    J = torch.stack(cols, 1)  # [D, D]: J[i, j] = d field_i / d theta_j
    return float(torch.linalg.norm(J - J.T) / torch.linalg.norm(J))
