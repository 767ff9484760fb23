"""The `klbench_*` resolvers that conf/ uses, registered by name in one function that the CLI and
klbench.config.compose both call (nothing is registered as a side effect of an import).

| resolver | what it gives | where conf/ uses it |
|---|---|---|
| klbench_root | the checkout (conf/ and sweeps/ are read from it) | hydra.searchpath |
| klbench_sweeps | the sweep group's options | hydra.help.footer (`klbench --help`) |
| klbench_outputs | $KLBENCH_OUTPUTS, else ./outputs (klbench.record.store) | paths.outputs |
| klbench_tracking_uri | $MLFLOW_TRACKING_URI, else the outputs folder's SQLite store | store.mlflow |
| klbench_claim | a run or sweep folder no other process shares (klbench.record.rundir) | hydra.run.dir, hydra.sweep.dir |
| klbench_cache | the per-user cache of embedded models (klbench.models.embedded.cache) | paths.cache |
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]


def sweep_names() -> str:
    return ", ".join(sorted(p.stem for p in (ROOT / "sweeps" / "sweep").glob("*.yaml")))


def register() -> None:
    """Registers every klbench resolver (again: replace=True, so calling twice is harmless)."""
    from klbench.models.embedded.cache import cache_dir
    from klbench.record import rundir, store
    resolvers = {
        "klbench_root": (lambda: str(ROOT), False),
        "klbench_sweeps": (sweep_names, False),
        "klbench_outputs": (lambda: str(store.outputs_dir()), False),
        "klbench_tracking_uri": (store.tracking_uri, False),
        # cached, like Hydra's `now`: one folder per process, and the cache travels into a sweep's trials
        "klbench_claim": (rundir.claim, True),
        "klbench_cache": (lambda: str(cache_dir()), False),
    }
    for name, (fn, cache) in resolvers.items():
        OmegaConf.register_resolver(name, fn, use_cache=cache, replace=True)
