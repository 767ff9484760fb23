"""Any klbench gradient estimator as the KL term of TRL 1.16.0's GRPOTrainer and RLOOTrainer.

    from klbench.integrations.trl import GRPOTrainer        # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(beta=0.05, ...), kl_estimator="rb")

What changes against TRL (docs/integrations.md):
- TRL's own KL term is off: GRPO's beta * per_token_kl in the loss (trl/trainer/grpo_trainer.py:3098-3105,
  3149-3150) and RLOO's beta * k1 in the reward (rloo_trainer.py:1664-1673), with the reference pass that feeds
  them (both are gated on self.beta, set to 0 once TRL's __init__ has loaded the reference for args.beta > 0).
- In its place, args.beta * the estimator's surrogate on a KLBatch of the loss's micro-batch, weighted as TRL
  weighs its own loss terms (`_normaliser`).
- With vLLM, GRPO's batch carries the engine's own log-probs (`sampling_per_token_logps`): at kl_behaviour='sampler'
  (the default) they are the KLBatch's behaviour policy (old_logp), so that rb follows grad KL(pi_T || pi_ref,T)
  under the engine's mismatch; kl_behaviour='scorer' ignores them, as TRL's own KL term does.
- TRL's fused LM head keeps only log-probs and the entropy (trl/trainer/utils.py, add_fused_lm_head), so the
  policy backbone's output (the head's input) is captured by a forward hook during TRL's own forward, the
  reference's backbone runs once without gradient, and klbench.estimators.head_scores gives log pi, log pi_ref
  and the exact per-position KL kappa over the whole vocabulary in tiles: no [B, T, V] logits.
- Where TRL's head multiplies in float32 (a float32 model, or cast_lm_head_to_fp32), head_scores stands in for it
  during the loss and hands TRL its log-probs and entropy, so the policy's head product runs once
  (klbench/integrations/trl_head.py; _one_head_loss); elsewhere the hook above and a second product.
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
from klbench.integrations import trl_head

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


BEHAVIOURS = ("sampler", "scorer")  # kl_behaviour: the engine's log-probs as the behaviour policy, or none (TRL's)


def engine_cut(args) -> str:
    """The engine's truncation under `args` ("" when none): vLLM's processed log-probs are then those of the cut,
    renormalised distribution, and the tokens it cut have no importance weight."""
    gen = dict(getattr(args, "generation_kwargs", None) or {})
    top_p, top_k, min_p = (gen.get("top_p", args.top_p), gen.get("top_k", args.top_k), gen.get("min_p", args.min_p))
    cut = ([f"top_p={top_p:g}"] if top_p is not None and top_p < 1 else []) + \
        ([f"top_k={top_k}"] if top_k and top_k > 0 else []) + ([f"min_p={min_p:g}"] if min_p else [])
    return ", ".join(cut)


def refusal(trainer: str, args, est, behaviour: str = "sampler") -> str | None:
    """One line when `est` needs what `trainer`'s batch under `args` lacks; None when it can run."""
    name = f"klbench estimator {est.name!r}"
    if behaviour not in BEHAVIOURS:
        return f"{trainer}: kl_behaviour={behaviour!r} is unknown; valid: {', '.join(BEHAVIOURS)}"
    if args.beta is not None and args.beta < 0:
        return (f"{trainer}: args.beta={args.beta} is negative, which trains away from the reference; the KL "
                f"coefficient of {name} must be > 0 (klbench's CLI refuses estimator.beta < 0 too)")
    if not args.beta:
        return (f"{trainer}: args.beta is 0, so TRL loads no reference model and has no KL term for {name} to "
                "replace: set args.beta > 0 (it is the estimator's coefficient)")
    if trainer == "GRPOTrainer" and getattr(args, "use_vllm", False) and behaviour == "sampler":
        cut = engine_cut(args)
        if cut:
            return (f"{trainer}: use_vllm with {cut} and kl_behaviour='sampler': vLLM cuts the tokens on its own "
                    f"logits, so its log-probs (sampling_per_token_logps) are of a distribution that never draws "
                    "tokens pi gives mass to, and no importance weight can fix that for the KL: sample without "
                    "top_p/top_k/min_p, or pass kl_behaviour='scorer' (the engine's mismatch then stays invisible "
                    "to the KL term)")
        if not est.supports_off_policy():
            return (f"{trainer}: use_vllm sends vLLM's log-probs of its samples (sampling_per_token_logps), and with "
                    f"kl_behaviour='sampler' they are the KL batch's behaviour policy, but {name} assumes samples "
                    "from pi: use rb, in_reward or in_loss with ratio='token'|'sequence' (they correct for the "
                    "engine), or kl_behaviour='scorer' (the engine's mismatch then stays invisible to the KL term)")
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
        # TRL sets steps_per_generation = gradient_accumulation_steps when it is not given, so raising GA alone never
        # makes GA a multiple of steps_per_generation * num_iterations: steps_per_generation=1 and GA a multiple of
        # num_iterations does (each generation batch is then used up within one optimiser step, by the policy that
        # drew it), and so does num_iterations=1 with steps_per_generation unset
        ga = args.num_iterations * -(-args.gradient_accumulation_steps // args.num_iterations)
        aligned = (f"set steps_per_generation=1 and gradient_accumulation_steps={ga} (each generation batch is then "
                   "used within one optimiser step, by the policy that drew it), or num_iterations=1 with "
                   "steps_per_generation unset")
        if not est.supports_off_policy():
            return (f"{trainer}: {name} assumes samples from the current policy, but with {setting} TRL trains on "
                    "samples of an older policy: use rb, in_reward or in_loss with ratio='token'|'sequence' "
                    f"(they correct for it), or {aligned}")
        if trainer == "RLOOTrainer":
            return (f"{trainer}: with {setting} TRL trains on samples of an older policy, and {name} needs that "
                    "policy's per-token log-probs (KLBatch.old_logp), which RLOOTrainer keeps only summed per "
                    f"sequence (inputs['old_logps']): {aligned}")
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

    def __init__(self, *args: Any, kl_estimator: str = "rb", kl_options: dict | None = None,
                 kl_behaviour: str = "sampler", **kwargs: Any):
        if trl.__version__ != SUPPORTED:
            raise ValueError(f"klbench.integrations.trl supports TRL {SUPPORTED} (it overrides its _compute_loss), "
                             f"found {trl.__version__}: pip install trl=={SUPPORTED}")
        est = gradient_estimator(kl_estimator, **(kl_options or {}))  # an unknown name or option: its own line
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is not None and (why := refusal(self._trainer, config, est, kl_behaviour)):
            raise ValueError(why)  # before TRL loads any model
        super().__init__(*args, **kwargs)
        if (why := refusal(self._trainer, self.args, est, kl_behaviour)):  # TRL's default config, when none was given
            raise ValueError(why)
        self.kl_estimator, self.kl_beta, self.kl_behaviour = est, self.beta, kl_behaviour
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
        if trl_head.refusal(bare, self.args) is None:  # one policy head product for TRL's loss and the KL term
            return self._one_head_loss(model, bare, inputs)
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
        return self._add_kl_term(loss, batch, inputs)

    def _add_kl_term(self, loss: torch.Tensor, batch: KLBatch, inputs) -> torch.Tensor:
        surrogate = self.kl_estimator(batch)  # [B]
        mode = "train" if self.model.training else "eval"
        seq_kl = self.accelerator.gather(batch.kappa.detach().sum(-1))  # rb's value of KL(pi || pi_ref) per sequence
        self._metrics[mode]["klbench/seq_kl"].append(seq_kl.mean().item())
        return loss + self.kl_beta * surrogate.sum() / self._normaliser(inputs, batch.mask)

    def _one_head_loss(self, model, bare, inputs) -> torch.Tensor:
        """TRL's loss plus the KL term with the policy's head run once (klbench/integrations/trl_head.py): the
        reference's states first, then TRL's loss, whose fused forward head_scores serves, handing TRL its log-probs
        and entropy and keeping log pi_ref and kappa for the KLBatch."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)  # [B, L], as TRL's loss builds it
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        ref_bare, h_ref = self._reference_states(model, ids, attention)  # [B, L, H], no gradient
        one = trl_head.OneHead(bare, lm_head(bare, self.temperature), h_ref, lm_head(ref_bare, self.temperature),
                               getattr(self.args, "cast_lm_head_to_fp32", False))
        with one:
            loss = super()._compute_loss(model, inputs)  # TRL's loss: its KL term is off (self.beta == 0)
        if one.scores is None:
            raise RuntimeError("klbench.integrations.trl: TRL's loss made no policy forward")
        K = inputs["completion_ids"].shape[1]
        mask = inputs["completion_mask"].bool()  # [B, K], EOS included (TRL's own)
        if "tool_mask" in inputs:  # tool outputs are not pi's choices: TRL's loss masks them too
            mask = mask & inputs["tool_mask"].bool()
        # the last K positions score the completion's K tokens; 0 off the KL's mask, where KLBatch never reads them
        logp, ref_logp, kappa = (torch.where(mask, x[:, -K:], 0.0) for x in one.scores[1:])
        old = self._behaviour_logp(inputs, mask)
        batch = KLBatch(logp, ref_logp, mask, group=inputs.get("klbench_group"), token_kl=kappa,
                        old_logp=None if old is None else old.detach().to(logp.dtype))
        return self._add_kl_term(loss, batch, inputs)

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
        old = self._behaviour_logp(inputs, mask)
        with contextlib.nullcontext() if fp32 else self.accelerator.autocast():
            return completion_batch(h, lm_head(bare, self.temperature), h_ref, lm_head(ref_bare, self.temperature),
                                    inputs["completion_ids"], mask, inputs.get("klbench_group"), old)

    def _behaviour_logp(self, inputs, mask: torch.Tensor) -> torch.Tensor | None:
        """[B, K] log-probs of the policy that drew the completions, or None (drawn by pi itself).

        With vLLM, GRPOTrainer keeps the engine's own log-probs of its samples (`sampling_per_token_logps`,
        trl/trainer/grpo_trainer.py:2911): at kl_behaviour='sampler' they are the behaviour policy, so that rb follows
        grad KL(pi || pi_ref) under the engine's mismatch (docs/mismatch.md). A token vLLM sent no log-prob for (NaN)
        gets the trainer's recomputation there, as TRL's own ratio does (ratio 1, grpo_trainer.py:2662-2665); their
        count is logged as klbench/engine_logp_missing. Otherwise, under off-policy reuse, TRL's
        old_per_token_logps (GRPO's; RLOO's reuse is refused)."""
        trainer_old = inputs.get("old_per_token_logps") if self._reuses else None
        engine = inputs.get("sampling_per_token_logps") if self.kl_behaviour == "sampler" else None
        if engine is None:
            return trainer_old
        if not self.kl_estimator.supports_off_policy():  # refused at __init__ under use_vllm; a batch built by hand
            raise ValueError(f"{self._trainer}: the batch carries the engine's log-probs (sampling_per_token_logps) "
                             f"and klbench estimator {self.kl_estimator.name!r} assumes samples from pi: use rb, or "
                             "kl_behaviour='scorer'")
        missing = ~torch.isfinite(engine) & mask
        if bool(missing.any()):
            fill = inputs.get("old_per_token_logps")
            if fill is None:  # TRL skips the recomputation only when it equals pi's own (no reuse, no vLLM ratio)
                raise ValueError(f"{self._trainer}: vLLM sent no log-prob for {int(missing.sum())} sampled token(s) and "
                                 "the batch has no old_per_token_logps to stand in: set "
                                 "vllm_importance_sampling_correction=True (TRL then recomputes them)")
            engine = torch.where(missing, fill, engine)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["klbench/engine_logp_missing"].append(float(missing.sum()))
        return torch.where(mask, engine, torch.zeros((), dtype=engine.dtype, device=engine.device))

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
