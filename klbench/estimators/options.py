"""The estimators' options, declared once and without torch: pydantic models read by the torch estimators
(their `defaults`), by the config schema (klbench.config.schema, before torch is imported), and by Hydra
(conf/estimator/*.yaml take their defaults from these models: klbench.config.resolvers.register).

Importing this module imports no torch: klbench/estimators/__init__.py loads the torch modules only when one
of the package's names (KLBatch, value_estimator, ...) is first used. The alternative, a torch-free module
outside the package, would put the estimators' options away from the estimators.

`Options` is the base of every klbench options model (here, klbench.probe.config, the schema): unknown keys,
NaN and inf refused, no coercion (a bool is not a number, "1" is not 1; an int is a float), immutable.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


@dataclass(frozen=True)
class Expect:
    """Annotated[..., Expect("what the field must be")]: how an error message describes a field whose
    annotation does not say it (klbench.config.explain words every other message from the annotation)."""
    text: str


def literal_choices(model: type[BaseModel]) -> dict[str, tuple]:
    """The values of each Literal field: {"form": ("sequence", "reward_to_go"), ...} for InRewardOptions."""
    return {k: get_args(f.annotation) for k, f in model.model_fields.items() if get_origin(f.annotation) is Literal}


# option values renamed, accepted for one release: (option, old value) -> (new value, the line a use prints once)
RENAMED = {("kl_norm", "fused"): ("before", "klbench: kl_norm=fused is renamed kl_norm=before, and estimator=kl_fused "
                                            "estimator=kl_before (the KL enters the reward before the advantage); "
                                            "the old names go in the next release")}
_told: set[str] = set()


def renamed(key: str, value: Any) -> Any:
    """The current name of option value `value` of `key`; an old one prints its deprecation line (once a process)."""
    new, line = RENAMED.get((key, value), (value, None)) if isinstance(value, str) else (value, None)
    if line is not None and line not in _told:
        _told.add(line)
        print(line, file=sys.stderr)
    return new


Level = Literal["token", "sequence"]


class Multiplier(Options):
    """The control variate rho + lam (exp(-rho) - 1), per token (level=token) or per sequence."""
    lam: float = 1.0
    level: Level = "token"


class ControlVariateOptions(Multiplier):
    """cv (value estimator) and naive_cv (gradient estimator): clamp=c clamps the estimate to [-c, c]."""
    clamp: Optional[float] = Field(None, gt=0)


class PlacementOptions(Multiplier):
    """in_reward and in_loss (klbench.estimators.placement): the value placed, and the truncation of the
    importance weights. lam and level apply to value=cv only."""
    value: Literal["k1", "k2", "k3", "cv"] = "k1"
    max_weight: Optional[float] = Field(None, gt=0)


class InRewardOptions(PlacementOptions):
    form: Literal["sequence", "reward_to_go"] = "sequence"
    baseline: Literal["none", "loo"] = "none"
    # where the KL enters relative to the reward's advantage (task.advantage): "after" it, as its own REINFORCE
    # term (FRPO's placement); "before" it, in the reward, r - beta v, as GRPO-with-KL-in-reward implementations
    # do (the RL task applies it: klbench/tasks/rl.py, klbench/estimators/advantages.py). "fused": before's old name
    kl_norm: Annotated[Literal["after", "before"], BeforeValidator(lambda v: renamed("kl_norm", v))] = "after"


class InLossOptions(PlacementOptions):
    ratio: Literal["none", "token", "sequence"] = "token"
    ratio_grad: Literal["detached", "differentiable"] = "detached"


class VOPDOptions(Options):
    """vopd (klbench.estimators.opd): the score term's form; its baseline is always the exact kappa_t."""
    form: Literal["reward_to_go", "token"] = "reward_to_go"


class TopKTailOptions(Options):
    """topk_tail: the size of the policy's head whose KL is summed exactly (k <= the vocabulary size)."""
    k: int = Field(2, ge=1)


class TopKTruncOptions(Options):
    """topk_trunc (a pitfall): the size of the top-k set and whose top-k it is."""
    k: int = Field(2, ge=1)
    head: Literal["teacher", "policy"] = "teacher"


# the reward term's options (task.advantage, task.loss_agg): klbench/estimators/advantages.py states each formula
ADVANTAGES = ("rloo", "grpo", "dr_grpo", "reinforce")
GROUP_ADVANTAGES = ("rloo", "grpo", "dr_grpo")  # need n >= 2 samples per prompt
LOSS_AGGS = ("seq_sum", "token_mean", "seq_mean_token_mean", "seq_sum_norm")


# the libraries klbench.libraries has adapters for (an estimator=library setting starts with one of them)
LIBRARY_NAMES = ("trl", "verl", "openrlhf", "areal", "torchtune", "skyrl_train", "tinker_cookbook")
SETTING = (f"a library setting such as trl.grpo or verl.kl_penalty.low_var_kl (library one of "
           f"{', '.join(LIBRARY_NAMES)}; `klbench-audit --all` lists every setting)")


def setting_task(setting: str) -> str:
    """The task a library setting belongs to, read from its name: "<library>.distill.*" settings are on-policy
    distillation losses (task=distill), every other one a KL penalty against a reference (task=rl). Every
    adapter names its settings so (tests/test_libraries.py checks it against Setting.task)."""
    parts = str(setting).split(".")
    return "distill" if len(parts) > 2 and parts[1] == "distill" else "rl"


class LibraryOptions(Options):
    """estimator=library: the KL code of an installed RL library as the gradient estimator (klbench.libraries).
    The setting's full name is checked when the library loads: its settings are known only to its adapter."""
    setting: Annotated[str, Field(pattern=r"^(" + "|".join(LIBRARY_NAMES) + r")\.[A-Za-z0-9_.+]+$"),
                       Expect(SETTING)] = "trl.grpo"


# the gradient estimators that correct for samples from a behaviour policy pi_old (KLBatch.old_logp), which
# task.inner_steps > 1 and task.kl_target=model at a temperature produce; in_loss only with a ratio. `library` runs a
# library's own off-policy code, which need not correct for pi_old: that is what docs/libraries.md audits. The
# config schema refuses the others before torch loads; tests/test_schema.py checks each class's supports_off_policy.
OFF_POLICY_GRADIENTS = ("rb", "in_reward", "in_loss", "library")


def corrects_off_policy(name: str, ratio: str | None = None) -> bool:
    """Whether gradient estimator `name` (in_loss: with `ratio`) takes samples from pi_old."""
    return name in OFF_POLICY_GRADIENTS and not (name == "in_loss" and ratio == "none")


# the estimators with options, by registered name; every other estimator takes none
GRADIENT_OPTIONS: dict[str, type[Options]] = {"naive_cv": ControlVariateOptions, "in_reward": InRewardOptions,
                                              "in_loss": InLossOptions, "library": LibraryOptions,
                                              "vopd": VOPDOptions, "topk_tail": TopKTailOptions,
                                              "topk_trunc": TopKTruncOptions}
VALUE_OPTIONS: dict[str, type[Options]] = {"cv": ControlVariateOptions}

# The value estimators klbench reports, by label -> (registered name, options): train/kl_<label> at every
# logged step, the probe's rows, and the signals kl_ctl may use.
REPORTED_VALUES: dict[str, tuple[str, dict]] = {
    "mc": ("mc", {}),
    "k2": ("k2", {}),
    "k3": ("cv", {"lam": 1.0, "level": "token"}),
    "cv_seq": ("cv", {"lam": 1.0, "level": "sequence"}),
    "cv_opt": ("cv_opt", {}),
    "rb": ("rb", {}),
}
