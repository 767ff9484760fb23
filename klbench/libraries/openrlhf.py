"""OpenRLHF: `openrlhf.models.utils.compute_approx_kl`, k1/k2/k3, with and without unbiased_gradient, in the loss;
and the KL-in-the-reward path, `compute_reward` fed by compute_approx_kl.

`openrlhf/models/utils.py` imports deepspeed at module level (and `openrlhf/models/__init__.py` imports the
actor, flash-attn and transformers models), while compute_approx_kl and compute_reward need only torch. So
this adapter loads that one file by path with an empty stand-in module for `deepspeed` in sys.modules during
the load (its only use there, set_z3_leaf_modules, is never called); the code that runs is the installed
file's own.

In the loss (settings openrlhf.k1 ... openrlhf.k3.unbiased, use_kl_loss): masked token sum of
compute_approx_kl's [B, T] output per sequence (what the actor's KL loss sums before its token mean; the
token mean is a constant factor of it in the large-batch limit). log_probs_old is KLBatch.old_logp (None
on-policy, where OpenRLHF uses w = 1).

In the reward (settings openrlhf.reward.k1 (the default kl_estimator), .k2, .k3; kl.use_loss off, the
default): as trainer/ppo_utils/experience_maker.py does it. When making experience it calls
compute_approx_kl(action_log_probs, base_action_log_probs, kl_estimator=algo.kl.estimator), with no
log_probs_old and no unbiased_gradient, on the log-probs the actor computed for the rollout (the behaviour
policy's: KLBatch.old_logp, or the current ones detached on-policy), under torch.no_grad. Then
compute_advantages_and_returns calls compute_reward(r, kl_ctl.value, kl, action_mask, reward.clip_range).
Here r = 0 (only the KL moves the policy), kl_ctl.value = 1 (a FixedKLController holds algo.kl.init_coef,
default 0.01, for the whole run unless algo.kl.target makes it adaptive; with init_coef 0 there is no
reference model and no KL at all), reward.clip_range = OpenRLHF's default (-10, 10), which clips r only.
The per-token reward (-kl) then feeds klbench's return-to-go REINFORCE surrogate
(base.reward_to_go_surrogate, as verl.kl_in_reward does). OpenRLHF's own advantage estimator is not run:
its default, algo.advantage.estimator "gae", needs a critic; "reinforce" (get_cumulative_returns with
gamma = 1) computes the same return-to-go but then whitens advantages over the batch, and the actor's
PPO loss clips the ratio, neither of which klbench's surrogate does.
What they audit as: k1 follows kl_pi_ref on-policy (the score-function gradient of the sequence KL); off-policy
none of the above: the reward is pi_old's k1, not pi's, and the surrogate's per-token ratio does not reweight
prefixes (the same relative errors as verl.kl_in_reward.kl). k2 and k3 are none
of the above even on-policy: the reward is detached, so the score-function gradient misses E[grad v] (zero
only for k1), and k2's mean is not the KL; k3's value clamp to [-10, 10] (models/utils.py:113) fires as well.

At a temperature (Setting.scored): OpenRLHF's Actor.forward divides the logits by its temperature in place and
then calls log_probs_from_logits (models/actor.py); the actor, the old policy (the same actor at experience time)
and the reference model (an Actor built with the same rollout temperature, trainer/ray/launcher.py) all do. The
Actor's module imports flash_attn and cannot be imported here, so the adapter calls models/utils.py's
log_probs_from_logits(logits, labels, temperature), whose own in-place division is the same operation, on the
policy's and the reference's raw logits.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import (Library, line_in, package_file, Setting, old_or_current, require, rescored,
                                   reward_to_go_surrogate, source_of, token_sum)

DIST, SUPPORTED = "openrlhf", "0.11.2"
REWARD_CLIP_RANGE = (-10.0, 10.0)  # OpenRLHF's default --reward.clip_range (cli/train_ppo_ray.py)


def _load_utils():
    path = package_file(DIST, "models", "utils.py")
    mod_spec = importlib.util.spec_from_file_location("klbench_openrlhf_models_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    had = "deepspeed" in sys.modules
    if not had:
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # stand-in, removed again below
    try:
        mod_spec.loader.exec_module(module)
    finally:
        if not had:
            del sys.modules["deepspeed"]
    return module


def load() -> Library:
    version = require(DIST, SUPPORTED)
    utils = _load_utils()
    lib = Library(DIST, version)
    src = source_of(utils.compute_approx_kl)

    def score(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        return utils.log_probs_from_logits(logits.clone(), tokens, temperature=temperature)  # [B, T]; its div_ in place

    actor_div = line_in(DIST, "models/actor.py", '"logits"].div_(self.temperature)')
    ref_temp = line_in(DIST, "trainer/ray/launcher.py", "temperature=strategy.args.rollout.temperature")
    divides = (f"policy, reference and old: Actor.forward divides the logits ({actor_div}); the reference is an "
               f"Actor with the rollout temperature ({ref_temp}); scored here by "
               f"`{source_of(utils.log_probs_from_logits)}` (the Actor's module needs flash_attn)")
    for est in ("k1", "k2", "k3"):
        for unbiased in (False, True):
            def loss(batch: KLBatch, est=est, unbiased=unbiased) -> torch.Tensor:
                kl = utils.compute_approx_kl(batch.masked_logp, batch.ref_logp, batch.old_logp,
                                             kl_estimator=est, unbiased_gradient=unbiased)
                return token_sum(kl.to(batch.logp.dtype), batch)

            name = f"openrlhf.{est}" + (".unbiased" if unbiased else "")
            note = "default kl_estimator" if est == "k1" and not unbiased else ""
            lib.settings[name] = Setting(name, loss, src, "token sum per sequence, in the loss (use_kl_loss)", note,
                                         scored=rescored(loss, score), divides_by_t=divides)
    reward_src = source_of(utils.compute_reward)
    for est in ("k1", "k2", "k3"):
        def reward_loss(batch: KLBatch, est=est) -> torch.Tensor:
            with torch.no_grad():  # as the experience maker: the rollout's log-probs, no grad
                kl = utils.compute_approx_kl(old_or_current(batch), batch.ref_logp, kl_estimator=est)  # [B, T]
                r = torch.zeros(kl.shape[0], dtype=kl.dtype, device=kl.device)  # [B] no task reward
                reward = utils.compute_reward(r, 1.0, kl, action_mask=batch.mask, reward_clip_range=REWARD_CLIP_RANGE)
            return reward_to_go_surrogate(-reward, batch)  # the surrogate takes a cost: -reward

        name = f"openrlhf.reward.{est}"
        lib.settings[name] = Setting(
            name, reward_loss, reward_src,
            "in the reward (compute_reward on the rollout's compute_approx_kl); return-to-go REINFORCE (klbench's)",
            "kl.use_loss off, init_kl_coef=1, kl_estimator=" + est + (" (default)" if est == "k1" else ""),
            scored=rescored(reward_loss, score), divides_by_t=divides)
    return lib
