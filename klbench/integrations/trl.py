"""Any klbench gradient estimator as the KL term of TRL 1.16.0's GRPOTrainer and RLOOTrainer.

    from klbench.integrations.trl import GRPOTrainer        # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(beta=0.05, ...), kl_estimator="rb")

What changes against TRL (docs/integrations.md):
- TRL's own KL term is off: GRPO's beta * per_token_kl in the loss (trl/trainer/grpo_trainer.py:3098-3105,
  3149-3150) and RLOO's beta * k1 in the reward (rloo_trainer.py:1664-1673), with the reference pass that feeds
  them (both are gated on self.beta, set to 0 once TRL's __init__ has loaded the reference for args.beta > 0).
- In its place, args.beta * the estimator's surrogate on a KLBatch of the loss's micro-batch, weighted as TRL
  weighs its own loss terms (`_normaliser`).
- TRL's fused LM head keeps only log-probs and the entropy (trl/trainer/utils.py, add_fused_lm_head), so the
  policy backbone's output (the head's input) is captured by a forward hook during TRL's own forward, the
  reference's backbone runs once without gradient, and klbench.estimators.head_scores gives log pi, log pi_ref
  and the exact per-position KL kappa over the whole vocabulary in tiles: no [B, T, V] logits.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import trl
from accelerate.utils import is_peft_model
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from klbench.estimators import KLBatch, gradient_estimator
from klbench.estimators.head_scores import LMHead, head_scores

SUPPORTED = "1.16.0"  # _compute_loss, the self.beta gates and the input keys read here are this version's
FULL_LOGITS = ("topk_tail", "topk_trunc")  # they rank the whole vocabulary per position: KLBatch.logits


def lm_head(model, temperature: float) -> LMHead:
    """How `model`'s logits come from its final hidden states, as TRL's fused head applies them
    (trl/trainer/utils.py:1577-1590): output embeddings, the config's logit scale, Gemma's final-logit
    softcapping, then TRL's sampling temperature."""
    config = model.config.get_text_config()
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, name, None) if scale is None else scale
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    out = model.get_output_embeddings()
    if hasattr(out, "base_layer"):  # a peft layer: its .weight alone would miss the adapter's delta
        raise ValueError("klbench.integrations.trl: the LM head carries a peft adapter (lm_head in target_modules), "
                         "which head_scores cannot apply: leave lm_head out of the adapter's target modules")
    return LMHead(out.weight, out.bias, 1.0 if scale is None else float(scale),
                  getattr(config, "final_logit_softcapping", None), float(temperature))


def completion_batch(h: torch.Tensor, head: LMHead, h_ref: torch.Tensor, ref_head: LMHead, tokens: torch.Tensor,
                     mask: torch.Tensor, group: torch.Tensor | None = None,
                     old_logp: torch.Tensor | None = None) -> KLBatch:
    """The KLBatch [B, T] of sampled completions from final hidden states.

    h, h_ref [B, T, H]: the policy's and the reference's states whose next token is tokens [B, T] (the state one
    position before each token); mask [B, T] bool, EOS included. Only masked-in rows are scored; log-probs and
    kappa are 0 off the mask, where KLBatch never reads them (kappa's reward-to-go sums them: they must be 0).
    """
    s = head_scores(h[mask], head, tokens[mask], h_ref[mask], ref_head, with_token_kl=True,
                    with_entropy=False)  # [N] each

    def spread(x: torch.Tensor) -> torch.Tensor:  # [N] -> [B, T], differentiable in x
        return torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_scatter(mask, x)

    logp = spread(s.logp)
    old = None if old_logp is None else old_logp.detach().to(logp.dtype)
    return KLBatch(logp, spread(s.ref_logp), mask, group=group, token_kl=spread(s.kappa), old_logp=old)


def refusal(trainer: str, args, est) -> str | None:
    """One line when `est` needs what `trainer`'s batch under `args` lacks; None when it can run."""
    name = f"klbench estimator {est.name!r}"
    if not args.beta:
        return (f"{trainer}: args.beta is 0, so TRL loads no reference model and has no KL term for {name} to "
                "replace: set args.beta > 0 (it is the estimator's coefficient)")
    if est.name in FULL_LOGITS:
        return (f"{trainer}: {name} needs the full [B, T, V] next-token logits (KLBatch.logits), which TRL's "
                "batch never holds (its fused LM head keeps only log-probs): use rb or vopd for the full-vocabulary "
                "KL, which this integration computes from the hidden states in tiles")
    if est.name == "in_reward" and est.kl_norm == "before":
        return (f"{trainer}: {name} with kl_norm='before' puts the KL into the reward before TRL's advantage, "
                "which TRL computes at generation, out of this integration's reach: use kl_norm='after'")
    setting = (f"num_iterations={args.num_iterations}, steps_per_generation={args.steps_per_generation}, "
               f"gradient_accumulation_steps={args.gradient_accumulation_steps}")
    if args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations):
        if not est.supports_off_policy():
            return (f"{trainer}: {name} assumes samples from the current policy, but with {setting} TRL trains on "
                    "samples of an older policy: use rb, in_reward or in_loss with ratio='token'|'sequence' "
                    "(they correct for it), or make gradient_accumulation_steps a multiple of "
                    "steps_per_generation * num_iterations")
        if trainer == "RLOOTrainer":
            return (f"{trainer}: with {setting} TRL trains on samples of an older policy, and {name} needs that "
                    "policy's per-token log-probs (KLBatch.old_logp), which RLOOTrainer keeps only summed per "
                    "sequence (inputs['old_logps']): make gradient_accumulation_steps a multiple of "
                    "steps_per_generation * num_iterations")
    loo = est.name == "loo" or est.options.get("baseline") == "loo"
    if loo and (args.steps_per_generation > 1 or args.world_size > 1):
        return (f"{trainer}: {name} needs all num_generations samples of a prompt in one micro-batch "
                f"(KLBatch.group), but TRL shuffles each generation batch into steps_per_generation="
                f"{args.steps_per_generation} micro-batches on {args.world_size} process(es): set "
                "steps_per_generation=1 on one process, or use an estimator without groups (rb, seq, cumulative)")
    return None


class _KLTerm:
    """Mixed in before TRL's trainer: its KL term off, args.beta * a klbench surrogate added to its loss."""

    _trainer = ""

    def __init__(self, *args: Any, kl_estimator: str = "rb", kl_options: dict | None = None, **kwargs: Any):
        if trl.__version__ != SUPPORTED:
            raise ValueError(f"klbench.integrations.trl supports TRL {SUPPORTED} (it overrides its _compute_loss), "
                             f"found {trl.__version__}: pip install trl=={SUPPORTED}")
        est = gradient_estimator(kl_estimator, **(kl_options or {}))  # an unknown name or option: its own line
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None and (why := refusal(self._trainer, config, est)):
            raise ValueError(why)  # before TRL loads any model
        super().__init__(*args, **kwargs)
        if (why := refusal(self._trainer, self.args, est)):  # TRL's default config, when none was given
            raise ValueError(why)
        self.kl_estimator, self.kl_beta = est, self.beta
        self.beta = 0.0  # TRL's KL term and its reference pass off: the reference model stays loaded
        self._reuses = bool(self.args.gradient_accumulation_steps
                            % (self.args.steps_per_generation * self.num_iterations))

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        # the prompt index of each sample: TRL repeats each prompt num_generations times consecutively over the
        # processes' slices (the rewards' view(-1, num_generations)); it is shuffled with the batch after this
        B = out["completion_ids"].shape[0]
        n = self.num_generations if self.model.training else self.num_generations_eval
        index = self.accelerator.process_index * B + torch.arange(B, device=out["completion_ids"].device)
        out["klbench_group"] = index // n
        return out

    def _compute_loss(self, model, inputs):
        bare = self._bare(model)
        captured = []  # [B, L, H]: the backbone's output in TRL's own forward, the head's input
        hook = bare.base_model.register_forward_hook(lambda module, args, out: captured.append(out[0]))
        try:
            loss = super()._compute_loss(model, inputs)  # TRL's loss: its KL term is off (self.beta == 0)
        finally:
            hook.remove()
        if len(captured) != 1:
            raise RuntimeError(f"klbench.integrations.trl: expected one policy forward in TRL's loss, saw "
                               f"{len(captured)}")
        batch = self._kl_batch(model, bare, captured[0], inputs)
        surrogate = self.kl_estimator(batch)  # [B]
        mode = "train" if self.model.training else "eval"
        seq_kl = self.accelerator.gather(batch.kappa.detach().sum(-1))  # rb's value of KL(pi || pi_ref) per sequence
        self._metrics[mode]["klbench/seq_kl"].append(seq_kl.mean().item())
        return loss + self.kl_beta * surrogate.sum() / self._normaliser(inputs, batch.mask)

    def _kl_batch(self, model, bare, hidden: torch.Tensor, inputs) -> KLBatch:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L], as TRL's loss builds it
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        K = inputs["completion_ids"].shape[1]
        mask = inputs["completion_mask"].bool()  # EOS included, zero after it (TRL's own)
        if "tool_mask" in inputs:  # tool outputs are not pi's choices: TRL's loss masks them too
            mask = mask & inputs["tool_mask"].bool()
        ref_bare, h_ref = self._reference_states(model, ids, attention)
        # state t - 1 predicts token t: the K states before the completion's K tokens, [B, K, H]
        h, h_ref = hidden[:, -K - 1:-1], h_ref[:, -K - 1:-1]
        fp32 = getattr(self.args, "cast_lm_head_to_fp32", False)  # TRL's head then runs in float32, no autocast
        if fp32:
            h, h_ref = h.float(), h_ref.float()
        old = inputs.get("old_per_token_logps") if self._reuses else None  # GRPO's; RLOO's reuse is refused
        with contextlib.nullcontext() if fp32 else self.accelerator.autocast():
            return completion_batch(h, lm_head(bare, self.temperature), h_ref, lm_head(ref_bare, self.temperature),
                                    inputs["completion_ids"], mask, inputs.get("klbench_group"), old)

    @torch.no_grad()
    def _reference_states(self, model, ids: torch.Tensor, attention: torch.Tensor):
        """(the reference's bare model, its final hidden states [B, L, H]), as TRL's reference pass gets them:
        the reference model, or for a peft policy the base with the adapter off (or a "ref" adapter)."""
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.accelerator.autocast():
            if self.ref_model is not None:
                ref = self._bare(self.ref_model)
                return ref, ref.base_model(input_ids=ids, attention_mask=attention, use_cache=False)[0]
            peft = self.accelerator.unwrap_model(model)
            with use_adapter(peft, adapter_name="ref" if "ref" in peft.peft_config else None):
                ref = peft.get_base_model()
                return ref, ref.base_model(input_ids=ids, attention_mask=attention, use_cache=False)[0]

    def _bare(self, model):
        """The transformers model under accelerate's and peft's wrappers: TRL's fused forward runs its
        `base_model` (the backbone), then the output embeddings."""
        m = self.accelerator.unwrap_model(model)
        return m.get_base_model() if is_peft_model(m) else m

    def _normaliser(self, inputs, mask: torch.Tensor):
        raise NotImplementedError


class GRPOTrainer(_KLTerm, trl.GRPOTrainer):
    """trl.GRPOTrainer with `kl_estimator` (a klbench gradient estimator's name; `kl_options` its options) as the
    KL term, at coefficient args.beta. Off-policy reuse (num_iterations > 1) feeds TRL's old_per_token_logps."""

    _trainer = "GRPOTrainer"

    def _normaliser(self, inputs, mask: torch.Tensor):
        """D in beta * sum_i L_i / D: the surrogate L_i stands for sequence i's token sum, divided as TRL divides
        its per-token loss (grpo_trainer.py:3153-3184). grpo and sapo divide each sequence by its own length, which
        would weight the KL by 1 / length: the micro-batch's token count (bnpo's) instead."""
        train = self.model.training
        accum = self.current_gradient_accumulation_steps if train else 1
        if self.loss_type in ("cispo", "dapo", "vespo"):
            d = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            return d * self.current_gradient_accumulation_steps / self.args.steps_per_generation if train else d
        if self.loss_type == "dr_grpo":
            return mask.shape[0] * self.max_completion_length * accum
        if self.loss_type == "luspo":
            return mask.shape[0] * accum
        return mask.sum().clamp(min=1) * accum  # bnpo, grpo, sapo


class RLOOTrainer(_KLTerm, trl.RLOOTrainer):
    """trl.RLOOTrainer with `kl_estimator` in the loss instead of TRL's k1 in the reward, at coefficient
    args.beta. On-policy only (RLOO keeps no per-token log-probs of an older policy)."""

    _trainer = "RLOOTrainer"

    def _normaliser(self, inputs, mask: torch.Tensor):
        """RLOO's loss is a mean over sequences that transformers divides by the accumulation steps
        (rloo_trainer.py:1833, loss_is_scaled_for_ga = False at :219): beta * mean_i L_i."""
        return mask.shape[0]
