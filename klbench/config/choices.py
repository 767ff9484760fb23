"""A config-group option that does not exist is refused before a run or a sweep starts.

    refuse_unknown_options(overrides, config_name)   # raises ConfigError: experiment=tabualr is unknown; valid: ...
    named_options(overrides, sweeper_params)         # what a command names: its overrides, a sweep's params
    RefuseUnknownOptions(...)                        # the Hydra callback that calls it (conf/hydra/callbacks/)

Hydra refuses an unknown option of a group its defaults list requires (`estimator=rbb`), but skips an
*optional* default whose file is missing without a word: with `optional experiment: null` in
conf/config.yaml, `klbench experiment=tabualr` trained the default job and `klbench -m sweep=rl_betaa` ran
one job through Hydra's basic sweeper. So every option someone names, on the command line or in a sweep's
`hydra.sweeper.params`, each value of a sweep over a group included, must be a config of its group.
Only what a command names is checked; what the config files choose stays as Hydra treats it, so a
preset's values for a task (`optional /experiment/task/tabular@task: ${task}`) stay optional: they exist
for some tasks only, and every task runs on every preset.
"""
from __future__ import annotations

from typing import Sequence

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.types import ValueType
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from klbench.config.errors import ConfigError


def refuse_unknown_options(overrides: Sequence[str], config_name: str = "config") -> None:
    """Raises ConfigError naming the first override that selects a group option with no config file,
    with the group's valid options. Called right after Hydra composed `config_name` with these overrides
    and kept the repository it read active (Hydra's run and multirun do; klbench.config.compose does): the
    options are read from it as Hydra read them (hydra.searchpath, where the sweep group lives, and the
    plugins' configs, hydra/launcher=basic), without reading the config files again."""
    loader = GlobalHydra.instance().config_loader()
    for o in loader.parse_overrides(config_name, list(overrides)):
        if "." in o.key_or_group or o.is_delete():
            continue  # a value (estimator.beta=0.1, hydra.run.dir=...): no group's name has a '.'; ~group drops one
        if o.value_type == ValueType.GLOB_CHOICE_SWEEP or (o.is_sweep_override() and not o.is_discrete_sweep()):
            continue  # glob(...) picks among the existing options only; an interval names none
        valid = loader.get_group_options(o.key_or_group)
        if not valid:
            continue  # a top-level value (seed=1), not a group
        value = o.value()
        names = list(o.sweep_string_iterator()) if o.is_sweep_override() else \
            value if isinstance(value, list) else [value]
        for name in names:
            if name is not None and name != "null" and str(name) not in valid:
                raise ConfigError(f"{o.get_key_element()}={name} is unknown; valid: {', '.join(sorted(valid))}")


def named_options(overrides: DictConfig, sweeper_params: DictConfig | None) -> list[str]:
    """What a command names, from its composed config: the command line's overrides (`hydra.overrides`, its
    `hydra` and `task` lists) and a sweep's `hydra.sweeper.params`, which each trial applies
    (`estimator: choice(seq, rb)` becomes `estimator=choice(seq, rb)`)."""
    return [*overrides.hydra, *overrides.task, *(f"{k}={v}" for k, v in (sweeper_params or {}).items())]


class RefuseUnknownOptions(Callback):
    """Hydra callback (conf/hydra/callbacks/klbench.yaml) that makes the check above when Hydra creates it,
    which is before any hook: before the run folder (run_job) and before a sweep callback opens a study, an
    MLflow run or the sweep folder. A check in on_run_start / on_multirun_start would be too late for a
    sweep: Hydra calls every callback's on_multirun_end even when a start hook exits, and those claim the
    sweep folder. It comes first because the hydra/callbacks group is composed before the primary config's
    groups (a sweep's own callback, from sweeps/sweep_common.yaml, comes after it). SystemExit, not an
    exception: one line, exit 1, and no traceback. Holds nothing (submitit pickles it into every job)."""

    def __init__(self, overrides: DictConfig, sweeper_params: DictConfig | None, config_name: str) -> None:
        try:
            refuse_unknown_options(named_options(overrides, sweeper_params), config_name)
        except ConfigError as e:
            raise SystemExit(f"klbench: error: {e}") from None


# ---- what Hydra refuses while composing, told in one line ----
# Hydra reports a composition error itself and exits: for a group it requires (`estimator=rbb`) its 26-line
# block; for a key that is not in the config (`task.max_step=20`) the advice to type `+task.max_step=20`, which
# composes a key nothing reads. The CLI (klbench.cli.main) asks here for klbench's line instead.

def explain_composition_error(overrides: Sequence[str], config_name: str = "config") -> str | None:
    """One line for a command Hydra could not compose: the first option that is no config of its group
    (with the valid names), else the first key that is not in the config (with the nearest valid key), else
    None (Hydra's own report stands). Called after Hydra failed, with its GlobalHydra still set up."""
    gh = GlobalHydra.instance()
    if not gh.is_initialized():
        return None
    try:
        refuse_unknown_options(overrides, config_name)
    except ConfigError as e:
        return str(e)
    loader = gh.config_loader()
    parsed = loader.parse_overrides(config_name, list(overrides))
    groups = [o for o in parsed if "." not in o.key_or_group and not o.is_delete() and not o.is_sweep_override()
              and loader.get_group_options(o.key_or_group)]
    try:  # the config the command's group choices make: its keys are the valid ones
        from hydra.types import RunMode
        cfg = gh.hydra.compose_config(config_name, [o.input_line for o in groups], run_mode=RunMode.RUN,
                                      from_shell=True, with_log_configuration=False)
    except Exception:  # the choices alone fail: nothing klbench can say better than Hydra
        return None
    for o in parsed:
        if o in groups or o.is_add() or o.is_force_add() or o.is_delete():
            continue  # +key / ++key add keys on purpose; ~key names one that exists (Hydra says so otherwise)
        key = o.key_or_group.split("@")[0] if "." not in o.key_or_group else o.key_or_group
        if _select(cfg, key) is _ABSENT:
            line = unknown_key_line(cfg, key)
            return line if "did you mean" in line else line + _other_options_with(key, groups, config_name)
    return None


def _other_options_with(key: str, groups: list, config_name: str) -> str:
    """`; model=hf has it` where the key belongs to other options of its group (model.name_or_path under
    model=embedded): each option composed in its turn (the error path only: well under a second per group)."""
    from hydra.types import RunMode
    gh = GlobalHydra.instance()
    group = key.split(".")[0]
    others = [o.input_line for o in groups if o.key_or_group != group]
    having = []
    for option in gh.config_loader().get_group_options(group):
        try:
            cfg = gh.hydra.compose_config(config_name, [*others, f"{group}={option}"], run_mode=RunMode.RUN,
                                          from_shell=True, with_log_configuration=False)
        except Exception:  # an option that needs others (a teacher, a task): not a hint worth the risk
            continue
        if _select(cfg, key) is not _ABSENT:
            having.append(f"{group}={option}")
    return f"; {', '.join(having)} {'has' if len(having) == 1 else 'have'} it" if having else ""


_ABSENT = object()


def _select(cfg, key: str):
    """The node at a dotted key, or _ABSENT; a key whose value is still to be given (`???`) exists too."""
    from omegaconf import DictConfig
    node = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():
            return _ABSENT
        node = node._get_node(part)
    return node


def unknown_key_line(cfg, key: str) -> str:
    """`task.max_step is no key of task=rl; did you mean task.max_steps?`: the nearest key of the nearest node
    that exists (difflib), or that node's keys where none is near."""
    import difflib

    from omegaconf import DictConfig
    parts = key.split(".")
    depth = len(parts) - 1
    while depth > 0 and not isinstance(_select(cfg, ".".join(parts[:depth])), DictConfig):
        depth -= 1  # the deepest node of the key that exists: its keys are the candidates
    node_key = ".".join(parts[:depth])
    node = _select(cfg, node_key) if node_key else cfg
    choices = dict(cfg.hydra.runtime.choices) if "hydra" in cfg else {}
    keys = [k for k in node.keys() if node_key or k != "hydra"]
    if not node_key:
        keys += [g for g in choices if "/" not in g and g not in keys]  # a group, e.g. estimator=
    where = (f"{node_key}={choices[node_key]}" if choices.get(node_key) else node_key) if node_key else "the config"
    rest = parts[depth]
    near = difflib.get_close_matches(rest, keys, n=1, cutoff=0.6)
    full = lambda k: f"{node_key}.{k}" if node_key else k  # noqa: E731
    if near:
        return f"{key} is no key of {where}; did you mean {full(near[0])}?"
    return f"{key} is no key of {where}; its keys: {', '.join(sorted(map(str, keys)))}"
