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
