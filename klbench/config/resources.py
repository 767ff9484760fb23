"""The options of the groups that say what a run uses and where it records: model (and teacher), dataset, reward,
hardware, logger and store, one pydantic model per option (klbench.config.schema says how they are used). Every
default is declared here, once."""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BeforeValidator, Field

from klbench.estimators.options import Expect, Options
from klbench.models import ATTN_IMPLEMENTATIONS, DTYPES
from klbench.models.logits_budget import SIZE, size_bytes
from klbench.rewards.answer import EXTRACTS
from klbench.config.fields import PosInt, Str, _check

# ---- model (and teacher) ----

def _size_bytes(v: Any) -> Any:
    """A size as the config writes it (256MiB, 1.5GB, 4096), kept as written once it reads as > 0 bytes
    (klbench.models.logits_budget.size_bytes reads it where it is used)."""
    if size_bytes(v) is None:
        raise ValueError("not a positive size")
    return v


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
    # null: the model's default (sdpa where supported); eager, sdpa,
    # flex_attention, flash_attention_2/3 (docs/instruct.md)
    attn_implementation: Optional[Literal[ATTN_IMPLEMENTATIONS]] = None
    # recompute each layer's activations in backward instead of keeping them (transformers', klbench.models.hf)
    gradient_checkpointing: bool = False
    # the scoring path by its cost (klbench.models.lm_policy, docs/scale.md): the [m, L, V] logits where a micro-batch's
    # float32 logits (m rows x task.max_new_tokens x V x 4 bytes) fit this size, the hidden states above it
    logits_budget: Annotated[Any, BeforeValidator(_size_bytes), Expect(SIZE)] = "256MiB"
    # auto: by cost, the logits where the budget holds them and the LM head is at least 192 wide (narrower heads score
    # faster from the hidden states); logits, hidden: that path (refused where it cannot serve, e.g. hidden under a
    # top-k estimator)
    scoring_path: Literal["auto", "logits", "hidden"] = "auto"
    # what the LM head's matrix product runs in, on every path (scoring, rollouts): float32 keeps kappa and the
    # log-probs exact to float32 under bf16 (docs/scale.md, "The head's precision"); autocast: the model's own
    # dtype under hardware=bf16 (bf16), as TRL's head runs unless cast_lm_head_to_fp32
    head_dtype: Literal["float32", "autocast"] = "float32"


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
