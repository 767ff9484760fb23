"""The typed schema of a composed klbench config, checked before anything heavy is imported.

`validate(cfg)` raises ConfigError naming the field first (and the valid options where that helps): a bad
value then fails before torch, Lightning and MLflow are imported, with klbench's message rather than another
library's. This module imports only the stdlib, omegaconf, pydantic and torch-free klbench modules (a test
checks it).

Each option of each config group is a pydantic model (klbench.estimators.options.Options: unknown keys, NaN
and coercion refused) whose fields are the keys its yaml may hold: klbench/config/training.py (task, estimator,
kl_ctl) and klbench/config/resources.py (model, dataset, reward, hardware, logger, store), tied to their groups in
klbench/config/groups.py. Every default is declared there, once: Hydra
takes them from these models (klbench.config.resolvers.register puts `declared_defaults` into its ConfigStore,
and each conf/<group>/<option>.yaml pulls them in with `- /<group>_<option>_defaults@_here_`), so a yaml holds
only what its option does differently, and the values pydantic cannot hold: interpolations (`${...}`) and `???`
(a value the user must give). A field without a default is one of those. tests/test_defaults_once.py checks it.
A group's models form a union told apart by their `name`, `kind` or `source`. The estimators' and the
probe's options are declared once, in klbench.estimators.options and klbench.probe.config, and the models
here extend them. What no single group can tell, the rules across groups, is klbench/config/rules.py.

This module is the entry point: `validate`, and the names callers import from here.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from klbench.config.errors import ConfigError
from klbench.config.groups import (GROUPS, OTHER_KEYS, TopLevel, _check_group, _plain, _tags, _validated,
                                   declared_defaults, option_models)
from klbench.config.resources import OPTUNA_URL, EmbeddedSpec, Model
from klbench.config.rules import (_as_config_error, _check_chat, _check_combination, _check_context, _check_fsdp,
                                  _check_jsonl, _check_kl_ctl, _check_objectives, _check_probe_every,
                                  _check_sampling, _check_tabular_pair, check_followed_sampling)
from klbench.config.training import BETA_MAX, HORIZON_UNITS, KLCtlAdaptive
from klbench.models.pair_rules import check_kinds

# what callers import from here (ConfigError is raised by every check)
__all__ = ["validate", "ConfigError", "check_followed_sampling", "declared_defaults", "option_models", "GROUPS",
           "EmbeddedSpec", "KLCtlAdaptive", "HORIZON_UNITS", "BETA_MAX", "OPTUNA_URL", "_check_fsdp", "_tags"]


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
