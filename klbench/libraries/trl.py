"""TRL: the real `GRPOTrainer._compute_loss` and `RLOOTrainer._compute_loss`, called once per sequence; and
DistillationTrainer's divergence loss (settings trl.distill.*, see _distill_settings).

Each trainer is built with `object.__new__` (no model, no dataset, no generation), its attributes set from
a real `GRPOConfig` / `RLOOConfig` (so TRL's own defaults apply unless a setting overrides one) as
`__init__` sets them, and `_get_per_token_logps_and_entropies` stubbed to return KLBatch.logp, as TRL's
own tests do. `accelerator` is a real CPU `accelerate.Accelerator`.

GRPO: advantages are 0, so only the KL term (beta * per_token_kl) moves the policy; beta = 1 unless the
setting says otherwise (TRL's default beta is 0.0: `trl.grpo.default_beta`). The per-sequence loss is
`_compute_loss` on a one-sequence batch, so each loss type's normalisation is applied per sequence:
dapo (the default) divides by num_items_in_batch, fixed at 1 here (TRL divides by the generation batch's
token count, a per-step constant), so dapo is the token sum; grpo is the per-sequence token mean;
dr_grpo is the token sum / max_completion_length. old_per_token_logps is KLBatch.old_logp off-policy.

RLOO: the KL enters the reward in `_generate_and_score_completions` (rloo_trainer.py, the lines after
"Include the KL penalty in the reward"), which needs generation and so is not called: the adapter forms the
advantage the same way, -beta * sum_t (old_logp_t - ref_logp_t), and passes it with old_logps to the real
`_compute_loss` (sequence ratio, PPO clip at TRL's epsilon). The leave-one-out baseline is left out: it does
not change the expected gradient.

GRPO and RLOO at a temperature (Setting.scored, the audit's sampling axis): nothing is stubbed. TRL patches the
policy and the reference with `add_fused_lm_head(model, temperature=self.temperature)` in __init__ and scores both
(and pi_old, when it is needed) with `_get_per_token_logps_and_entropies`; the adapter does the same to two stand-in
models whose backbone returns klbench's raw logits as hidden states under an identity lm_head [V, V], and calls the
real `_compute_loss(policy, inputs)` with the reference's (and, for RLOO's advantage, pi_old's) log-probs from the
same scorer, so TRL's own kernel divides by the temperature. Samples come from the truncating sampler where the
setting says top-p (generate's warpers; TRL's vLLM importance-sampling correction, off by default, is not modelled).
"""
from __future__ import annotations

import tempfile
import warnings
from collections import defaultdict

import torch

from klbench.estimators import KLBatch
from klbench.libraries.base import Library, LibraryMissing, Setting, line_of, old_or_current, require, source_of

DIST, SUPPORTED = "trl", "1.16.0"

GRPO_SETTINGS = {  # setting -> GRPOConfig overrides (beta = 1 unless given)
    "trl.grpo": {},
    "trl.grpo.default_beta": {"beta": None},
    "trl.grpo.no_bias_correction": {"use_bias_correction_kl": False},
    "trl.grpo.sequence_is": {"importance_sampling_level": "sequence"},
    "trl.grpo.sequence_is.no_bias_correction": {"importance_sampling_level": "sequence",
                                                 "use_bias_correction_kl": False},
    "trl.grpo.loss_grpo": {"loss_type": "grpo"},
    "trl.grpo.loss_dr_grpo": {"loss_type": "dr_grpo"},
}
RLOO_SETTINGS = {"trl.rloo": {"beta": 1.0}, "trl.rloo.no_clip": {"beta": 1.0, "epsilon": 1e9}}


def _accelerator():
    from accelerate import Accelerator
    return Accelerator(cpu=True)


def _config(cls, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir=tempfile.mkdtemp(prefix="klbench-trl-"), report_to=[], use_cpu=True, bf16=False,
                   **overrides)


def _grpo_trainer(GRPOTrainer, GRPOConfig, overrides: dict, accelerator):
    over = dict(overrides)
    if "beta" not in over:
        over["beta"] = 1.0
    elif over["beta"] is None:
        del over["beta"]
    args = _config(GRPOConfig, **over)
    t = object.__new__(GRPOTrainer)
    # as GRPOTrainer.__init__ sets them from args
    t.args, t.accelerator, t.model = args, accelerator, torch.nn.Module()
    t.beta, t.loss_type, t.importance_sampling_level = args.beta, args.loss_type, args.importance_sampling_level
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.max_completion_length = args.max_completion_length
    # options an older release lacks take their off value (scripts/audit_versions.py runs this on older TRLs)
    t.top_entropy_quantile = getattr(args, "top_entropy_quantile", 1.0)
    t.off_policy_mask_threshold = getattr(args, "off_policy_mask_threshold", None)
    t.use_vllm, t.vllm_importance_sampling_correction = args.use_vllm, args.vllm_importance_sampling_correction
    t.entropy_coef = getattr(args, "entropy_coef", 0.0)
    t.use_adaptive_entropy = getattr(args, "use_adaptive_entropy", False)
    t._entropy_bonus_enabled = t.entropy_coef != 0.0 or t.use_adaptive_entropy
    t.aux_loss_enabled = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = 1
    return t


def _rloo_trainer(RLOOTrainer, RLOOConfig, overrides: dict, accelerator):
    args = _config(RLOOConfig, **overrides)
    t = object.__new__(RLOOTrainer)
    t.args, t.accelerator, t.model = args, accelerator, torch.nn.Module()
    t.beta = args.beta
    t.epsilon_low = args.epsilon
    t.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    t.aux_loss_enabled = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.current_gradient_accumulation_steps = 1
    return t


def _row_inputs(batch: KLBatch, b: int) -> dict:
    T = batch.logp.shape[1]
    return {"prompt_ids": torch.zeros(1, 1, dtype=torch.long), "prompt_mask": torch.ones(1, 1, dtype=torch.long),
            "completion_ids": torch.zeros(1, T, dtype=torch.long),
            "completion_mask": batch.mask[b:b + 1].long()}


def _per_row(trainer, batch: KLBatch, extra) -> torch.Tensor:
    """[B] trainer._compute_loss on each one-sequence batch, logp stubbed in as the model's output."""
    logp = batch.masked_logp
    out = []
    for b in range(logp.shape[0]):
        row = logp[b:b + 1]
        trainer._get_per_token_logps_and_entropies = (
            lambda *a, row=row, **k: (row, torch.zeros_like(row.detach()), None))
        inputs = _row_inputs(batch, b)
        inputs.update(extra(b))
        out.append(trainer._compute_loss(None, inputs))
    return torch.stack(out)


class _Backbone(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput
        return BaseModelOutput(last_hidden_state=self.hidden)


class _TextConfig:
    def get_text_config(self):
        return self  # no softcapping, no logit scale: add_fused_lm_head reads them as absent


class _LogitsModel(torch.nn.Module):
    """A causal LM whose last hidden state is given logits [1, L, V] under an identity lm_head: TRL's fused head
    then computes log_softmax(logits / temperature) of the labels with its own kernel and backward."""

    def __init__(self, V: int, dtype: torch.dtype):
        super().__init__()
        self.config, self.backbone = _TextConfig(), _Backbone()
        self.head = torch.nn.Linear(V, V, bias=False, dtype=dtype)
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(V, dtype=dtype))
        self.head.weight.requires_grad_(False)

    @property
    def base_model(self):
        return self.backbone

    def get_output_embeddings(self):
        return self.head

    def forward(self, **kwargs):
        raise RuntimeError("only add_fused_lm_head's forward is used")

    def holding(self, logits: torch.Tensor) -> "_LogitsModel":
        """logits [1, T, V] of the T response positions; a prompt of one token, so position t predicts y_{t+1}."""
        self.backbone.hidden = torch.cat([logits, torch.zeros_like(logits[:, :1])], 1)  # [1, T + 1, V]
        return self


def _scored_grpo(trainer, add_fused_lm_head):
    """GRPO's loss with TRL's scoring at the sampling's temperature (see the module docstring)."""
    def scored(batch, sampling) -> torch.Tensor:
        trainer.temperature = sampling.temperature  # as __init__: self.temperature = args.temperature
        V, dtype = batch.logits.shape[-1], batch.logits.dtype
        policy, ref = _LogitsModel(V, dtype), _LogitsModel(V, dtype)
        add_fused_lm_head(policy, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        add_fused_lm_head(ref, temperature=trainer.temperature)
        out = []
        for b in range(batch.logits.shape[0]):
            inputs = _row_inputs(batch, b)
            inputs["completion_ids"] = batch.tokens[b:b + 1]
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            T = ids.shape[1] - 1
            with torch.no_grad():
                ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    ref.holding(batch.ref_logits[b:b + 1]), ids, mask, T)
            inputs.update({"advantages": torch.zeros(1, dtype=dtype), "ref_per_token_logps": ref_logps,
                           "num_items_in_batch": torch.tensor(1.0, dtype=dtype)})
            out.append(trainer._compute_loss(policy.holding(batch.logits[b:b + 1]), inputs))
        return torch.stack(out)
    return scored


def _scored_rloo(trainer, add_fused_lm_head):
    """RLOO's loss with TRL's scoring at the sampling's temperature: pi_old and pi_ref scored by the same
    _get_per_token_logps_and_entropies (rloo_trainer.py, _generate_and_score_completions; pi_old = pi on-policy),
    the advantage formed from them as `loss` forms it, and the real _compute_loss on the stand-in policy."""
    def scored(batch, sampling) -> torch.Tensor:
        trainer.temperature = sampling.temperature  # as __init__: self.temperature = args.temperature
        V, dtype = batch.logits.shape[-1], batch.logits.dtype
        policy, old, ref = (_LogitsModel(V, dtype) for _ in range(3))
        add_fused_lm_head(policy, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        add_fused_lm_head(old, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
        add_fused_lm_head(ref, temperature=trainer.temperature)
        out = []
        for b in range(batch.logits.shape[0]):
            inputs = _row_inputs(batch, b)
            inputs["completion_ids"] = batch.tokens[b:b + 1]
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            T = ids.shape[1] - 1
            with torch.no_grad():
                old_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    old.holding(batch.logits[b:b + 1].detach()), ids, mask, T)
                ref_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                    ref.holding(batch.ref_logits[b:b + 1]), ids, mask, T)
            m = inputs["completion_mask"].to(dtype)
            old_logps, ref_logps = old_logps.to(dtype) * m, ref_logps.to(dtype) * m  # [1, T]
            inputs.update({"advantages": -trainer.beta * (old_logps - ref_logps).sum(-1),
                           "old_logps": old_logps.sum(-1)})
            out.append(trainer._compute_loss(policy.holding(batch.logits[b:b + 1]), inputs))
        return torch.stack(out)
    return scored


def load() -> Library:
    version = require(DIST, SUPPORTED)
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    lib = Library(DIST, version)
    acc, trainers = None, []  # the Accelerator is made after every config: TrainingArguments resets its state
    grpo_src, rloo_src = source_of(GRPOTrainer._compute_loss), source_of(RLOOTrainer._compute_loss)
    try:  # the temperature axis needs TRL's fused scorer; releases before 1.15 have none (scripts/audit_versions.py)
        from trl.trainer.utils import add_fused_lm_head
        divides = (f"policy, reference and old: add_fused_lm_head(..., temperature=self.temperature) on the model "
                   f"({line_of(GRPOTrainer.__init__, 'add_fused_lm_head(')}) and ref_model "
                   f"({line_of(GRPOTrainer.__init__, 'self.ref_model, temperature=self.temperature')}), all three "
                   f"scored by `{source_of(GRPOTrainer._get_per_token_logps_and_entropies)}`")
        rloo_divides = (f"policy, reference and old: add_fused_lm_head(..., temperature=self.temperature) on the "
                        f"model ({line_of(RLOOTrainer.__init__, 'add_fused_lm_head(')}) and ref_model "
                        f"({line_of(RLOOTrainer.__init__, 'add_fused_lm_head(self.ref_model')}), all three scored by "
                        f"`{source_of(RLOOTrainer._get_per_token_logps_and_entropies)}`")
    except (ImportError, LibraryMissing) as e:
        add_fused_lm_head, divides = None, f"not called: this release has no add_fused_lm_head ({e})"
        rloo_divides = divides
    for name, over in GRPO_SETTINGS.items():
        trainer = _grpo_trainer(GRPOTrainer, GRPOConfig, over, acc)
        trainers.append(trainer)

        def loss(batch: KLBatch, trainer=trainer) -> torch.Tensor:
            ref = torch.where(batch.mask, batch.ref_logp, torch.zeros((), dtype=batch.ref_logp.dtype))
            old = None if batch.old_logp is None else old_or_current(batch)

            def extra(b):
                d = {"advantages": torch.zeros(1, dtype=batch.logp.dtype), "ref_per_token_logps": ref[b:b + 1],
                     "num_items_in_batch": torch.tensor(1.0, dtype=batch.logp.dtype)}
                if old is not None:
                    d["old_per_token_logps"] = old[b:b + 1]
                return d
            return _per_row(trainer, batch, extra)

        a = trainer.args
        unstubbed = _grpo_trainer(GRPOTrainer, GRPOConfig, over, acc)  # its scorer stays TRL's own
        trainers.append(unstubbed)
        lib.settings[name] = Setting(
            name, loss, grpo_src, f"_compute_loss per sequence, loss_type={a.loss_type}",
            f"beta={a.beta}, use_bias_correction_kl={a.use_bias_correction_kl}, "
            f"importance_sampling_level={a.importance_sampling_level}",
            scored=_scored_grpo(unstubbed, add_fused_lm_head) if add_fused_lm_head else None,
            divides_by_t=divides)
    for name, over in RLOO_SETTINGS.items():
        trainer = _rloo_trainer(RLOOTrainer, RLOOConfig, over, acc)
        trainers.append(trainer)

        def loss(batch: KLBatch, trainer=trainer) -> torch.Tensor:
            old = old_or_current(batch)
            ref = torch.where(batch.mask, batch.ref_logp, torch.zeros((), dtype=batch.ref_logp.dtype))
            old_seq = old.sum(-1)  # [B] as TRL: (old_per_token_logps * completion_mask).sum(1)
            adv = -trainer.beta * (old - ref).sum(-1)  # [B] k1 of the rollout policy, in the reward

            def extra(b):
                return {"advantages": adv[b:b + 1], "old_logps": old_seq[b:b + 1]}
            return _per_row(trainer, batch, extra)

        a = trainer.args
        unstubbed = _rloo_trainer(RLOOTrainer, RLOOConfig, over, acc)  # its scorer stays TRL's own
        trainers.append(unstubbed)
        lib.settings[name] = Setting(
            name, loss, rloo_src, "_compute_loss per sequence (sequence ratio, PPO clip); KL in the reward",
            f"beta={a.beta}, epsilon={a.epsilon}",
            scored=_scored_rloo(unstubbed, add_fused_lm_head) if add_fused_lm_head else None, divides_by_t=rloo_divides)
    acc = _accelerator()
    for t in trainers:
        t.accelerator = acc
    try:  # DistillationTrainer is new in 1.10: older releases audit without it (scripts/audit_versions.py)
        _distill_settings(lib)
    except ImportError:
        pass
    return lib


# ---- on-policy distillation: DistillationTrainer's loss (trl/trainer/distillation_trainer.py) ----
# setting -> (beta, temperature). beta selects the divergence (TRL's docstring: 0 forward KL, 1 reverse KL,
# else the generalised JSD); temperature divides both models' logits inside the loss. DistillationConfig's
# top_k (and top_p, min_p) reach only the GenerationConfig that samples completions, never the loss, so they
# change which samples arrive, not the gradient a sample gives: no setting of their own.
DISTILL_SETTINGS = {
    "trl.distill.beta0": (0.0, 1.0),
    "trl.distill.beta0.5": (0.5, 1.0),
    "trl.distill.beta1": (1.0, 1.0),  # DistillationConfig's default beta
    "trl.distill.beta1.temperature2": (1.0, 2.0),
}


def _distill_settings(lib: Library) -> None:
    """DistillationTrainer._compute_loss hands the student's and teacher's last hidden states and lm_heads to
    the module function _chunked_divergence_loss, which projects them to logits and runs TRL's
    ChunkedDivergenceFunction (its own forward and backward). The adapter calls that function with the
    logits themselves as hidden states and an identity lm_head [V, V] (logits = h @ I), one sequence at a
    time with num_items_in_batch = 1, so each sequence's loss is its token sum (TRL divides by the global
    batch's token count, a per-step constant)."""
    from trl.trainer import distillation_trainer as dt
    from trl.trainer.distillation_config import DistillationConfig

    default_beta = DistillationConfig.__dataclass_fields__["beta"].default
    src = source_of(dt._chunked_divergence_loss)
    for name, (beta, temperature) in DISTILL_SETTINGS.items():
        def loss(batch: KLBatch, beta=beta, temperature=temperature) -> torch.Tensor:
            K = batch.logits.shape[-1]
            eye = torch.eye(K, dtype=batch.logits.dtype, device=batch.logits.device)  # [V, H = V]
            teacher = batch.ref_logits.detach()
            out = []
            for b in range(batch.logits.shape[0]):
                value, _, _ = dt._chunked_divergence_loss(batch.logits[b:b + 1], teacher[b:b + 1], eye, eye,
                                                          batch.mask[b:b + 1].long(), beta, num_items_in_batch=1,
                                                          temperature=temperature)
                out.append(value)
            return torch.stack(out)

        note = f"beta={beta}, temperature={temperature}" + (" (defaults)" if beta == default_beta and
                                                             temperature == 1.0 else "")
        lib.settings[name] = Setting(name, loss, src, "token sum per sequence (_chunked_divergence_loss, full "
                                     "vocabulary, autodiff through TRL's own backward)", note, task="distill")
