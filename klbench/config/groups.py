"""The config groups and their option models: which model checks which node (GROUPS), the defaults Hydra composes
from (option_models, declared_defaults: klbench.config.resolvers.register), and one group's check, its pydantic
errors told as klbench's (_check_group; klbench.config.explain)."""
from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Annotated, Any, Optional, get_args

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from klbench.config.errors import ConfigError
from klbench.config.explain import explain
from klbench.estimators.options import Expect, Options
from klbench.config.fields import Str, _check
from klbench.config.resources import Dataset, Hardware, Logger, Model, Reward, Store
from klbench.config.training import KLCtl, EstimatorOption, Task

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
