"""verl: `verl.trainer.ppo.core_algos.kl_penalty`, every kl_loss_type, as the actor's KL loss (use_kl_loss=True).

Aggregation: the per-sequence loss is the masked token sum of kl_penalty's [B, T] output (verl's
loss_agg_mode "seq-mean-token-sum"). verl's default "token-mean" divides the batch's token sum by its token
count instead, which in the large-batch limit is a constant factor of this. verl's KL loss takes no
importance weight, so under a behaviour policy the same per-token values are summed over pi_old's samples.

`use_kl_in_reward` (settings verl.kl_in_reward.*): `ray_trainer.apply_kl_penalty` evaluates kl_penalty on
the rollout's old_log_probs and subtracts beta * kld from the token-level rewards. ray_trainer itself imports
torchdata and the whole trainer, so the adapter calls kl_penalty exactly as that function does
(old log-probs, detached) and feeds the result to klbench's return-to-go REINFORCE surrogate
(base.reward_to_go_surrogate); verl's own advantage estimators (GAE with a critic, GRPO/RLOO groups,
batch whitening) are not run.
Not covered yet: the actor's full `ppo_loss` (policy term plus KL, verl/workers/utils/losses.py).
"""
from __future__ import annotations

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import Library, Setting, old_or_current, require, reward_to_go_surrogate, source_of, token_sum

DIST, SUPPORTED = "verl", "0.9.1"
KL_TYPES = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+")


def load() -> Library:
    version = require(DIST, SUPPORTED)
    from verl.trainer.ppo import core_algos  # imports ray and tensordict: see scripts/install_libraries.sh

    lib = Library(DIST, version)
    src = source_of(core_algos.kl_penalty)
    for kind in KL_TYPES:
        def loss(batch: KLBatch, kind=kind) -> torch.Tensor:
            return token_sum(core_algos.kl_penalty(batch.masked_logp, batch.ref_logp, kind), batch)

        lib.settings[f"verl.kl_penalty.{kind}"] = Setting(
            f"verl.kl_penalty.{kind}", loss, src, "token sum per sequence (seq-mean-token-sum), in the loss",
            "use_kl_loss=True, kl_loss_type=" + kind)
    for kind in ("kl", "low_var_kl"):  # "kl" is algorithm.kl_penalty's default
        def reward_loss(batch: KLBatch, kind=kind) -> torch.Tensor:
            with torch.no_grad():
                kld = core_algos.kl_penalty(old_or_current(batch), batch.ref_logp, kl_penalty=kind)
            return reward_to_go_surrogate(kld, batch)

        lib.settings[f"verl.kl_in_reward.{kind}"] = Setting(
            f"verl.kl_in_reward.{kind}", reward_loss, src,
            "in the reward on old_log_probs (as ray_trainer.apply_kl_penalty); return-to-go REINFORCE (klbench's)",
            "use_kl_in_reward=True, kl_penalty=" + kind + (" (default)" if kind == "kl" else ""))
    return lib
