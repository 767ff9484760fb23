"""verl: on-policy distillation's `distillation_loss` (settings verl.distill.*, see _distill_settings below);
`verl.trainer.ppo.core_algos.kl_penalty`, every kl_loss_type, as the actor's KL loss (use_kl_loss=True);
the actor's whole `ppo_loss` (verl/workers/utils/losses.py) with use_kl_loss=True; and the use_kl_in_reward path.

kl_penalty alone (settings verl.kl_penalty.*): the per-sequence loss is the masked token sum of kl_penalty's
[B, T] output (verl's loss_agg_mode "seq-mean-token-sum"). verl's KL loss takes no importance weight, so
under a behaviour policy the same per-token values are summed over pi_old's samples.

ppo_loss (settings verl.ppo_loss.*): the real `verl.workers.utils.losses.ppo_loss` with a real
`verl.workers.config.ActorConfig` (use_kl_loss=True, kl_loss_coef=1; everything else at verl's defaults:
kl_loss_type "low_var_kl", loss_agg_mode "token-mean", policy_loss.loss_mode "vanilla", clip_ratio 0.2).
Its input is a padded (non-nested) TensorDict: prompts [1, 1], responses [1, T], attention_mask [1, 1 + T],
response_mask, old_log_probs, advantages = 0 (so only the KL term moves the policy; the policy term is
evaluated, and its PPO ratio clamp fires off-policy, but on a zero advantage), ref_log_prob, and
model_output {"log_probs": [1 + L]} laid out as no_padding_2_padding expects: the model output of the
whole (prompt + response) sequence, whose position p holds log pi of token p + 1, so response token t sits at
p = t and the last position is unused (0). ppo_loss is called on one-sequence batches, which is exact: every
verl loss_agg_mode is a sum over sequences once batch_num_tokens / global_batch_size are given.
dp_size = 1, batch_num_tokens = 1, global_batch_size = 1. Why 1: verl normalises by counts over the whole
mini-batch, not by each micro-batch's own: the FSDP engine (verl/workers/engine/fsdp/transformer_impl.py,
forward_backward_batch) sets batch_num_tokens to the mini-batch's all-reduced token count and dp_size to the
data-parallel size, and the trainer sets global_batch_size = ppo_mini_batch_size * rollout.n
(trainer/ppo/v1/trainer_base.py, _update_actor); "token-mean" then divides the mini-batch's token sum by that
one count. Every sequence's token sum is divided by the same per-step constant, so fixing it at 1 gives each
sequence its token sum: the optimiser's gradient is this one's times B / batch_num_tokens (exactly, up to that
constant's dependence on the sampled lengths, which vanishes in the large-batch limit). old_log_probs is
KLBatch.old_logp off-policy (the current log-probs, detached, on-policy). The setting ".seq_mean_token_mean"
uses verl's per-sequence token mean instead (global_batch_size = 1 again), which weighs a sequence's tokens by
1 / its length.
What they audit as: like the kl_penalty settings of the same type (ppo_loss adds kl_penalty's [B, T] output
through agg_loss with no ratio, workers/utils/losses.py:135), so low_var_kl is none of the above because
kl_penalty's clamp of the value to [-10, 10] fires (core_algos.py:2245), and every type is none of the above
off-policy (pi_old's samples, no importance weight). The clamp that fires off-policy besides is the policy
term's PPO ratio clip (core_algos.py:1347, compute_policy_loss_vanilla) on a zero advantage: it moves nothing.
seq_mean_token_mean is none of the above on-policy too: the 1 / length weight (core_algos.py:1196).

`use_kl_in_reward` (settings verl.kl_in_reward.*): `ray_trainer.apply_kl_penalty` evaluates kl_penalty on
the rollout's old_log_probs and subtracts beta * kld from the token-level rewards. ray_trainer itself imports
torchdata and the whole trainer, so the adapter calls kl_penalty exactly as that function does
(old log-probs, detached) and feeds the result to klbench's return-to-go REINFORCE surrogate
(base.reward_to_go_surrogate); verl's own advantage estimators (GAE with a critic, GRPO/RLOO groups,
batch whitening) are not run.
"""
from __future__ import annotations

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import (Library, LibraryMissing, Setting, line_in, line_of, old_or_current, package_file,
                                   require, rescored, reward_to_go_surrogate, source_of, token_sum)

DIST, SUPPORTED = "verl", "0.9.1"
KL_TYPES = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+")
PPO_LOSS_SETTINGS = {  # setting -> ActorConfig overrides on top of use_kl_loss=True, kl_loss_coef=1
    "verl.ppo_loss.low_var_kl": {},  # verl's default kl_loss_type and loss_agg_mode
    "verl.ppo_loss.kl": {"kl_loss_type": "kl"},
    "verl.ppo_loss.low_var_kl+": {"kl_loss_type": "low_var_kl+"},
    "verl.ppo_loss.low_var_kl.seq_mean_token_mean": {"loss_agg_mode": "seq-mean-token-mean"},
}


def _actor_config(ActorConfig, overrides: dict):
    # strategy, rollout_n and a micro-batch size are required fields; they do not enter ppo_loss
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, use_kl_loss=True,
                       kl_loss_coef=1.0, **overrides)


def _row_data(batch: KLBatch, b: int, old: torch.Tensor, ref: torch.Tensor):
    """(model_output, data) for sequence b: the flat log-probs [1 + L] and the padded TensorDict."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    mask = batch.mask[b:b + 1]  # [1, T]
    T, L = mask.shape[1], int(mask.sum())
    if not bool(mask[0, :L].all()):
        raise ValueError(f"verl.ppo_loss: KLBatch.mask row {b} is not right-padded (real tokens, then padding)")
    dev, dt = batch.logp.device, batch.logp.dtype
    flat = torch.cat([batch.logp[b, :L], torch.zeros(1, dtype=dt, device=dev)])  # [1 + L]: prompt + response
    one = torch.ones(1, 1, dtype=torch.long, device=dev)
    data = TensorDict({"prompts": torch.zeros(1, 1, dtype=torch.long, device=dev),
                       "responses": torch.zeros(1, T, dtype=torch.long, device=dev),
                       "attention_mask": torch.cat([one, mask.long()], 1),  # [1, 1 + T]
                       "response_mask": mask.long(), "old_log_probs": old[b:b + 1],
                       "advantages": torch.zeros(1, T, dtype=dt, device=dev), "ref_log_prob": ref[b:b + 1]},
                      batch_size=[1])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=1, global_batch_size=1)
    return {"log_probs": flat}, data


def _ppo_loss_per_row(ppo_loss, config, batch: KLBatch) -> torch.Tensor:
    """[B] verl's ppo_loss on each one-sequence batch."""
    old = old_or_current(batch)
    ref = torch.where(batch.mask, batch.ref_logp, torch.zeros((), dtype=batch.ref_logp.dtype))
    out = []
    for b in range(batch.logp.shape[0]):
        model_output, data = _row_data(batch, b, old, ref)
        out.append(ppo_loss(config, model_output, data)[0])
    return torch.stack(out)


def _scorer():
    """verl's log-prob scoring at a temperature, as FSDPEngineWithLMHead.prepare_model_outputs does it on the
    unpadded logits: its own _scale_logits_by_temperature, then logprobs_from_logits. The trainer sets one
    temperature, the rollout's, in the step batch's meta_info, and the same engine scores the policy, the old
    policy and the reference with it. Returns (score(logits [B, T, V], tokens [B, T], T) -> [B, T], the statement
    of which logits are divided, with file:line)."""
    from verl.workers.engine.fsdp import transformer_impl as fsdp

    def score(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        B, T, V = logits.shape
        t = torch.full((B * T, 1), float(temperature))  # [N, 1] verl's per-token temperature
        x = fsdp._scale_logits_by_temperature(logits.reshape(B * T, V), t, is_unit_temperature=temperature == 1)
        return fsdp.logprobs_from_logits(logits=x, labels=tokens.reshape(-1), inplace_backward=False).reshape(B, T)

    # ray_trainer imports torchdata, which klbench does not install: the line is read from the file
    meta = line_in(DIST, "trainer/ppo/ray_trainer.py", 'batch.meta_info["temperature"] = self.config.actor_rollout')
    divides = (f"policy, reference and old: one rollout temperature for the step's batch ({meta}), divided in "
               f"the engine that scores all three "
               f"({line_of(fsdp.FSDPEngineWithLMHead.prepare_model_outputs, '_scale_logits_by_temperature(')})")
    return score, divides


def load() -> Library:
    version = require(DIST, SUPPORTED)
    from verl.trainer.ppo import core_algos  # imports ray and tensordict: see scripts/install_libraries.sh
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    lib = Library(DIST, version)
    src = source_of(core_algos.kl_penalty)
    try:  # the temperature axis needs the FSDP engine's scaling; releases before 0.9 lack it (audit_versions.py)
        score, divides = _scorer()
    except (ImportError, AttributeError, LibraryMissing) as e:
        score, divides = None, f"not called: {e}"
    for kind in KL_TYPES:
        def loss(batch: KLBatch, kind=kind) -> torch.Tensor:
            return token_sum(core_algos.kl_penalty(batch.masked_logp, batch.ref_logp, kind), batch)

        lib.settings[f"verl.kl_penalty.{kind}"] = Setting(
            f"verl.kl_penalty.{kind}", loss, src, "token sum per sequence (seq-mean-token-sum), in the loss",
            "use_kl_loss=True, kl_loss_type=" + kind, scored=score and rescored(loss, score), divides_by_t=divides)
    for name, over in PPO_LOSS_SETTINGS.items():
        config = _actor_config(ActorConfig, over)

        def actor_loss(batch: KLBatch, config=config) -> torch.Tensor:
            return _ppo_loss_per_row(ppo_loss, config, batch)

        lib.settings[name] = Setting(
            name, actor_loss, source_of(ppo_loss),
            f"ppo_loss per sequence, loss_agg_mode={config.loss_agg_mode}, batch_num_tokens = "
            "global_batch_size = 1, advantages 0",
            f"use_kl_loss=True, kl_loss_coef=1, kl_loss_type={config.kl_loss_type}, "
            f"policy_loss={config.policy_loss.loss_mode}, clip_ratio={config.clip_ratio}",
            scored=score and rescored(actor_loss, score), divides_by_t=divides)
    for kind in ("kl", "low_var_kl"):  # "kl" is algorithm.kl_penalty's default
        def reward_loss(batch: KLBatch, kind=kind) -> torch.Tensor:
            with torch.no_grad():
                kld = core_algos.kl_penalty(old_or_current(batch), batch.ref_logp, kl_penalty=kind)
            return reward_to_go_surrogate(kld, batch)

        lib.settings[f"verl.kl_in_reward.{kind}"] = Setting(
            f"verl.kl_in_reward.{kind}", reward_loss, src,
            "in the reward on old_log_probs (as ray_trainer.apply_kl_penalty); return-to-go REINFORCE (klbench's)",
            "use_kl_in_reward=True, kl_penalty=" + kind + (" (default)" if kind == "kl" else ""),
            scored=score and rescored(reward_loss, score), divides_by_t=divides)
    try:  # verl.trainer.distillation is new in 0.8: older releases audit without it (scripts/audit_versions.py)
        _distill_settings(lib, ActorConfig)
    except ImportError:
        pass
    return lib


# ---- on-policy distillation: verl/trainer/distillation/losses.py ----
# every registered loss_mode, each with use_policy_gradient false (the per-token loss backpropagated, "as in
# arXiv 2306.13649") and true (its negative as a per-token advantage of verl's vanilla PPO policy loss, "as in
# the Thinking Machines blog"). The other options are those of verl's trainer config, which every verl run
# composes (trainer/config/distillation/distillation.yaml: loss_mode k3, use_policy_gradient false, no clamps);
# DistillationLossConfig's own dataclass defaults differ (use_policy_gradient True, loss_max_clamp 10,
# log_prob_min_clamp -10) and apply only to a config built in Python.
TRAINER_CONFIG = "trainer/config/distillation/distillation.yaml"
DISTILL_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk")
TOPK_ON_TABULAR = {"forward_kl_topk": None, "forward_kl_topk.k2": 2}  # None: k = V, the whole vocabulary


def _distill_row(dl, fsdp_losses, loss_config, actor_config, batch: KLBatch, b: int, old, ref, topk):
    """verl's distillation_loss on sequence b: model_output and data laid out as _row_data does, plus the
    teacher's sampled-token log-probs (estimator modes) or the top-k loss that verl's logits processor
    (fsdp/losses.py compute_forward_kl_topk, run here on the student's logits) puts in model_output."""
    from verl.workers.config import DistillationConfig

    dist_config = DistillationConfig(distillation_loss=loss_config)
    model_output, data = _row_data(batch, b, old, ref)
    L = int(batch.mask[b].sum())
    if loss_config.loss_mode == "forward_kl_topk":
        pad = torch.zeros_like(batch.logits[b, :1])  # the unused last position of prompt + response
        student = torch.cat([batch.logits[b, :L], pad])[None]  # [1, 1 + L, V]
        teacher = torch.log_softmax(torch.cat([batch.ref_logits[b, :L], pad]).detach(), -1)  # [1 + L, V]
        k = teacher.shape[-1] if topk is None else topk
        top_lp, top_ids = teacher.topk(k, -1)  # [1 + L, k]: what the teacher's engine returns
        nested = [torch.nested.nested_tensor([t], layout=torch.jagged) for t in (top_lp, top_ids)]
        out = fsdp_losses.compute_forward_kl_topk(student, *nested, dist_config, "thd")
        model_output.update({key: v[0] for key, v in out.items()})  # [1 + L] each
    else:
        teacher = torch.cat([ref[b, :L], torch.zeros(1, dtype=ref.dtype, device=ref.device)])  # [1 + L]
        # nested [1, 1 + L, 1] as verl's teacher worker returns it, shifted as log_probs
        data["teacher_logprobs"] = torch.nested.nested_tensor([teacher[:, None]], layout=torch.jagged)
    return dl.distillation_loss(actor_config, dist_config, model_output, data)[0]


def _distill_settings(lib: Library, ActorConfig) -> None:
    import contextlib
    import io

    from verl.trainer.distillation import losses as dl
    from verl.trainer.distillation.fsdp import losses as fsdp_losses
    from verl.workers.config import DistillationLossConfig

    from omegaconf import OmegaConf
    defaults = OmegaConf.load(package_file(DIST, *TRAINER_CONFIG.split("/"))).distillation_loss  # the trainer's
    where = line_in(DIST, TRAINER_CONFIG, "use_policy_gradient:")
    actor_config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)  # loss_agg token-mean
    src = source_of(dl.distillation_loss)
    modes = [m for m in DISTILL_MODES if m != "forward_kl_topk"] + list(TOPK_ON_TABULAR)
    for mode in modes:
        loss_mode = mode.split(".")[0]
        for pg in (False, True):
            name = f"verl.distill.{mode}" + (".pg" if pg else "")

            def loss(batch: KLBatch, loss_mode=loss_mode, pg=pg, topk=TOPK_ON_TABULAR.get(mode)) -> torch.Tensor:
                # built per call: k1 without policy gradient is refused by verl's own __post_init__, and that
                # refusal is this cell's result; forward_kl_topk with pg prints a warning, silenced here
                with contextlib.redirect_stdout(io.StringIO()):
                    config = DistillationLossConfig(loss_mode=loss_mode, use_policy_gradient=pg,
                                                    loss_max_clamp=defaults.loss_max_clamp,
                                                    log_prob_min_clamp=defaults.log_prob_min_clamp)
                old = old_or_current(batch)
                ref = torch.where(batch.mask, batch.ref_logp, torch.zeros((), dtype=batch.ref_logp.dtype))
                return torch.stack([_distill_row(dl, fsdp_losses, config, actor_config, batch, b, old, ref, topk)
                                    for b in range(batch.logp.shape[0])])

            is_default = loss_mode == defaults.loss_mode and pg == defaults.use_policy_gradient
            topk = TOPK_ON_TABULAR.get(mode, "-")
            note = (f"loss_mode={loss_mode}, use_policy_gradient={pg}" +
                    (f" (the trainer's defaults, {where})" if is_default else "") +
                    (f", topk={'V (all)' if topk is None else topk}" if topk != "-" else "") +
                    f", loss_max_clamp={defaults.loss_max_clamp}, log_prob_min_clamp={defaults.log_prob_min_clamp}")
            agg = ("per-token advantage -loss_t of vanilla PPO (per-token ratio)" if pg else
                   "token sum per sequence (token-mean, batch_num_tokens = 1), backpropagated")
            lib.settings[name] = Setting(name, loss, src, agg, note, task="distill")
