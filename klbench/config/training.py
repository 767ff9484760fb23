"""The options of the groups that say what a run trains: task, estimator and kl_ctl, one pydantic model per option
(klbench.config.schema says how they are used). Every default is declared here, once."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, create_model

from klbench.estimators.options import (ADVANTAGES, LOSS_AGGS, REPORTED_VALUES, ControlVariateOptions, Expect,
                                        InLossOptions, InRewardOptions, LibraryOptions, Options, TopKTailOptions,
                                        TopKTruncOptions, VOPDOptions)
from klbench.estimators.targets import KL_TARGETS
from klbench.estimators.pg_correction_options import PGCorrectionFields
from klbench.probe.config import ProbeOptions, StepProbeOptions
from klbench.config.fields import PosInt

# ---- task ----

# the probe block of rl/distill: its fields' types (and StepProbeOptions' defaults) always; grad_samples <=
# samples only where task.probe_every uses it (_check_probe_every), since task.probe.grad_samples follows
# task.n_samples
_ProbeFields = create_model("ProbeFields", __base__=Options,
                            **{k: (f.annotation, f) for k, f in StepProbeOptions.model_fields.items()})


# how rollouts sample and which KL the run regularises: klbench/estimators/sampling.py (Sampling), with the names
# and rules of klbench/estimators/targets.py, which this module reads without torch
# Beyond these the sampler is a point mass or uniform to float32 precision (issue 50: 1e-30 and 1e30 trained nothing,
# loss 0 and every KL 0): below T_MIN, exp((l2 - l1) / T) underflows (< e^-104) for any two logits 1e-6 apart, the
# float32 spacing of logits near 10, so pi_s is the argmax; above T_MAX, (l - l_max) / T is under 6e-8 for logit
# spans below 60, and exp rounds it to 1: pi_s is uniform.
T_MIN, T_MAX = 1e-8, 1e9
TEMPERATURE = (f"a finite number > 0, within [{T_MIN:g}, {T_MAX:g}] (temperature 0, greedy decoding, is refused "
               f"for training: it samples a point mass, on which no KL estimator is defined; below {T_MIN:g} the "
               f"sampler is that point mass to float precision, above {T_MAX:g} it is uniform to float precision)")


class SamplingFields(Options):
    """task.temperature, top_k, top_p and kl_target: of rl, distill (training and validation) and probe.

    The sampler pi_s: generate()'s temperature, top_k, top_p; temperature > 0 (greedy is a point mass: no estimator
    is defined on it); top_k 0 and top_p 1 cut nothing. kl_target, which KL the run regularises and measures
    (docs/sampling.md): sampler = KL(pi_s || pi_ref,T), the sampler against the reference at its temperature;
    model = KL(pi || pi_ref), pi_s a behaviour policy (off-policy estimators, no truncation); tempered =
    KL(pi_T || pi_ref,T) over the full vocabulary (TRL, verl); tempered_vs_raw = KL(pi_T || pi_ref) (tinker #689)."""
    temperature: Annotated[float, Field(ge=T_MIN, le=T_MAX, allow_inf_nan=False), Expect(TEMPERATURE)] = 1.0
    top_k: Annotated[int, Field(ge=0), Expect("an integer >= 0 (0: no top-k cut)")] = 0
    top_p: Annotated[float, Field(gt=0, le=1), Expect("a number in (0, 1] (1: no top-p cut)")] = 1.0
    kl_target: Literal[tuple(KL_TARGETS)] = "sampler"


# the rollout engine when it is not the trainer (klbench/models/sampler_engine.py, docs/mismatch.md "The sampler is
# not the trainer"): the names of its options, read here without torch
SAMPLER_PRECISIONS = ("same", "bf16", "float16")
SAMPLER_ATTENTION = ("same", "eager", "sdpa")
BEHAVIOURS = ("sampler", "scorer")


class SamplerFields(Options):
    """task.sampler: a rollout engine that is not the trainer, as a pipelined RL system runs one. precision: the
    engine's copy of the policy in bf16 or float16 (same: the trainer's dtype); attn_implementation: the engine's
    attention (same: the trainer's); lag: each step trains on rollouts drawn by the weights of `lag` optimiser
    steps ago (AReaL, PipelineRL); the first `lag` steps by the initial weights. All at their defaults the sampler
    is the trainer's own model."""
    precision: Literal[SAMPLER_PRECISIONS] = "same"
    attn_implementation: Literal[SAMPLER_ATTENTION] = "same"
    lag: int = Field(0, ge=0)


class TaskRL(SamplingFields):
    """Reward + beta * KL(pi || pi_ref): RLOO (task.advantage) for the reward, the configured estimator for the KL."""
    name: Literal["rl"]
    n_samples: PosInt = 4  # samples per prompt: the RLOO group (loo's KL group too)
    prompts_per_step: PosInt = 8  # prompts per optimisation step (batch = prompts_per_step * n_samples)
    max_new_tokens: PosInt = 24
    lr: float = Field(3.0e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: Optional[float] = Field(1.0, ge=0)  # the gradient norm's clip; null: no clipping
    max_steps: PosInt = 120
    val_every: PosInt = 40  # steps between validations on held-out prompts
    val_prompts: PosInt = 32
    val_samples: PosInt = 2  # fresh samples per held-out prompt
    val_seed: int = 1234  # validation samples come from their own seeded stream
    log_every: PosInt = 5
    reward_coef: float = 1.0
    n_sample_texts: int = Field(8, ge=0)  # rows of the sample-text table logged at each validation
    # a small estimator probe (klbench/probe/measure.py) at the validations whose step is a multiple of it (null:
    # never), with the options of task.probe (klbench.probe.config.StepProbeOptions), logged as probe/* metrics
    probe_every: Optional[int] = Field(None, ge=1)
    # no default of its own: conf/task/rl.yaml sets task.probe.grad_samples to ${..n_samples}; null: no probe block
    probe: Optional[_ProbeFields]
    # sequences scored at once (language models: klbench.models.policies.LMPolicy.score); null: the whole batch.
    # The loss still sees the whole batch, so the gradient is the full batch's for every estimator (docs/scale.md)
    micro_batch_size: Optional[PosInt] = None
    # optimiser steps per rollout (GRPO num_iterations, PPO epochs): > 1 reuses each rollout off-policy
    inner_steps: PosInt = 1
    clip_eps: float = Field(0.2, gt=0, le=1)  # PPO clip of the reward term's per-token ratio pi / pi_old (inner_steps > 1)
    # the reward term (klbench/estimators/advantages.py states each formula): rloo | grpo (group mean and std) |
    # dr_grpo (group mean) | reinforce (batch mean)
    advantage: Literal[ADVANTAGES] = "rloo"
    adv_eps: float = Field(1.0e-6, gt=0)  # grpo's (r - mean) / (std + adv_eps): verl 1e-6, TRL 1e-4
    # seq_sum | token_mean (DAPO) | seq_mean_token_mean (GRPO) | seq_sum_norm (Dr. GRPO, / max_new_tokens)
    loss_agg: Literal[LOSS_AGGS] = "seq_sum"
    sampler: SamplerFields = SamplerFields()
    # the behaviour policy a batch drawn by another engine carries (KLBatch.old_logp): the engine's own log-probs
    # (Rollout.sampled_logp, as vLLM sends them) or the trainer's recomputation, which hides the mismatch
    # (docs/mismatch.md, "task.behaviour")
    behaviour: Literal[BEHAVIOURS] = "sampler"
    # the policy-gradient correction for an engine that is not the trainer: mode none | token_truncate | token_mask |
    # sequence_truncate | sequence_mask, the weight's bounds cap and floor (TRL's and verl's semantics;
    # klbench/estimators/pg_correction.py, docs/mismatch.md "PG corrections")
    pg_correction: PGCorrectionFields = PGCorrectionFields()


class TaskDistill(TaskRL):
    """On-policy distillation: the student (model) samples and minimises KL(student || teacher) with the configured
    gradient estimator. rl's keys; the rules that make it distillation (teacher, beta = 1) are in
    _check_combination. lr stays rl's 3e-4: 1e-3 made every estimator's KL rise first on the embedded
    student/teacher pair."""
    name: Literal["distill"]
    reward_coef: float = 0.0  # an optional reward term with its own coefficient (needs a reward other than none)
    max_steps: PosInt = 150
    val_every: PosInt = 25


class TaskPretrain(Options):
    """Build (or rebuild) the embedded LM described by model=embedded into the per-user cache (paths.cache)."""
    name: Literal["pretrain"]
    force: bool = False  # rebuild even if the cache for this spec exists


class TaskProbe(ProbeOptions, SamplingFields):
    """Measure every value and gradient estimator on a policy/reference pair (klbench/probe/measure.py): the
    options are ProbeOptions' (klbench/probe/config.py), the sampler and KL target rl's (docs/sampling.md)."""
    name: Literal["probe"]
    max_new_tokens: PosInt = 24


Task = Union[TaskRL, TaskDistill, TaskPretrain, TaskProbe]


# ---- estimator: the options are klbench.estimators.options', beta is the run's ----

# The largest KL coefficient a run accepts (estimator.beta, kl_ctl.init_beta). Past it the reward weighs
# next to nothing against beta x KL (task.reward_coef=0 trains on the KL alone), and a huge beta does not
# regularise harder: beta x KL and its gradient overflow (estimator.beta=1e308 trained with no KL gradient
# at all, as if beta were 0, and recorded inf losses).
BETA_MAX = 1e4
BETA_RANGE = (f"a finite number >= 0 and <= {BETA_MAX:g} (a larger one leaves the reward no weight; "
              "task.reward_coef=0 trains on the KL alone)")
Beta = Annotated[float, Field(ge=0, le=BETA_MAX), Expect(BETA_RANGE)]


class _Beta(Options):
    beta: Beta = 0.05  # scales KL(pi || pi_ref) in the loss (kl_ctl=fixed; kl_ctl=adaptive starts from it)


class Estimator(_Beta):
    """The gradient estimators without options (docs/estimators.md)."""
    name: Literal["naive_mc", "token", "seq", "cumulative", "loo", "rb"]


class EstimatorNaiveCV(ControlVariateOptions, _Beta):
    name: Literal["naive_cv"]


class EstimatorInReward(InRewardOptions, _Beta):
    name: Literal["in_reward"]


class EstimatorInLoss(InLossOptions, _Beta):
    name: Literal["in_loss"]


class EstimatorLibrary(LibraryOptions, _Beta):
    name: Literal["library"]


class EstimatorVOPD(VOPDOptions, _Beta):
    name: Literal["vopd"]


class EstimatorTopKTail(TopKTailOptions, _Beta):
    name: Literal["topk_tail"]


class EstimatorTopKTrunc(TopKTruncOptions, _Beta):
    name: Literal["topk_trunc"]


EstimatorOption = Union[Estimator, EstimatorNaiveCV, EstimatorInReward, EstimatorInLoss, EstimatorLibrary,
                        EstimatorVOPD, EstimatorTopKTail, EstimatorTopKTrunc]


# ---- kl_ctl: klbench.tasks.kl_control ----

Signal = Literal[tuple(REPORTED_VALUES)]  # the value estimators klbench reports (and logs as train/kl_<label>)

class KLCtlFixed(Options):
    """beta = estimator.beta for the whole run (klbench/tasks/kl_control.py: FixedKL). The default."""
    name: Literal["fixed"]


HORIZON_UNITS = ("steps", "sequences")  # of kl_ctl.horizon (klbench.tasks.kl_control.AdaptiveKL)


class KLCtlAdaptive(Options):
    """Hold a target sequence KL(pi || pi_ref) instead of choosing beta (klbench/tasks/kl_control.py: AdaptiveKL),
    a PI controller on log beta. These defaults, the controller's too, hold the target without ringing:
    docs/kl-control.md. init_beta has no default here: conf/kl_ctl/adaptive.yaml sets it to ${estimator.beta}."""
    name: Literal["adaptive"]
    target: float = Field(2.0, gt=0)  # nats per sequence
    # integral time: the integral part moves log beta by at most clip / horizon = 4% a step
    horizon: float = Field(10, gt=0)
    # steps | sequences (the unit before issue 18: then horizon counts sequences)
    horizon_unit: Literal[HORIZON_UNITS] = "steps"
    kp: float = Field(1.0, ge=0)  # proportional gain on log beta (damping); beta stays within exp(+-kp * clip) of beta_i
    init_beta: float = Field(gt=0)  # the update is multiplicative: 0 would stay 0
    clip: float = Field(0.4, gt=0)  # bound on the relative error: a wild estimate moves beta by at most exp(kp * clip)
    signal: Signal = "rb"  # mc | k2 | k3 | cv_seq | cv_opt | rb (train/kl_<signal>)


KLCtl = Union[KLCtlFixed, KLCtlAdaptive]
