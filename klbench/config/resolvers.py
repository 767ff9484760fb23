"""The `klbench_*` resolvers that conf/ uses, registered by name in one function that the CLI and
klbench.config.compose both call (nothing is registered as a side effect of an import).

| resolver | what it gives | where conf/ uses it |
|---|---|---|
| klbench_root | the checkout (conf/ and sweeps/ are read from it) | hydra.searchpath |
| klbench_sweeps | the sweep group's options | hydra.help.footer (`klbench --help`) |
| klbench_outputs | $KLBENCH_OUTPUTS, else ./outputs (klbench.record.store) | paths.outputs |
| klbench_tracking_uri | $MLFLOW_TRACKING_URI, else the outputs folder's SQLite store | store.mlflow |
| klbench_sqlite | a path as a sqlite:/// URI; a path no store can take is refused (klbench.record.store.sqlite_uri) | store.optuna |
| klbench_claim | a run or sweep folder no other process shares (klbench.record.rundir) | hydra.run.dir, hydra.sweep.dir |
| klbench_config_subdir | `.hydra`, or for a later start in the same folder `.hydra/attempt-<time>` (klbench.record.rundir) | hydra.output_subdir |
| klbench_cache | the per-user cache of embedded models (klbench.models.embedded.cache) | paths.cache |

It also puts the declared defaults of every option model (klbench.config.groups: each group's options,
StepProbeOptions and ProbeOptions within them) into Hydra's ConfigStore, as root configs named
`<group>_<option>_defaults` (`hardware_defaults` for the group of one model) that each conf/<group>/<option>.yaml
pulls in first with its defaults list (conf/task/rl.yaml: `- /task_rl_defaults@_here_`). So every key is a key of
the composed config, and a yaml holds only what its option does differently, interpolations and ??? (what
tests/test_defaults_once.py checks).
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]


def sweep_names() -> str:
    return ", ".join(sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml")))


def register() -> None:
    """Registers every klbench resolver and the options' defaults (again: replace=True, and ConfigStore
    overwrites, so calling twice is harmless)."""
    from klbench.models.embedded.cache import cache_dir
    from klbench.record import rundir, store
    resolvers = {
        "klbench_root": (lambda: str(ROOT), False),
        "klbench_sweeps": (sweep_names, False),
        "klbench_outputs": (lambda: str(store.outputs_dir()), False),
        "klbench_tracking_uri": (_one_line(store.tracking_uri), False),
        "klbench_sqlite": (_one_line(store.sqlite_uri), False),
        # cached, like Hydra's `now`: one folder per process, and the cache travels into a sweep's trials
        "klbench_claim": (_one_line(_claim), True),
        "klbench_config_subdir": (rundir.config_subdir, True),
        "klbench_cache": (lambda: str(cache_dir()), False),
    }
    for name, (fn, cache) in resolvers.items():
        OmegaConf.register_resolver(name, fn, use_cache=cache, replace=True)
    _store_option_defaults()


def _claim(base: str) -> str:
    """A run or sweep folder of its own (klbench.record.rundir); an outputs folder that cannot hold it
    (read-only, a file, a path no store can take) is named with the setting that chose it."""
    from klbench.record import rundir, store
    store.sqlite_uri(base)  # the stores go next to it: a path they cannot take is refused before any folder
    try:
        return rundir.claim(base)
    except OSError as e:
        raise store.StoreError(f"cannot create the run folder {base}: {e.strerror or e}. The outputs folder "
                               f"(${store.OUTPUTS_ENV}, else ./outputs, or paths.outputs=) must be a folder "
                               "you can write") from None


def _one_line(resolve):
    """A resolver whose failure the user can act on ends klbench with one line: raised, Hydra would print
    its traceback and OmegaConf's full key. SystemExit passes both (they catch Exception)."""
    from klbench.record.store import StoreError

    def call(*args):
        try:
            return resolve(*args)
        except StoreError as e:
            raise SystemExit(f"klbench: error: {e}") from None
    call.__name__ = getattr(resolve, "__name__", "resolver")
    return call


def _store_option_defaults() -> None:
    from hydra.core.config_store import ConfigStore
    from klbench.config.groups import declared_defaults, option_models
    store = ConfigStore.instance()
    for name, (model, tag) in option_models().items():
        store.store(name=name, node=declared_defaults(model, tag), replace=True)
