"""The typed schema of a composed klbench config, checked before anything heavy is imported.

`validate(cfg)` raises ConfigError naming the field (and the valid options where that helps): a bad value
then fails in well under a second, instead of after torch, Lightning and MLflow are imported (7-22 s) with
another library's message. This module therefore imports only the stdlib and omegaconf (a test checks it).

Each option kind of each config group is a dataclass whose fields are the keys its yaml may hold; a field
with a default may be left out. Range constraints sit in the field's metadata (see `limits`).
"""
from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from klbench.config.errors import ConfigError  # noqa: F401  (raised here, and imported from here by callers)
from klbench.models.prompts_jsonl import read_prompts




def limits(default: Any = MISSING, **meta: Any) -> Any:
    """A schema field with constraints: ge / gt / le for numbers, pattern for strings, or check(value) -> bool
    with `expect` (what the message says the field must be) for values no type annotation describes."""
    return field(default=default, metadata=meta)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _devices_ok(v: Any) -> bool:
    if isinstance(v, list):
        return bool(v) and all(_is_int(d) and d >= 0 for d in v)
    return v == "auto" or (_is_int(v) and (v >= 1 or v == -1))


CONFIG_KEY = r"[A-Za-z_][\w-]*(\.[\w-]+)*"


def _allow_changes_ok(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(k, str) and (k == "*" or re.fullmatch(CONFIG_KEY, k)) for k in v)


# ---- task ----

@dataclass
class TaskRL:
    name: str
    n_samples: int = limits(ge=1)
    prompts_per_step: int = limits(ge=1)
    max_new_tokens: int = limits(ge=1)
    lr: float = limits(gt=0)
    weight_decay: float = limits(ge=0)
    max_steps: int = limits(ge=1)
    val_every: int = limits(ge=1)
    val_prompts: int = limits(ge=1)
    val_samples: int = limits(ge=1)
    val_seed: int
    log_every: int = limits(ge=1)
    reward_coef: float
    n_sample_texts: int = limits(ge=0)
    grad_clip: Optional[float] = limits(None, ge=0)  # train reads it with .get; null: no clipping
    # optimiser steps per rollout (GRPO num_iterations, PPO epochs): > 1 reuses each rollout off-policy
    inner_steps: int = limits(1, ge=1)
    clip_eps: float = limits(0.2, gt=0, le=1)  # PPO clip of the reward term's ratio (inner_steps > 1)
    # a small klbench.probe.measure at the validations whose step is a multiple of probe_every (null: never)
    probe_every: Optional[int] = limits(None, ge=1)
    probe: ProbeOptions = limits(None)


@dataclass
class TaskDistill(TaskRL):
    """rl's keys; the rules that make it distillation (teacher, beta = 1) are in _check_combination."""


@dataclass
class TaskPretrain:
    name: str
    force: bool


def _labels_ok(v: Any) -> bool:
    return v is None or (isinstance(v, list) and bool(v) and all(isinstance(s, str) and s for s in v))


@dataclass(kw_only=True)
class ProbeOptions:
    """klbench.probe.measure.ProbeConfig: the options of task=probe and of task.probe (rl, distill). Estimator labels
    are checked against the registries when the probe starts (they need torch)."""
    prompts: int = limits(ge=1)  # held-out prompts probed
    samples: int = limits(ge=1)  # M_max: samples per prompt per replicate (value estimators)
    grad_samples: int = limits(ge=1)  # samples per prompt in one per-batch gradient, <= samples
    replicates: int = limits(ge=2)  # R
    ref_batches: int = limits(ge=1)
    ref_samples: int = limits(ge=1)
    seed: int = limits(ge=0)
    bootstrap: int = limits(ge=1)
    ci_level: float = limits(check=lambda v: isinstance(v, float) and 0 < v < 1, expect="a number in (0, 1)")
    boot_dim: int = limits(ge=1)
    project_dim: Optional[int] = limits(None, ge=1)
    value_estimators: Any = limits(None, check=_labels_ok, expect="null or a non-empty list of estimator labels")
    gradient_estimators: Any = limits(None, check=_labels_ok, expect="null or a non-empty list of estimator labels")


@dataclass(kw_only=True)
class TaskProbe(ProbeOptions):
    name: str
    max_new_tokens: int = limits(ge=1)


TASKS = {"rl": TaskRL, "distill": TaskDistill, "pretrain": TaskPretrain, "probe": TaskProbe}


# ---- estimator: mirrors klbench.estimators' registry, which imports torch ----

# The largest KL coefficient a run accepts (estimator.beta, kl_ctl.init_beta). Past it the reward weighs
# next to nothing against beta x KL (task.reward_coef=0 trains on the KL alone), and a huge beta does not
# regularise harder: beta x KL and its gradient overflow (estimator.beta=1e308 trained with no KL gradient
# at all, as if beta were 0, and recorded inf losses).
BETA_MAX = 1e4
BETA_RANGE = (f"a finite number >= 0 and <= {BETA_MAX:g} (a larger one leaves the reward no weight; "
              "task.reward_coef=0 trains on the KL alone)")


@dataclass
class Estimator:
    name: str
    beta: float = limits(ge=0, le=BETA_MAX, expect=BETA_RANGE)


@dataclass
class EstimatorNaiveCV(Estimator):
    lam: float = 1.0
    level: Literal["token", "sequence"] = "token"
    clamp: Optional[float] = limits(None, gt=0)


PlacementValue = Literal["k1", "k2", "k3", "cv"]


@dataclass
class EstimatorInReward(Estimator):
    value: PlacementValue = "k1"
    lam: float = 1.0  # value=cv only
    level: Literal["token", "sequence"] = "token"  # value=cv only
    form: Literal["sequence", "reward_to_go"] = "sequence"
    baseline: Literal["none", "loo"] = "none"
    max_weight: Optional[float] = limits(None, gt=0)


@dataclass
class EstimatorInLoss(Estimator):
    value: PlacementValue = "k1"
    lam: float = 1.0  # value=cv only
    level: Literal["token", "sequence"] = "token"  # value=cv only
    ratio: Literal["none", "token", "sequence"] = "token"
    ratio_grad: Literal["detached", "differentiable"] = "detached"
    max_weight: Optional[float] = limits(None, gt=0)


ESTIMATORS = {"naive_mc": Estimator, "naive_cv": EstimatorNaiveCV, "token": Estimator, "seq": Estimator,
              "cumulative": Estimator, "loo": Estimator, "rb": Estimator,
              "in_reward": EstimatorInReward, "in_loss": EstimatorInLoss}
# estimators that correct for samples from pi_old (task.inner_steps > 1); in_loss only with a ratio
OFF_POLICY_ESTIMATORS = ("rb", "in_reward", "in_loss")
# GRADIENT_ESTIMATORS[name].defaults, without torch (tests/test_schema.py keeps the two equal)
ESTIMATOR_OPTIONS = {name: {f.name: f.default for f in fields(cls) if f.name not in ("name", "beta")}
                     for name, cls in ESTIMATORS.items()}


# ---- kl_ctl: mirrors klbench.tasks.kl_control (pure Python, but kept out of this module's imports) ----

@dataclass
class KLCtlFixed:
    name: str


KL_SIGNALS = Literal["mc", "k2", "k3", "cv_seq", "cv_opt", "rb"]  # klbench.tasks.kl_control.SIGNALS


@dataclass
class KLCtlAdaptive:
    name: str
    target: float = limits(gt=0)  # nats per sequence
    horizon: float = limits(gt=0)  # integral time, in horizon_unit
    init_beta: float = limits(gt=0)  # the update is multiplicative: 0 would stay 0
    clip: float = limits(0.4, gt=0)
    signal: KL_SIGNALS = "rb"
    kp: float = limits(1.0, ge=0)  # proportional gain on log beta
    horizon_unit: Literal["steps", "sequences"] = "steps"  # klbench.tasks.kl_control.HORIZON_UNITS


KL_CTLS = {"fixed": KLCtlFixed, "adaptive": KLCtlAdaptive}


# ---- model (and teacher) ----

@dataclass
class EmbeddedSpec:
    """Overrides of the preset's spec (the keys of klbench.models.embedded.spec's presets); null keeps the preset's."""
    name: Optional[str] = limits(None, pattern=r"[A-Za-z0-9_.-]+")  # a cache directory name
    corpus_size: Optional[int] = limits(None, ge=1)
    corpus_seed: Optional[int] = None
    positive_fraction: Optional[float] = limits(None, ge=0, le=1)
    vocab_size: Optional[int] = limits(None, ge=1)
    n_embd: Optional[int] = limits(None, ge=1)
    n_layer: Optional[int] = limits(None, ge=1)
    n_head: Optional[int] = limits(None, ge=1)
    n_positions: Optional[int] = limits(None, ge=1)
    steps: Optional[int] = limits(None, ge=1)
    batch_size: Optional[int] = limits(None, ge=1)
    lr: Optional[float] = limits(None, gt=0)
    seed: Optional[int] = None
    max_len: Optional[int] = limits(None, ge=1)


DTypes = Literal["float32", "bfloat16", "float16"]  # klbench.models.hf._DTYPES


@dataclass
class ModelEmbedded:
    kind: str
    preset: Literal["reference", "teacher", "student"]
    spec: EmbeddedSpec
    dtype: DTypes


@dataclass
class ModelHF:
    kind: str
    name_or_path: str
    ref_name_or_path: str
    dtype: DTypes


@dataclass
class ModelTabular:
    kind: str
    K: int = limits(ge=2)
    T: int = limits(ge=1)
    eos: Optional[int] = limits(ge=0)  # < K: checked in _check_combination
    ref_seed: int
    ref_scale: float = limits(ge=0)


MODELS = {"embedded": ModelEmbedded, "hf": ModelHF, "tabular": ModelTabular}


# ---- dataset ----

@dataclass
class DatasetEmbedded:
    source: str


@dataclass
class DatasetJsonl:
    source: str
    train_path: str
    val_path: str
    field: str


@dataclass
class DatasetHF:
    source: str
    name: str
    train_split: str
    val_split: str
    field: str
    prompt_words: int = limits(ge=1)
    max_train: int = limits(ge=1)
    max_val: int = limits(ge=1)


DATASETS = {"embedded": DatasetEmbedded, "jsonl": DatasetJsonl, "hf": DatasetHF}


# ---- reward ----

@dataclass
class RewardVader:
    kind: str


@dataclass
class RewardTabular:
    kind: str
    seed: int
    scale: float


@dataclass
class RewardNone:
    kind: str


@dataclass
class RewardHFClassifier:
    kind: str
    name_or_path: str
    label: Union[str, int]  # a label name of the classifier's id2label, or its id
    score: Literal["logit", "prob"]
    batch_size: int = limits(ge=1)


REWARDS = {"vader": RewardVader, "tabular": RewardTabular, "none": RewardNone, "hf_classifier": RewardHFClassifier}


# ---- hardware: the Lightning Trainer's arguments ----

@dataclass
class Hardware:
    accelerator: Literal["auto", "cpu", "gpu", "cuda", "mps", "tpu"]
    devices: Any = limits(check=_devices_ok, expect="a positive integer, -1 (all), 'auto' or a list of device indices")
    strategy: str  # Lightning's strategy registry is open-ended: Lightning checks the name
    precision: Literal[64, 32, 16, "64", "32", "16", "bf16", "64-true", "32-true", "16-true", "16-mixed", "bf16-true",
                       "bf16-mixed", "transformer-engine", "transformer-engine-float16"]
    num_nodes: int = limits(ge=1)


# ---- logger ----

@dataclass
class LoggerMlflow:
    kind: str
    experiment: str
    tracking_uri: str
    artifact_root: Optional[str]  # None: the tracking server's artifact store
    run_name: Optional[str] = None
    parent_run_id: Optional[str] = None


@dataclass
class LoggerCSV:
    kind: str
    # experiments and sweeps name their MLflow experiment (sweeps a parent run too) whatever the logger, and
    # `logger=csv experiment=...` must still work: accepted, unused
    experiment: Optional[str] = None
    tracking_uri: Optional[str] = None
    artifact_root: Optional[str] = None
    run_name: Optional[str] = None
    parent_run_id: Optional[str] = None


@dataclass
class LoggerNone(LoggerCSV):
    pass


LOGGERS = {"mlflow": LoggerMlflow, "csv": LoggerCSV, "none": LoggerNone}


# ---- store ----

@dataclass
class StoreLocal:
    kind: str
    mlflow: str
    artifacts: str
    optuna: str


OPTUNA_URL = ("an SQLAlchemy database URL, e.g. postgresql+psycopg://user@host/db with the password in "
              "~/.pgpass or $PGPASSWORD (store.optuna=... or $KLBENCH_OPTUNA_STORAGE)")


@dataclass
class StoreServer:
    kind: str
    mlflow: str = limits(pattern=r"https?://.+", expect="the URL of an `mlflow server`, http(s)://host:port "
                                                        "(store.mlflow=... or $KLBENCH_MLFLOW_URI)")
    # only a sweep opens the Optuna study, so only a sweep needs it (klbench.sweep.study.prepare_study)
    optuna: Optional[str] = limits(None, pattern=r"[a-z0-9]+(\+[a-z0-9]+)?://.+", expect=OPTUNA_URL)
    artifacts: Optional[str] = None


STORES = {"local": StoreLocal, "server": StoreServer}


# ---- top level ----

TOP_LEVEL = {
    "seed": (int, {"ge": 0, "le": 2**32 - 1}),  # the bounds of Lightning's seed_everything
    "ckpt_path": (Optional[str], {}),  # `last` or a .ckpt path; resume.resolve_ckpt checks that it exists
    "ckpt_allow_changes": (list, {"check": _allow_changes_ok,
                                  "expect": "a list of config keys (e.g. [task.max_steps]) or [*]"}),
}
GROUP_KEYS = ("task", "estimator", "kl_ctl", "model", "teacher", "dataset", "reward", "hardware", "logger",
              "store")
# not checked: paths are interpolations, only the sweeper reads optimized_metrics, `hydra` is Hydra's own
OTHER_KEYS = ("optimized_metrics", "paths", "hydra")


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value of `cfg` (a composed klbench config) that no run can use."""
    unknown = [k for k in cfg.keys() if k not in (*TOP_LEVEL, *GROUP_KEYS, *OTHER_KEYS)]
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a klbench config key (top-level keys: "
                          f"{', '.join([*GROUP_KEYS, *TOP_LEVEL, *OTHER_KEYS])})")
    if "seed" not in cfg.keys():
        raise ConfigError("seed is missing")
    for key, (typ, meta) in TOP_LEVEL.items():
        if key in cfg.keys():
            _check_value(key, _get(cfg, key, key), typ, meta)
    task = _check_group(cfg, "task", TASKS, "name")
    model = _check_group(cfg, "model", MODELS, "kind")
    if task == "pretrain":  # builds the embedded LM that `model` describes, and nothing else
        if model != "embedded":
            raise ConfigError(f"task=pretrain builds the embedded LMs: it needs model=embedded, got model.kind={model}")
        return
    est = _check_group(cfg, "estimator", ESTIMATORS, "name")
    kl_ctl = _check_group(cfg, "kl_ctl", KL_CTLS, "name")
    teacher = None
    if cfg.get("teacher") is not None:
        # before the teacher's keys: model@teacher=embedded after experiment=distill_tabular leaves tabular keys
        # in it, and the mixed kinds are the mistake to report
        kind = OmegaConf.select(cfg, "teacher.kind")
        if isinstance(kind, str) and kind in MODELS and (model == "tabular") != (kind == "tabular"):
            raise ConfigError(f"teacher.kind={kind} and model.kind={model}: student and teacher must both be "
                              "tabular or both be language models")
        teacher = _check_group(cfg, "teacher", MODELS, "kind")
    dataset = _check_group(cfg, "dataset", DATASETS, "source")
    reward = _check_group(cfg, "reward", REWARDS, "kind")
    _check_group(cfg, "hardware", {None: Hardware}, None)
    _check_group(cfg, "store", STORES, "kind")  # before logger: the logger's URIs come from it
    _check_group(cfg, "logger", LOGGERS, "kind")
    if task == "probe":  # measures the estimators on a policy/reference pair: no training, no reward
        _check_probe(cfg, model, teacher)
        _check_context(cfg)
        if dataset == "jsonl":
            _check_jsonl(cfg.dataset, 1)
        return
    _check_combination(cfg, task, est, model, teacher, reward)
    _check_context(cfg)
    _check_probe_every(cfg.task)
    _check_kl_ctl(cfg, task, kl_ctl)
    if dataset == "jsonl":  # last: the only check that reads files
        # the tabular model ignores the prompts (build_data): only the files' format matters then
        _check_jsonl(cfg.dataset, 1 if model == "tabular" else cfg.task.prompts_per_step)


def _check_combination(cfg: DictConfig, task: str, est: str, model: str, teacher: str | None, reward: str) -> None:
    """Rules across groups; each group alone is already valid."""
    t, beta = cfg.task, cfg.estimator.beta
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
    _check_tabular_pair(cfg, teacher)
    n = t.n_samples
    _check_placement(cfg, est)
    if est == "loo" and n < 2:
        raise ConfigError(f"estimator loo needs task.n_samples >= 2 (samples per prompt), got {n}")
    if reward != "none" and t.reward_coef != 0 and n < 2:
        raise ConfigError(f"the RLOO reward baseline needs task.n_samples >= 2, got {n}")
    if model == "tabular" and reward not in ("tabular", "none"):
        raise ConfigError(f"model=tabular needs reward=tabular or reward=none (got reward.kind={reward})")
    if reward == "tabular" and model != "tabular":
        raise ConfigError(f"reward=tabular needs model=tabular (got model.kind={model})")


def _check_tabular_pair(cfg: DictConfig, teacher: str | None) -> None:
    """A tabular model's EOS is one of its tokens, and a tabular teacher shares the student's vocabulary."""
    for who in ("model", "teacher"):
        m = cfg.get(who)
        if m is not None and m.kind == "tabular" and m.eos is not None and m.eos >= m.K:
            raise ConfigError(f"{who}.eos must be a token id in [0, {who}.K={m.K}), got {m.eos}")
    if teacher == "tabular":
        m, te = cfg.model, cfg.teacher
        if (m.K, m.T, m.eos) != (te.K, te.T, te.eos):
            raise ConfigError(f"student and teacher vocabularies differ: model (K={m.K}, T={m.T}, eos={m.eos}) "
                              f"vs teacher (K={te.K}, T={te.T}, eos={te.eos})")


def _check_kl_ctl(cfg: DictConfig, task: str, kl_ctl: str) -> None:
    if kl_ctl != "adaptive":
        return
    c, t = cfg.kl_ctl, cfg.task
    if task == "distill":
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
    prompts' lengths once they are tokenized: klbench.models.data.check_prompt_lengths.)"""
    from klbench.models.embedded.spec import preset_spec  # plain Python, like this module
    m = cfg.task.max_new_tokens
    for who in ("model", "teacher"):
        spec = cfg.get(who)
        if spec is None or spec.kind != "embedded":
            continue
        n = preset_spec(spec.preset, spec.spec)["n_positions"]
        if m >= n:
            raise ConfigError(f"task.max_new_tokens={m} does not fit the context of the embedded {who} "
                              f"(preset {spec.preset}): its {who}.spec.n_positions={n} positions hold the prompt "
                              f"and the response together, so task.max_new_tokens must be < {n}")


def _check_probe(cfg: DictConfig, model: str, teacher: str | None) -> None:
    t = cfg.task
    if t.grad_samples > t.samples:
        raise ConfigError(f"task.grad_samples={t.grad_samples} must be <= task.samples={t.samples}: the gradient "
                          "batch reuses the first grad_samples of each prompt's samples")
    _check_tabular_pair(cfg, teacher)


def _check_probe_every(t: DictConfig) -> None:
    every = t.get("probe_every")
    if every is None:
        return
    if every % t.val_every != 0:
        raise ConfigError(f"task.probe_every={every} must be a multiple of task.val_every={t.val_every}: the probe "
                          "runs at validations")
    if t.get("probe") is None:
        raise ConfigError("task.probe_every is set but task.probe (the probe's options) is missing")
    if t.probe.grad_samples > t.probe.samples:
        raise ConfigError(f"task.probe.grad_samples={t.probe.grad_samples} must be <= task.probe.samples="
                          f"{t.probe.samples}")


def _check_placement(cfg: DictConfig, est: str) -> None:
    """in_reward / in_loss option combinations (klbench.estimators.placement checks the same with torch), and
    what task.inner_steps > 1 needs: an estimator that corrects for pi_old, rollout-aligned checkpoints."""
    e, t = cfg.estimator, cfg.task
    if est in ("in_reward", "in_loss"):
        if e.value != "cv" and (e.lam != 1.0 or e.level != "token"):
            raise ConfigError(f"estimator.lam and estimator.level apply to estimator.value=cv only, got value={e.value} "
                              f"with lam={e.lam}, level={e.level}")
        per_token = not (e.value == "cv" and e.level == "sequence")
        if est == "in_reward" and e.form == "reward_to_go" and not per_token:
            raise ConfigError("estimator.form=reward_to_go needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "token" and not per_token:
            raise ConfigError("estimator.ratio=token needs a per-token value; value=cv level=sequence has none")
        if est == "in_loss" and e.ratio == "none" and (e.ratio_grad != "detached" or e.max_weight is not None):
            raise ConfigError("estimator.ratio=none has no ratio: ratio_grad must be detached and max_weight null")
        if est == "in_reward" and e.baseline == "loo" and t.n_samples < 2:
            raise ConfigError(f"estimator.baseline=loo needs task.n_samples >= 2, got {t.n_samples}")
    k = t.get("inner_steps", 1)
    if k > 1:
        if est not in OFF_POLICY_ESTIMATORS or (est == "in_loss" and e.ratio == "none"):
            raise ConfigError(f"task.inner_steps={k} trains on samples from the rollout's policy pi_old, but estimator "
                              f"{est}" + (" with ratio=none" if est == "in_loss" else "") + " assumes y ~ pi: use "
                              "estimator=rb, in_reward, or in_loss with estimator.ratio=token|sequence")
        for key in ("val_every", "max_steps"):  # checkpoints (made at validations and the end) start a rollout
            if t[key] % k:
                raise ConfigError(f"task.{key}={t[key]} must be a multiple of task.inner_steps={k}, so that every "
                                  "checkpoint falls on a rollout boundary and a resume repeats the run exactly")
        ctl = OmegaConf.select(cfg, "kl_ctl.name")
        if ctl not in (None, "fixed"):  # its signal is a value estimate, which needs on-policy samples
            raise ConfigError(f"kl_ctl={ctl} with task.inner_steps={k} is not supported: the controller's KL signal "
                              "assumes y ~ pi; use kl_ctl=fixed")


def _check_jsonl(ds: DictConfig, min_train: int) -> None:
    for key in ("train_path", "val_path"):
        try:
            prompts = read_prompts(ds[key], ds.field)
        except (OSError, ValueError) as e:
            raise ConfigError(f"dataset.{key}: {e}") from None
        if key == "train_path" and len(prompts) < min_train:
            raise ConfigError(f"dataset.train_path: {ds[key]} holds {len(prompts)} prompts, fewer than one step's "
                              f"task.prompts_per_step={min_train}")


def _check_group(cfg: DictConfig, group: str, schemas: dict[Any, type], disc: str | None) -> Any:
    """Check cfg[group] against the schema its `disc` key picks (hardware has one schema); returns that key."""
    if group not in cfg.keys():
        raise ConfigError(f"{group} is missing" + (f": choose {group}=<{'|'.join(schemas)}>" if disc else ""))
    node = _get(cfg, group, group)
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{group} must be a config group (a mapping), got {node!r}")
    if disc is None:
        _check_node(group, node, schemas[None], group, None)
        return None
    kind = _get(node, disc, f"{group}.{disc}") if disc in node.keys() else None
    if not isinstance(kind, str) or kind not in schemas:
        raise ConfigError(f"{group}.{disc}={kind!r} is unknown; valid: {', '.join(schemas)}")
    _check_node(group, node, schemas[kind], f"{group} {kind!r}", disc)
    return kind


def _check_node(path: str, node: Any, schema: type, what: str, disc: str | None) -> None:
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} must be a mapping, got {node!r}")
    known, present = [f.name for f in fields(schema)], list(node.keys())
    for key in present:
        if key not in known:
            options = ", ".join(k for k in known if k != disc) or "none"
            raise ConfigError(f"{path}.{key} does not apply to {what} (its options: {options})")
    types = get_type_hints(schema)
    for f in fields(schema):
        if f.name not in present:
            if f.default is MISSING:
                raise ConfigError(f"{path}.{f.name} is missing")
            continue
        _check_value(f"{path}.{f.name}", _get(node, f.name, f"{path}.{f.name}"), types[f.name], f.metadata)


def _check_value(path: str, value: Any, typ: Any, meta: Any) -> None:
    if is_dataclass(typ):
        _check_node(path, value, typ, path, None)
    elif not _fits(value, typ, meta):
        raise ConfigError(f"{path} must be {_describe(typ, meta)}, got {value!r}")


def _get(node: DictConfig, key: str, path: str) -> Any:
    if OmegaConf.is_missing(node, key):
        raise ConfigError(f"{path} is mandatory (???): set it, e.g. {path}=<value>")
    try:
        value = node[key]
        return OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path} cannot be resolved: {str(e).splitlines()[0]}") from None


def _fits(value: Any, typ: Any, meta: Any) -> bool:
    if "check" in meta:
        return meta["check"](value)
    if get_origin(typ) is Union:  # Optional[X] too
        return any(_fits(value, t, meta) for t in get_args(typ))
    if get_origin(typ) is Literal:  # by type too: True == 1 and 16.0 == 16, but neither is a valid choice
        return any(type(value) is type(a) and value == a for a in get_args(typ))
    if typ is type(None) or typ is bool:
        return value is None if typ is type(None) else isinstance(value, bool)
    if isinstance(value, bool):  # a bool is an int to Python, never a number or a name in a config
        return False
    if typ is str:
        pattern = meta.get("pattern")
        return isinstance(value, str) and value != "" and (pattern is None or re.fullmatch(pattern, value) is not None)
    if not (_is_int(value) or (typ is float and isinstance(value, float) and math.isfinite(value))):
        return False
    return (value >= meta.get("ge", -math.inf) and value > meta.get("gt", -math.inf)
            and value <= meta.get("le", math.inf))


def _describe(typ: Any, meta: Any) -> str:
    if "expect" in meta:
        return meta["expect"]
    args = get_args(typ)
    if get_origin(typ) is Union:
        kinds = " or ".join(_describe(t, meta) for t in args if t is not type(None))
        return kinds + (" or null" if type(None) in args else "")
    if get_origin(typ) is Literal:
        return " or ".join(map(repr, args)) if len(args) == 2 else "one of " + ", ".join(map(repr, args))
    what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a non-empty string"}[typ]
    if "pattern" in meta:
        return f"{what} matching {meta['pattern']}"
    if "ge" in meta and "le" in meta:
        return f"{what} in [{meta['ge']}, {meta['le']}]"
    return what + "".join(f" {sym} {meta[k]}" for k, sym in (("ge", ">="), ("gt", ">"), ("le", "<=")) if k in meta)
