"""The typed schema of a composed klbench config, checked before anything heavy is imported.

`validate(cfg)` raises ConfigError naming the field first (and the valid options where that helps): a bad
value then fails before torch, Lightning and MLflow are imported, with klbench's message rather than another
library's. This module imports only the stdlib, omegaconf, pydantic and torch-free klbench modules (a test
checks it).

Each option of each config group is a pydantic model (klbench.estimators.options.Options: unknown keys, NaN
and coercion refused) whose fields are the keys its yaml may hold. Every default is declared here, once: Hydra
takes them from these models (klbench.config.resolvers.register puts `declared_defaults` into its ConfigStore,
and each conf/<group>/<option>.yaml pulls them in with `- /<group>_<option>_defaults@_here_`), so a yaml holds
only what its option does differently, and the values pydantic cannot hold: interpolations (`${...}`) and `???`
(a value the user must give). A field without a default is one of those. tests/test_defaults_once.py checks it.
A group's models form a union told apart by their `name`, `kind` or `source`. The estimators' and the
probe's options are declared once, in klbench.estimators.options and klbench.probe.config, and the models
here extend them. What no single group can tell, the rules across groups, is the code after `validate`.
"""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Annotated, Any, Literal, Optional, Union, get_args

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, TypeAdapter, ValidationError, create_model

from klbench.config.errors import ConfigError  # noqa: F401  (raised here, and imported from here by callers)
from klbench.config.explain import explain
from klbench.estimators.options import (ADVANTAGES, GROUP_ADVANTAGES, LOSS_AGGS, REPORTED_VALUES,
                                        ControlVariateOptions, Expect, InLossOptions, InRewardOptions,
                                        LibraryOptions, Options, TopKTailOptions, TopKTruncOptions, VOPDOptions,
                                        corrects_off_policy, setting_task)
from klbench.estimators.targets import KL_TARGETS, is_plain, truncated_model_target, truncates
from klbench.models import ATTN_IMPLEMENTATIONS, DTYPES
from klbench.models.pair_rules import check_kinds, check_tabular_pair, context_refusal
from klbench.rewards.answer import EXTRACTS
from klbench.data.jsonl import read_prompts, read_rows
from klbench.probe.config import ProbeOptions, StepProbeOptions

Str = Annotated[str, Field(min_length=1)]
PosInt = Annotated[int, Field(ge=1)]


def _check(ok) -> AfterValidator:
    """A custom check of a value: ok(value) -> bool. The field's Expect says what the value must be."""
    def run(value):
        if not ok(value):
            raise ValueError("invalid")
        return value
    return AfterValidator(run)


# ---- task ----

# the probe block of rl/distill: its fields' types (and StepProbeOptions' defaults) always; grad_samples <=
# samples only where task.probe_every uses it (_check_probe_every), since task.probe.grad_samples follows
# task.n_samples
_ProbeFields = create_model("ProbeFields", __base__=Options,
                            **{k: (f.annotation, f) for k, f in StepProbeOptions.model_fields.items()})


# how rollouts sample and which KL the run regularises: klbench/estimators/sampling.py (Sampling), with the names
# and rules of klbench/estimators/targets.py, which this module reads without torch
TEMPERATURE = ("a finite number > 0 (temperature 0, greedy decoding, is refused for training: it samples a point "
               "mass, on which no KL estimator is defined)")


class SamplingFields(Options):
    """task.temperature, top_k, top_p and kl_target: of rl, distill (training and validation) and probe.

    The sampler pi_s: generate()'s temperature, top_k, top_p; temperature > 0 (greedy is a point mass: no estimator
    is defined on it); top_k 0 and top_p 1 cut nothing. kl_target, which KL the run regularises and measures
    (docs/sampling.md): sampler = KL(pi_s || pi_ref,T), the sampler against the reference at its temperature;
    model = KL(pi || pi_ref), pi_s a behaviour policy (off-policy estimators, no truncation); tempered =
    KL(pi_T || pi_ref,T) over the full vocabulary (TRL, verl); tempered_vs_raw = KL(pi_T || pi_ref) (tinker #689)."""
    temperature: Annotated[float, Field(gt=0, allow_inf_nan=False), Expect(TEMPERATURE)] = 1.0
    top_k: Annotated[int, Field(ge=0), Expect("an integer >= 0 (0: no top-k cut)")] = 0
    top_p: Annotated[float, Field(gt=0, le=1), Expect("a number in (0, 1] (1: no top-p cut)")] = 1.0
    kl_target: Literal[tuple(KL_TARGETS)] = "sampler"


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


# ---- model (and teacher) ----

class EmbeddedSpec(Options):
    """Overrides of the preset's spec (the keys of klbench.models.embedded.spec's presets): null keeps the preset's
    value; any other value overrides it (and changes the cache key)."""
    name: Annotated[Optional[str], Field(pattern=r"^[A-Za-z0-9_.-]+$"),
                    Expect("null or a cache directory name: letters, digits, _ . -")] = None
    corpus_size: Optional[int] = Field(None, ge=1)  # generated reviews to pretrain on
    corpus_seed: Optional[int] = None
    positive_fraction: Optional[float] = Field(None, ge=0, le=1)  # the review presets'
    # preset arith's (klbench/models/embedded/arith.py): the share of worked answers with one slip
    noise_fraction: Optional[float] = Field(None, ge=0, le=1)
    digits: Optional[int] = Field(None, ge=2)  # preset arith's: operands of 2 to `digits` digits
    vocab_size: Optional[int] = Field(None, ge=1)  # byte-level BPE size; models with one vocab_size share one tokenizer
    n_embd: Optional[int] = Field(None, ge=1)
    n_layer: Optional[int] = Field(None, ge=1)
    n_head: Optional[int] = Field(None, ge=1)
    n_positions: Optional[int] = Field(None, ge=1)
    steps: Optional[int] = Field(None, ge=1)  # pretraining steps
    batch_size: Optional[int] = Field(None, ge=1)
    lr: Optional[float] = Field(None, gt=0)
    seed: Optional[int] = None
    max_len: Optional[int] = Field(None, ge=1)  # tokens per pretraining review


DType = Literal[DTYPES]


class Lora(Options):
    """model.lora (peft, klbench/models/lora.py): the policy is an adapter on the frozen base, pi_ref the base with
    it off."""
    r: Optional[PosInt] = None  # rank; null: no LoRA, the whole model trains
    alpha: float = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)  # must stay 0: klbench scores with dropout off (docs/lora.md)
    # module names, e.g. [q_proj, v_proj]; null: peft's default for the architecture
    target_modules: Optional[list[Str]] = None


class _LanguageModel(Options):
    """What the embedded LM and any hf model share."""
    dtype: DType = "float32"
    lora: Lora = Lora()
    # null: the model's default (sdpa where supported, which the fused GPT-2 passes need); eager, sdpa,
    # flex_attention, flash_attention_2/3 (docs/instruct.md)
    attn_implementation: Optional[Literal[ATTN_IMPLEMENTATIONS]] = None
    # recompute each layer's activations in backward instead of keeping them (transformers', klbench.models.hf)
    gradient_checkpointing: bool = False


class ModelEmbedded(_LanguageModel):
    """The offline embedded reference: a small GPT-2 pretrained on generated movie reviews, cached by spec hash."""
    kind: Literal["embedded"]
    preset: Literal["reference", "teacher", "student", "arith"] = "reference"  # klbench/models/embedded/spec.py PRESETS
    spec: EmbeddedSpec = EmbeddedSpec()


class ModelHF(_LanguageModel):
    """Any AutoModelForCausalLM: a hub id (needs a hub or HF cache) or a local folder saved with save_pretrained.
    No defaults of their own: name_or_path is the user's (???), ref_name_or_path ${.name_or_path} (conf/model/hf.yaml),
    the frozen pi_ref, the policy's starting point unless given."""
    kind: Literal["hf"]
    name_or_path: Str
    ref_name_or_path: Str
    trust_remote_code: bool = False  # true runs the folder's own modelling code (auto_map in its config.json)
    # the folder's generation_config: its stop ids (eos_token_id, one id or a list) always end a response; its
    # sampling options (temperature, top_k, top_p) are used only with `follow`, else the run says it uses task.*'s
    # (klbench.models.policies.build_policy)
    generation_config: Literal["klbench", "follow"] = "klbench"


class ModelTabular(Options):
    """Enumerable autoregressive tabular model: exact KL, exact reward, exact Pareto frontier."""
    kind: Literal["tabular"]
    K: int = Field(4, ge=2)  # vocabulary size
    T: PosInt = 4  # horizon
    eos: Optional[int] = Field(0, ge=0)  # EOS token id, < K (_check_tabular_pair); null: every response has length T
    ref_seed: int = 0
    ref_scale: float = Field(1.0, ge=0)  # pi_ref logits ~ ref_scale * N(0, 1)


Model = Union[ModelEmbedded, ModelHF, ModelTabular]


# ---- dataset ----

class DatasetOptions(Options):
    """What every prompt source shares: instruct models' chat templates (klbench.data.chat, docs/instruct.md)."""
    chat_template: bool = False  # true: render each prompt with the tokenizer's chat template
    system_prompt: Optional[str] = None  # a system turn before each prompt; needs chat_template=true


class DatasetEmbedded(DatasetOptions):
    """Built-in review openings (train/val disjoint)."""
    source: Literal["embedded"]


class DatasetArith(DatasetOptions):
    """Generated arithmetic problems `a+b=` / `a-b=` (klbench/models/embedded/arith.py): unlimited training prompts,
    validation prompts from a held-out tenth of all problems; reward=answer computes each answer from its prompt."""
    source: Literal["arith"]
    digits: int = Field(2, ge=2)  # operands of 2 to `digits` digits (the arith preset is pretrained on 2)
    # training prompts generated (fresh problems; a run of 120 steps x 8 prompts uses 960)
    max_train: PosInt = 50000
    seed: int = 0


class _Answers(DatasetOptions):
    # reward=answer: the field (jsonl) or column (hf) holding each row's reference answer (GSM8K: answer)
    answer_field: Optional[Str] = None


class DatasetJsonl(_Answers):
    """One JSON object per line; `field` holds the prompt text. train_path and val_path are the user's (???)."""
    source: Literal["jsonl"]
    train_path: Str
    val_path: Str
    field: Str = "prompt"


class DatasetHF(_Answers):
    """An HF dataset (needs the `datasets` package and a hub or a local copy). Paper 001: IMDB review openings."""
    source: Literal["hf"]
    name: Str = "imdb"  # hub id, or a folder saved with Dataset(Dict).save_to_disk
    train_split: Str = "train"
    val_split: Str = "test"
    field: Str = "text"
    # keep the first words of each text as the prompt (null: whole texts; a messages field needs null)
    prompt_words: Optional[PosInt] = 8
    max_train: PosInt = 5000
    max_val: PosInt = 64


Dataset = Union[DatasetEmbedded, DatasetJsonl, DatasetHF, DatasetArith]


# ---- reward ----

class RewardVader(Options):
    """VADER compound sentiment in [-1, 1] (offline lexicon shipped in the wheel)."""
    kind: Literal["vader"]


class RewardTabular(Options):
    """A random reward table over the tabular model's sequences (needs model=tabular)."""
    kind: Literal["tabular"]
    seed: int = 1
    scale: float = 1.0


class RewardNone(Options):
    """No reward: pure KL minimisation (distillation)."""
    kind: Literal["none"]


class RewardHFClassifier(Options):
    """Any AutoModelForSequenceClassification; the reward is the raw logit (or probability) of `label`.
    name_or_path is the user's (???)."""
    kind: Literal["hf_classifier"]
    name_or_path: Str
    label: Union[Str, int] = "POSITIVE"  # a label name of the classifier's id2label, or its id
    score: Literal["logit", "prob"] = "logit"
    batch_size: PosInt = 32


def _regex_ok(v: Any) -> bool:
    try:
        re.compile(v)
    except (re.error, TypeError):
        return False
    return True


class RewardAnswer(Options):
    """A verifiable reward (klbench/rewards/answer.py): 1 where the response's final answer equals the prompt's
    reference answer (dataset.answer_field), else 0; plus format_reward where an answer could be extracted at all."""
    kind: Literal["answer"]
    # last_number | gsm8k (after ####) | boxed (\boxed{...}) | regex (reward.pattern)
    extract: Literal[EXTRACTS] = "last_number"
    # extract=regex: a Python regex; its first group (or the whole match) is the answer
    pattern: Annotated[Optional[str], _check(lambda v: v is None or _regex_ok(v)),
                       Expect("null or a Python regular expression (its first group, if any, is the answer)")] = None
    format_reward: float = 0.0
    # a sweep's objective and the frontier's reward axis: val/accuracy | val/reward (with the format reward)
    axis: Literal["val/accuracy", "val/reward"] = "val/accuracy"


Reward = Union[RewardVader, RewardTabular, RewardNone, RewardHFClassifier, RewardAnswer]


# ---- hardware: the Lightning Trainer's arguments ----

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _devices_ok(v: Any) -> bool:
    if isinstance(v, list):
        return bool(v) and all(_is_int(d) and d >= 0 for d in v)
    return v == "auto" or (_is_int(v) and (v >= 1 or v == -1))


def _no_float(v: Any) -> Any:
    if isinstance(v, float):  # a Literal takes 16.0 for 16
        raise ValueError("a float")
    return v


class Hardware(Options):
    """The defaults are hardware=cpu's: one process on the CPU in float32."""
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps", "tpu"] = "cpu"
    devices: Annotated[Any, _check(_devices_ok),
                       Expect("a positive integer, -1 (all), 'auto' or a list of device indices")] = 1
    strategy: Str = "auto"  # Lightning's strategy registry is open-ended: Lightning checks the name
    precision: Annotated[Literal[64, 32, 16, "64", "32", "16", "bf16", "64-true", "32-true", "16-true", "16-mixed",
                                 "bf16-true", "bf16-mixed", "transformer-engine", "transformer-engine-float16"],
                         BeforeValidator(_no_float)] = "32-true"
    num_nodes: PosInt = 1


# ---- logger ----

class LoggerMlflow(Options):
    """MLflow tracking, into the store the `store` group names (local: SQLite in outputs/, server: an mlflow
    server). tracking_uri and artifact_root have no defaults here: conf/logger/mlflow.yaml takes them from store.*."""
    kind: Literal["mlflow"]
    experiment: Str = "klbench"
    tracking_uri: Str
    artifact_root: Optional[Str]  # None: the tracking server's artifact store
    run_name: Optional[Str] = None  # None: a readable name from task, estimator, beta and seed
    parent_run_id: Optional[Str] = None  # set by sweeps: trial runs become children of the sweep's run


class LoggerCSV(Options):
    kind: Literal["csv"]
    # experiments and sweeps name their MLflow experiment (sweeps a parent run too) whatever the logger, and
    # `logger=csv experiment=...` must still work: accepted, unused (exclude: no key of the composed config)
    experiment: Optional[Str] = Field(None, exclude=True)
    tracking_uri: Optional[Str] = Field(None, exclude=True)
    artifact_root: Optional[Str] = Field(None, exclude=True)
    run_name: Optional[Str] = Field(None, exclude=True)
    parent_run_id: Optional[Str] = Field(None, exclude=True)


class LoggerNone(LoggerCSV):
    kind: Literal["none"]


Logger = Union[LoggerMlflow, LoggerCSV, LoggerNone]


# ---- store ----

class StoreLocal(Options):
    """Every key is an interpolation into the outputs folder: conf/store/local.yaml declares them."""
    kind: Literal["local"]
    mlflow: Str
    artifacts: Str
    optuna: Str


OPTUNA_URL = ("an SQLAlchemy database URL, e.g. postgresql+psycopg://user@host/db with the password in "
              "~/.pgpass or $PGPASSWORD (store.optuna=... or $KLBENCH_OPTUNA_STORAGE)")


class StoreServer(Options):
    kind: Literal["server"]
    mlflow: Annotated[str, Field(pattern=r"^https?://.+$"),
                      Expect("the URL of an `mlflow server`, http(s)://host:port (store.mlflow=... or "
                             "$KLBENCH_MLFLOW_URI)")]
    # only a sweep opens the Optuna study, so only a sweep needs it (klbench.sweep.study.prepare_study); no default
    # here: conf/store/server.yaml reads $KLBENCH_OPTUNA_STORAGE (null without it)
    optuna: Annotated[Optional[str], Field(pattern=r"^[a-z0-9]+(\+[a-z0-9]+)?://.+$"), Expect(OPTUNA_URL)]
    artifacts: Optional[Str] = None  # null: the server stores them (its --artifacts-destination)


Store = Union[StoreLocal, StoreServer]


# ---- top level ----

CONFIG_KEY = r"[A-Za-z_][\w-]*(\.[\w-]+)*"


def _allow_changes_ok(v: Any) -> bool:
    return all(k == "*" or re.fullmatch(CONFIG_KEY, k) for k in v)


class TopLevel(Options):
    seed: int = Field(ge=0, le=2**32 - 1)  # the bounds of Lightning's seed_everything
    ckpt_path: Optional[Str] = None  # `last` or a .ckpt path; resume.resolve_ckpt checks that it exists
    ckpt_allow_changes: Annotated[list[str], _check(_allow_changes_ok),
                                  Expect("a list of config keys (e.g. [task.max_steps]) or [*]")] = []


# group -> (its options, the key that tells them apart; hardware has one option)
GROUPS: dict[str, tuple[Any, Optional[str]]] = {
    "task": (Task, "name"), "estimator": (EstimatorOption, "name"), "kl_ctl": (KLCtl, "name"),
    "model": (Model, "kind"), "teacher": (Model, "kind"), "dataset": (Dataset, "source"),
    "reward": (Reward, "kind"), "hardware": (Hardware, None), "logger": (Logger, "kind"), "store": (Store, "kind")}
# not checked: paths are interpolations, only the sweeper reads optimized_metrics, `hydra` is Hydra's own
OTHER_KEYS = ("optimized_metrics", "paths", "hydra")


# ---- the defaults Hydra composes from (klbench.config.resolvers.register) ----

def option_models() -> dict[str, tuple[type[BaseModel], dict]]:
    """Every option model and its tag ({"name": "rl"}; {} for the group of one model), by the name of the
    ConfigStore node of its declared defaults: `<group>_<tag>_defaults` (`task_rl_defaults`), `hardware_defaults`.
    model@teacher composes from model's."""
    out = {}
    for group, (options, disc) in GROUPS.items():
        if group == "teacher":
            continue
        for tag, model in (_tags(options, disc).items() if disc else [(None, options)]):
            out[f"{group}_{tag}_defaults" if tag else f"{group}_defaults"] = (model, {disc: tag} if tag else {})
    return out


def declared_defaults(model: type[BaseModel], tag: dict | None = None) -> dict:
    """The node an option composes from: its tag first (`name: rl`), then every field in declaration order: its
    default, for a block without one the defaults of its fields, else ??? (what the yaml or the user gives: an
    interpolation, or a value only the user knows). A field with exclude=True is accepted and unused: no key."""
    out = dict(tag or {})
    for key, f in model.model_fields.items():
        block = next((a for a in (f.annotation, *get_args(f.annotation)) if isinstance(a, type) and
                      issubclass(a, BaseModel)), None)
        if key in out or f.exclude:
            continue
        if not f.is_required():
            value = f.get_default(call_default_factory=True)
            out[key] = value.model_dump() if isinstance(value, BaseModel) else value
        elif block is not None:
            out[key] = declared_defaults(block)
        else:
            out[key] = "???"
    return out


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value of `cfg` (a composed klbench config) that no run can use."""
    top = list(TopLevel.model_fields)
    unknown = [k for k in cfg.keys() if k not in (*top, *GROUPS, *OTHER_KEYS)]
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a klbench config key (top-level keys: "
                          f"{', '.join([*GROUPS, *top, *OTHER_KEYS])})")
    _validated(TopLevel, _plain(cfg, "", keys=[k for k in top if k in cfg.keys()]), "", "the config")
    task = _check_group(cfg, "task")
    model = _check_group(cfg, "model").kind
    if task.name == "pretrain":  # builds the embedded LM that `model` describes, and nothing else
        if model != "embedded":
            raise ConfigError(f"task=pretrain builds the embedded LMs: it needs model=embedded, got model.kind={model}")
        return
    est = _check_group(cfg, "estimator")
    kl_ctl = _check_group(cfg, "kl_ctl")
    teacher = None
    if cfg.get("teacher") is not None:
        # before the teacher's keys: model@teacher=embedded after experiment=distill_tabular leaves tabular keys
        # in it, and the mixed kinds are the mistake to report
        kind = OmegaConf.select(cfg, "teacher.kind")
        if kind in _tags(Model, "kind"):
            _as_config_error(check_kinds, model, kind)
        teacher = _check_group(cfg, "teacher").kind
        if teacher == "hf" and cfg.teacher.generation_config != "klbench":
            raise ConfigError("teacher.generation_config=follow: the teacher never samples (it is pi_ref), so its "
                              "generation_config's sampling options do not apply; the student's do "
                              "(model.generation_config)")
    ds = _check_group(cfg, "dataset")
    dataset = ds.source
    _check_chat(ds, model)
    reward = _check_group(cfg, "reward").kind
    _check_fsdp(cfg, _check_group(cfg, "hardware"), task, model)
    _check_group(cfg, "store")  # before logger: the logger's URIs come from it
    _check_group(cfg, "logger")
    if task.name == "probe":  # measures the estimators on a policy/reference pair: no training, no reward
        _check_sampling(task, None, None)
        _check_tabular_pair(cfg, teacher)
        _check_context(cfg)
        if dataset == "jsonl":
            _check_jsonl(cfg.dataset, 1)
        return
    _check_combination(cfg, task, est, model, teacher, reward)
    _check_sampling(task, est, kl_ctl.name)
    _check_objectives(cfg, reward)
    _check_context(cfg)
    _check_probe_every(task)
    _check_kl_ctl(task, kl_ctl)
    if dataset == "jsonl":  # last: the only check that reads files
        # the tabular model ignores the prompts (build_data): only the files' format matters then
        _check_jsonl(cfg.dataset, 1 if model == "tabular" else task.prompts_per_step)


# ---- rules across groups: each group alone is already valid ----

def _check_fsdp(cfg: DictConfig, hw: Hardware, task, model: str) -> None:
    """hardware=fsdp (klbench/tasks/sharding.py): what it cannot shard or split, in one line. The devices against
    the machine's are checked with torch (klbench.tasks.sharding.check_devices)."""
    if hw.strategy != "fsdp2":
        return
    if model == "tabular":
        raise ConfigError("hardware=fsdp shards a language model's decoder layers, and model=tabular is a table of "
                          "logits: use hardware=cpu or hardware=ddp")
    if task.name not in ("rl", "distill"):
        raise ConfigError(f"hardware=fsdp shards a training run (task=rl or task=distill), got task={task.name}")
    if task.probe_every:  # the probe runs on rank 0 alone, and a sharded forward needs every rank
        raise ConfigError(f"task.probe_every={task.probe_every} probes on one rank, and hardware=fsdp's models need "
                          "every rank for a forward: drop it (task.probe_every=null) or probe a checkpoint with task=probe")
    if not (_is_int(hw.devices) and hw.devices >= 1 or isinstance(hw.devices, list)):
        raise ConfigError(f"hardware=fsdp needs hardware.devices as a number of ranks, got {hw.devices}")
    world = (len(hw.devices) if isinstance(hw.devices, list) else hw.devices) * hw.num_nodes
    n = task.prompts_per_step
    if n % world:
        raise ConfigError(f"hardware=fsdp splits task.prompts_per_step={n} (the global batch) over hardware.devices x "
                          f"hardware.num_nodes = {world} ranks, which does not divide it: choose a multiple of {world}")


def _check_combination(cfg: DictConfig, t: TaskRL, e: BaseModel, model: str, teacher: str | None,
                       reward: str) -> None:
    """t, e: the validated task and estimator (their defaults filled in)."""
    task, beta = t.name, e.beta
    if task == "distill":
        if teacher is None:
            raise ConfigError("task=distill needs a teacher: add model@teacher=<option> (or use experiment=distill)")
        if beta != 1:
            raise ConfigError(f"task=distill minimises KL(student || teacher) itself: estimator.beta must be 1, "
                              f"got {beta} (weight an extra reward with task.reward_coef instead)")
        if t.reward_coef != 0 and reward == "none":
            raise ConfigError(f"task.reward_coef={t.reward_coef} needs a reward, but reward=none")
    elif teacher is not None:
        raise ConfigError(f"a teacher (model@teacher) only applies to task=distill (and task=probe), not task={task}")
    if teacher is not None and OmegaConf.select(cfg, "teacher.lora.r") is not None:
        raise ConfigError(f"teacher.lora.r={cfg.teacher.lora.r}: the teacher is the frozen pi_ref and does not "
                          "train; LoRA is the student's option (model.lora.r)")
    if e.name == "library" and setting_task(e.setting) != task:
        kind = "an on-policy distillation loss" if setting_task(e.setting) == "distill" else "an RL KL penalty"
        raise ConfigError(f"estimator.setting={e.setting} is {kind}: it belongs to task={setting_task(e.setting)}, "
                          f"not task={task} (`klbench-audit --all` lists each task's settings)")
    _check_tabular_pair(cfg, teacher)
    n = t.n_samples
    _check_micro_batch(cfg, t, e, model)
    _check_placement(t, e, OmegaConf.select(cfg, "kl_ctl.name"))
    if e.name == "loo" and n < 2:
        raise ConfigError(f"estimator loo needs task.n_samples >= 2 (samples per prompt), got {n}")
    _check_reward_term(t, e, reward)
    if model == "tabular" and reward not in ("tabular", "none"):
        raise ConfigError(f"model=tabular needs reward=tabular or reward=none (got reward.kind={reward})")
    if reward == "tabular" and model != "tabular":
        raise ConfigError(f"reward=tabular needs model=tabular (got model.kind={model})")
    if reward == "answer":
        _check_answer(cfg)
    elif cfg.dataset.get("answer_field") is not None:
        raise ConfigError(f"dataset.answer_field={cfg.dataset.answer_field} is read by reward=answer only, got "
                          f"reward={reward}: drop it (dataset.answer_field=null) or use reward=answer")


def _check_micro_batch(cfg: DictConfig, t: TaskRL, e: BaseModel, model: str) -> None:
    """task.micro_batch_size scores a language model's batch in parts (LMPolicy.score); model.gradient_checkpointing
    recomputes the policy's layers. Neither has anything to do elsewhere, and neither is ignored silently."""
    if OmegaConf.select(cfg, "teacher.gradient_checkpointing"):
        raise ConfigError("teacher.gradient_checkpointing=true: the teacher is the frozen pi_ref and computes no "
                          "gradient; checkpointing is the student's option (model.gradient_checkpointing)")
    m = t.micro_batch_size
    if m is None:
        return
    if model == "tabular":
        raise ConfigError(f"task.micro_batch_size={m}: the tabular model scores a batch by table lookup, with no "
                          "activations to save; it applies to language models (model=embedded or model=hf)")
    n = t.prompts_per_step * t.n_samples
    if m > n:
        raise ConfigError(f"task.micro_batch_size={m} is larger than a step's batch of task.prompts_per_step x "
                          f"task.n_samples = {n} sequences: choose at most {n}, or null to score the batch at once")
    if e.name in ("topk_tail", "topk_trunc"):
        raise ConfigError(f"estimator={e.name} reads the full [B, T, V] logits, which task.micro_batch_size={m} "
                          "never holds for the whole batch: drop task.micro_batch_size (null) or use rb, vopd, seq, "
                          "loo, ...")


def _check_answer(cfg: DictConfig) -> None:
    """reward=answer: reference answers from the dataset, and a pattern exactly where extract=regex reads one."""
    r, ds = cfg.reward, cfg.dataset
    if (r.extract == "regex") != (r.get("pattern") is not None):
        raise ConfigError(f"reward.pattern is read by reward.extract=regex only, and regex needs one: got "
                          f"reward.extract={r.extract}, reward.pattern={r.get('pattern')!r}")
    if ds.source == "embedded":
        raise ConfigError("reward=answer needs prompts with reference answers: dataset=embedded (review openings) has "
                          "none; use dataset=jsonl or dataset=hf with dataset.answer_field=<field>, or experiment=arith")
    if ds.source in ("jsonl", "hf") and ds.get("answer_field") is None:
        raise ConfigError(f"reward=answer needs dataset.answer_field: the {'field' if ds.source == 'jsonl' else 'column'}"
                          f" of dataset={ds.source} holding each prompt's reference answer")


def _check_objectives(cfg: DictConfig, reward: str) -> None:
    """optimized_metrics: what a training run returns to the sweeper and the frontier's axes (reward, KL)."""
    om = cfg.get("optimized_metrics")
    om = list(om) if om is not None else ["val/reward", "val/seq_kl"]
    rewards = ("val/reward", "val/accuracy") if reward == "answer" else ("val/reward",)
    if len(om) != 2 or om[0] not in rewards or om[1] != "val/seq_kl":
        raise ConfigError(f"optimized_metrics must be [<reward metric>, val/seq_kl] with the reward metric one of "
                          f"{', '.join(rewards)} (val/accuracy needs reward=answer); got {om}")


def _check_reward_term(t: TaskRL, e: BaseModel, reward: str) -> None:
    """task.advantage and task.loss_agg shape the reward term (klbench/estimators/advantages.py): a group needs
    n >= 2 samples per prompt, and without a reward term (and no KL put into it) they would be ignored."""
    n, adv = t.n_samples, t.advantage
    before = e.name == "in_reward" and e.kl_norm == "before"
    has_term = before or (reward != "none" and t.reward_coef != 0)
    if adv == "rloo" and has_term and n < 2:
        raise ConfigError(f"the RLOO reward baseline needs task.n_samples >= 2, got {n}")
    if adv in GROUP_ADVANTAGES and adv != "rloo" and n < 2:
        raise ConfigError(f"task.advantage={adv} normalises over the samples of a prompt, but task.n_samples={n} "
                          "gives no group: set task.n_samples >= 2 (or task.advantage=reinforce)")
    if adv == "reinforce" and has_term and n * t.prompts_per_step < 2:
        raise ConfigError("task.advantage=reinforce subtracts the batch mean, which needs at least 2 sequences per "
                          f"step, got task.prompts_per_step x task.n_samples = {t.prompts_per_step * n}")
    if not has_term and (adv != "rloo" or t.loss_agg != "seq_sum"):
        why = "reward=none" if reward == "none" else "task.reward_coef=0"
        raise ConfigError(f"task.advantage={adv} and task.loss_agg={t.loss_agg} shape the reward term, but {why} "
                          "leaves none (and no KL enters it): leave them at rloo and seq_sum")
    if before and (e.form, e.baseline, e.max_weight) != ("sequence", "none", None):
        raise ConfigError("estimator.kl_norm=before puts the sequence KL into the sequence reward, whose advantage is "
                          "its baseline: it needs estimator.form=sequence, estimator.baseline=none and "
                          f"estimator.max_weight=null; got {e.form}, {e.baseline}, {e.max_weight}")


def _check_chat(ds: SimpleNamespace, model: str) -> None:
    """A system prompt is a chat turn; the tabular model has no prompts to render."""
    if ds.system_prompt is not None and not ds.chat_template:
        raise ConfigError("dataset.system_prompt is set, but dataset.chat_template=false: a system prompt is a turn "
                          "of the chat template; set dataset.chat_template=true")
    if ds.chat_template and model == "tabular":
        raise ConfigError("dataset.chat_template=true does nothing with model=tabular, which ignores prompts: set "
                          "dataset.chat_template=false")


def _check_sampling(t: SamplingFields, e: BaseModel | None, ctl: str | None) -> None:
    """The KL target against the sampling (klbench.estimators.sampling.check_target says the same with torch) and,
    for training, against the estimator: kl_target=model samples from a behaviour policy pi_s."""
    if t.kl_target != "model" or is_plain(t.temperature, t.top_k, t.top_p):
        return
    if truncates(t.top_k, t.top_p):
        cut = ", ".join([f"task.top_k={t.top_k}"] * (t.top_k > 0) + [f"task.top_p={t.top_p}"] * (t.top_p < 1))
        raise ConfigError(truncated_model_target(cut))
    if e is None:  # task=probe: its value estimators need y ~ pi, and its rollouts would be pi_s's
        raise ConfigError(f"task=probe with task.kl_target=model and task.temperature={t.temperature}: the probe "
                          "measures the estimators on its own rollouts, which would come from the tempered sampler "
                          "pi_s, not pi; probe task.kl_target=sampler, or the model's KL at task.temperature=1")
    if not corrects_off_policy(e.name, getattr(e, "ratio", None)):
        raise ConfigError(f"task.kl_target=model with task.temperature={t.temperature} takes samples from the "
                          f"tempered sampler pi_s, a behaviour policy, but estimator {e.name}"
                          + (" with ratio=none" if e.name == "in_loss" else "") + " assumes y ~ pi: use an "
                          "off-policy estimator (estimator=rb, in_reward, or in_loss with estimator.ratio=token|"
                          "sequence), or task.kl_target=sampler")
    if t.probe_every is not None:
        raise ConfigError(f"task.probe_every={t.probe_every} with task.kl_target=model and task.temperature="
                          f"{t.temperature}: the probe measures the estimators on y ~ pi, and this run's rollouts "
                          "come from the tempered sampler pi_s; set task.probe_every=null or task.kl_target=sampler")
    if ctl not in (None, "fixed"):
        raise ConfigError(f"kl_ctl={ctl} with task.kl_target=model and task.temperature={t.temperature} is not "
                          "supported: the controller's KL signal is a value estimate, which needs y ~ pi; use "
                          "kl_ctl=fixed or task.kl_target=sampler")


def check_followed_sampling(cfg: DictConfig, temperature: float, top_k: int, top_p: float) -> None:
    """The task's sampling rules again for the sampling a model's generation_config chose instead of task.*'s
    (model.generation_config=follow: known once the model is loaded)."""
    task = cfg.task
    t = SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, kl_target=task.kl_target,
                        probe_every=task.get("probe_every"))
    training = task.name != "probe"
    try:
        _check_sampling(t, _check_group(cfg, "estimator") if training else None,
                        OmegaConf.select(cfg, "kl_ctl.name") if training else None)
    except ConfigError as e:
        raise ConfigError(f"model.generation_config=follow samples with the folder's temperature={temperature:g}, "
                          f"top_k={top_k}, top_p={top_p:g}: {e}") from None


def _check_tabular_pair(cfg: DictConfig, teacher: str | None) -> None:
    """A tabular model's EOS is one of its tokens, and a tabular teacher shares the student's vocabulary."""
    for who in ("model", "teacher"):
        m = cfg.get(who)
        if m is not None and m.kind == "tabular" and m.eos is not None and m.eos >= m.K:
            raise ConfigError(f"{who}.eos must be a token id in [0, {who}.K={m.K}), got {m.eos}")
    if teacher == "tabular":
        _as_config_error(check_tabular_pair, cfg.model, cfg.teacher)


def _as_config_error(check, *args) -> None:
    """A rule the builders check too (klbench.models.pair_rules), its ValueError told as a bad config."""
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_kl_ctl(t: TaskRL, c: BaseModel) -> None:
    if c.name != "adaptive":
        return
    if t.name == "distill":
        raise ConfigError("task=distill minimises KL(student || teacher) itself: beta stays fixed at 1, so "
                          "kl_ctl must be fixed, got kl_ctl=adaptive")
    if c.init_beta > BETA_MAX:  # KLCtlAdaptive checks > 0; the bound is estimator.beta's (BETA_MAX)
        raise ConfigError(f"kl_ctl.init_beta must be <= {BETA_MAX:g}, like estimator.beta, got {c.init_beta!r}")
    n = t.prompts_per_step * t.n_samples  # sequences per step (per process)
    if c.horizon_unit == "steps" and c.clip >= c.horizon:
        raise ConfigError(f"kl_ctl.horizon={c.horizon} (steps) must exceed kl_ctl.clip={c.clip}: a step could "
                          "otherwise drive beta to 0")
    if c.horizon_unit == "sequences" and c.clip * n >= c.horizon:
        raise ConfigError(f"kl_ctl.horizon={c.horizon} must exceed kl_ctl.clip x sequences per step = "
                          f"{c.clip} x {n}: a step could otherwise drive beta to 0")
    if c.signal == "cv_opt" and n < 2:
        raise ConfigError("kl_ctl.signal=cv_opt fits its multiplier on the step's samples and needs at least "
                          f"2 sequences per step, got task.prompts_per_step x task.n_samples = {n}")


def _check_context(cfg: DictConfig) -> None:
    """An embedded LM's context holds the prompt and the response: task.max_new_tokens must leave room for a
    prompt. (An hf model's context is known once its config is loaded: klbench.models.policies.build_policy; the
    prompts' lengths once they are tokenized: klbench.data.prompts.check_prompt_lengths.)"""
    from klbench.models.embedded.spec import preset_spec  # plain Python, like this module
    m = cfg.task.max_new_tokens
    for who in ("model", "teacher"):
        spec = cfg.get(who)
        if spec is None or spec.kind != "embedded":
            continue
        n = preset_spec(spec.preset, spec.spec)["n_positions"]
        if m >= n:
            raise ConfigError(context_refusal(m, f"embedded {who} (preset {spec.preset})",
                                              f"its {who}.spec.n_positions", n))


def _check_probe_every(t: TaskRL) -> None:
    every = t.probe_every
    if every is None:
        return
    if every % t.val_every != 0:
        raise ConfigError(f"task.probe_every={every} must be a multiple of task.val_every={t.val_every}: the probe "
                          "runs at validations")
    if t.probe is None:
        raise ConfigError("task.probe_every is set but task.probe (the probe's options) is missing")
    _validated(ProbeOptions, t.probe, "task.probe", "task.probe")


def _check_placement(t: TaskRL, e: BaseModel, ctl: str | None) -> None:
    """in_reward / in_loss option combinations (klbench.estimators.placement checks the same with torch), and
    what task.inner_steps > 1 needs: an estimator that corrects for pi_old, rollout-aligned checkpoints."""
    est = e.name
    if est in ("in_reward", "in_loss"):
        if e.value != "cv" and (e.lam != 1.0 or e.level != "token"):
            raise ConfigError(f"estimator.lam and estimator.level apply to estimator.value=cv only, got "
                              f"value={e.value} with lam={e.lam}, level={e.level}")
        per_token = not (e.value == "cv" and e.level == "sequence")
        if est == "in_reward" and e.form == "reward_to_go" and not per_token:
            raise ConfigError("estimator.form=reward_to_go needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "token" and not per_token:
            raise ConfigError("estimator.ratio=token needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "none" and (e.ratio_grad != "detached" or e.max_weight is not None):
            raise ConfigError("estimator.ratio=none has no ratio: ratio_grad must be detached and max_weight null")
        if est == "in_reward" and e.baseline == "loo" and t.n_samples < 2:
            raise ConfigError(f"estimator.baseline=loo needs task.n_samples >= 2, got {t.n_samples}")
    k = t.inner_steps
    if k > 1:
        if not corrects_off_policy(est, getattr(e, "ratio", None)):
            raise ConfigError(f"task.inner_steps={k} trains on samples from the rollout's policy pi_old, but estimator "
                              f"{est}" + (" with ratio=none" if est == "in_loss" else "") + " assumes y ~ pi: use "
                              "estimator=rb, in_reward, or in_loss with estimator.ratio=token|sequence")
        for key in ("val_every", "max_steps"):  # checkpoints (made at validations and the end) start a rollout
            if getattr(t, key) % k:
                raise ConfigError(f"task.{key}={getattr(t, key)} must be a multiple of task.inner_steps={k}, so that "
                                  "every checkpoint falls on a rollout boundary and a resume repeats the run exactly")
        if ctl not in (None, "fixed"):  # its signal is a value estimate, which needs on-policy samples
            raise ConfigError(f"kl_ctl={ctl} with task.inner_steps={k} is not supported: the controller's KL signal "
                              "assumes y ~ pi; use kl_ctl=fixed")


def _check_jsonl(ds: DictConfig, min_train: int) -> None:
    for key in ("train_path", "val_path"):
        try:
            prompts = [p for p, _ in read_rows(ds[key], ds.field, ds.get("answer_field"),
                                               ds.chat_template)]
        except (OSError, ValueError) as e:
            raise ConfigError(f"dataset.{key}: {e}") from None
        if key == "train_path" and len(prompts) < min_train:
            raise ConfigError(f"dataset.train_path: {ds[key]} holds {len(prompts)} prompts, fewer than one step's "
                              f"task.prompts_per_step={min_train}")


# ---- each group checked by its pydantic models; the errors told as klbench's (klbench.config.explain) ----

_ADAPTERS: dict[str, TypeAdapter] = {}


def _check_group(cfg: DictConfig, group: str) -> SimpleNamespace:
    """Check cfg[group] against the option its discriminator picks. Returns its values as given (a 5 stays
    5 in a message, where the model has 5.0), with the model's defaults for the keys left out."""
    options, disc = GROUPS[group]
    tags = _tags(options, disc)
    if group not in cfg.keys():
        raise ConfigError(f"{group} is missing" + (f": choose {group}=<{'|'.join(tags)}>" if disc else ""))
    if OmegaConf.is_missing(cfg, group):
        raise ConfigError(f"{group} is mandatory (???): choose {group}=<{'|'.join(tags)}>")
    node = cfg[group]
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{group} must be a config group (a mapping), got {node!r}")
    data = _plain(node, group)
    tag = data.get(disc) if disc else None
    if disc and (not isinstance(tag, str) or tag not in tags):
        raise ConfigError(f"{group}.{disc}={tag!r} is unknown; valid: {', '.join(tags)}")
    if disc and group not in _ADAPTERS:
        _ADAPTERS[group] = TypeAdapter(Annotated[options, Field(discriminator=disc)])
    try:
        checked = _ADAPTERS[group].validate_python(data) if disc else options.model_validate(data)
    except ValidationError as e:
        what = f"{group} {tag!r}" if disc else group
        raise ConfigError(explain(e.errors()[0], tags[tag] if disc else options, data, group, what, tag, disc)) \
            from None
    # the values as given, but a string as validated: an old name (estimator.kl_norm=fused) by its new one
    return SimpleNamespace(**{**checked.model_dump(), **{k: v for k, v in data.items() if not isinstance(v, str)}})


def _validated(model: type[BaseModel], data: dict, path: str, what: str) -> None:
    try:
        model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(explain(e.errors()[0], model, data, path, what)) from None


def _tags(options: Any, disc: str | None) -> dict[str, type[BaseModel]]:
    """discriminator value -> model, in the union's order."""
    if disc is None:
        return {}
    return {tag: m for m in get_args(options) for tag in get_args(m.model_fields[disc].annotation)}


def _plain(node: DictConfig, path: str, keys=None) -> dict:
    """The node as plain Python values, interpolations resolved; a ??? or an unresolvable value is named."""
    out = {}
    for key in node.keys() if keys is None else keys:
        full = f"{path}.{key}" if path else str(key)
        if OmegaConf.is_missing(node, key):
            raise ConfigError(f"{full} is mandatory (???): set it, e.g. {full}=<value>")
        try:
            value = node[key]
        except OmegaConfBaseException as e:
            raise ConfigError(f"{full} cannot be resolved: {str(e).splitlines()[0]}") from None
        if isinstance(value, DictConfig):
            value = _plain(value, full)
        elif isinstance(value, ListConfig):
            value = OmegaConf.to_container(value, resolve=True)
        out[key] = value
    return out
