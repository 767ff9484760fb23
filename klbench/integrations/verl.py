"""klbench's gradient estimators as the KL term of verl 0.9.1's actor loss.

    from klbench.integrations.verl import ppo_loss
    # after trainer.init_workers(); actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor), as verl binds it
    trainer.actor_rollout_wg.set_loss_fn(functools.partial(ppo_loss("cumulative"), config=actor))

verl's registries cannot carry a KL estimator (docs/integrations.md): a policy loss registered with
`register_policy_loss` (verl/trainer/ppo/core_algos.py:53) is called with old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config and rollout_is_weights (verl/workers/utils/losses.py:103-112), never the
reference's log-probs; an advantage estimator (`register_adv_est`, core_algos.py:116) gets the rewards, the
mask and the prompt ids (trainer/ppo/ray_trainer.py:250-279); the KL loss itself, `kl_penalty`
(core_algos.py:2188), is a string switch with no registry, called without the mask (losses.py:135).

What can carry one is the actor's loss function as a whole: verl's worker holds it as `loss_fn`, installs
`ppo_loss(config, model_output, data, dp_group)` there itself (workers/engine_workers.py:639-646) and exposes
`set_loss_fn` to the driver (engine_workers.py:170-171, 529-531). `ppo_loss(name)` returns a function of that
signature: verl's own ppo_loss with its KL term off, plus kl_loss_coef * the estimator's surrogate, aggregated by
verl's agg_loss under the run's loss_agg_mode. The batch has per-token log-probs of the sampled tokens only, so
estimators that need the exact per-position KL (rb, vopd) or logits (topk_*) are refused, and so are those that
need prompt groups (loo): verl's micro-batches carry no prompt id.
"""
from __future__ import annotations

import dataclasses

import torch

from klbench.estimators import KLBatch, gradient_estimator

SUPPORTED = "0.9.1"
KAPPA_OR_LOGITS = ("rb", "vopd", "topk_tail", "topk_trunc")


def refusal(est) -> str | None:
    """One line when `est` needs what verl's actor loss does not receive; None when it can run."""
    name = f"klbench estimator {est.name!r}"
    if est.name in KAPPA_OR_LOGITS:
        return (f"verl: {name} needs the exact per-position KL over the vocabulary (KLBatch.token_kl) or the "
                "logits, but verl 0.9.1's actor loss receives only the sampled tokens' log-probs "
                "(model_output['log_probs'], data['ref_log_prob']; verl/workers/utils/losses.py:59, :133): use seq, "
                "cumulative or token, or klbench.integrations.trl for rb (docs/integrations.md)")
    if est.name == "loo" or est.options.get("baseline") == "loo":
        return (f"verl: {name} needs the samples of each prompt together with their prompt id (KLBatch.group), but "
                "verl's actor loss gets shuffled micro-batches without one (verl/workers/utils/losses.py:86-91): use "
                "seq or cumulative")
    if est.name == "in_reward" and est.kl_norm == "before":
        return (f"verl: {name} with kl_norm='before' puts the KL into the reward before the advantage, which verl "
                "computes on the driver (trainer/ppo/ray_trainer.py:187): use kl_norm='after'")
    return None


BEHAVIOURS = ("sampler", "scorer")


def ppo_loss(estimator: str, kl_behaviour: str = "sampler", **options):
    """verl's actor loss with `estimator` (a klbench gradient estimator's name, `options` its options) as the KL
    term at coefficient config.kl_loss_coef. The run keeps use_kl_loss=True, which makes verl compute the
    reference's log-probs (trainer/ppo/utils.py:79); kl_loss_type is not read.

    kl_behaviour: where the batch carries the rollout engine's own log-probs (`rollout_log_probs`: the rollout's
    calculate_log_probs), 'sampler' makes them the KL batch's behaviour policy (KLBatch.old_logp), so that an
    off-policy estimator corrects for the engine's mismatch (docs/mismatch.md); 'scorer' uses verl's
    old_log_probs (the trainer's recomputation), which hides it. verl's actor loss cannot see the rollout's top-p
    or top-k: under a truncating rollout no weight exists for the cut tokens (docs/integrations.md)."""
    if kl_behaviour not in BEHAVIOURS:
        raise ValueError(f"verl: kl_behaviour={kl_behaviour!r} is unknown; valid: {', '.join(BEHAVIOURS)}")
    from importlib.metadata import version
    if version("verl") != SUPPORTED:
        raise ValueError(f"klbench.integrations.verl supports verl {SUPPORTED} (it wraps its ppo_loss), found "
                         f"{version('verl')}: pip install verl=={SUPPORTED}")
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    est = gradient_estimator(estimator, **options)
    if (why := refusal(est)):
        raise ValueError(why)

    def loss(config, model_output, data, dp_group=None):
        if not config.use_kl_loss:
            raise ValueError("verl: klbench's KL term needs actor.use_kl_loss=True, so that verl computes the "
                             "reference's log-probs (its coefficient is actor.kl_loss_coef)")
        if config.ppo_epochs > 1 and not est.supports_off_policy():
            raise ValueError(f"verl: klbench estimator {est.name!r} assumes samples from the current policy, but "
                             f"actor.ppo_epochs={config.ppo_epochs} trains on them again after a step: use in_reward "
                             "or in_loss with ratio='token'|'sequence' (they correct for it), or ppo_epochs=1")
        # verl's loss without its KL term; it also fills config.global_batch_info, which the copy shares
        off = dataclasses.replace(config, use_kl_loss=False)
        policy_loss, metrics = verl_ppo_loss(off, model_output, data, dp_group)
        log_prob = no_padding_2_padding(model_output["log_probs"], data)  # [B, T], differentiable
        engine = kl_behaviour == "sampler" and "rollout_log_probs" in data
        if engine and not est.supports_off_policy():
            raise ValueError(f"verl: the batch carries the rollout engine's log-probs (rollout_log_probs), and with "
                             f"kl_behaviour='sampler' they are the KL batch's behaviour policy, but klbench estimator "
                             f"{est.name!r} assumes samples from pi: use in_reward or in_loss with ratio='token'|"
                             "'sequence', or ppo_loss(..., kl_behaviour='scorer') (the mismatch stays invisible)")
        fields = ["response_mask", "old_log_probs", "ref_log_prob"] + ["rollout_log_probs"] * engine
        padded = data.select(*fields).to_padded_tensor()
        mask = padded["response_mask"].to(bool)  # [B, T]
        behave = padded["rollout_log_probs"] if engine else padded["old_log_probs"]  # [B, T]
        old = torch.where(mask, behave.to(log_prob.dtype), 0) if est.supports_off_policy() else None
        batch = KLBatch(log_prob, padded["ref_log_prob"].to(log_prob.dtype).detach(), mask, old_logp=old)
        surrogate = est(batch)  # [B]
        # sequence i's surrogate as its row's token sum: every agg_loss mode then weighs it as it weighs a token
        # loss of that sequence (a sum over sequences, or seq-mean-token-mean's 1 / length)
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        kl_mat = surrogate.unsqueeze(-1) * mask / lengths  # [B, T]
        kl_loss = agg_loss(kl_mat, mask, config.loss_agg_mode, **off.global_batch_info)
        summed = (data["dp_size"] > 1 or data["batch_num_tokens"] is not None  # as verl aggregates its KL metric
                  or data["global_batch_size"] is not None or config.loss_scale_factor is not None)
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=AggregationType.SUM if summed else AggregationType.MEAN)
        metrics["kl_coef"] = config.kl_loss_coef
        return policy_loss + config.kl_loss_coef * kl_loss, metrics

    return loss
