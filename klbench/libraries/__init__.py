"""Adapters that run the KL code of installed RL libraries (TRL, verl, OpenRLHF, AReaL, torchtune, skyrl-train) as
per-sequence losses on a KLBatch, so that klbench.exact.tabular.audit can say which gradient each follows.
Each library module has `load() -> Library` (raising LibraryMissing with a one-line reason)."""
from __future__ import annotations

import importlib

from klbench.libraries.base import Library, LibraryMissing, Setting

from klbench.estimators.options import LIBRARY_NAMES as LIBRARIES  # declared with estimator=library's options

from klbench.libraries.unavailable import UNAVAILABLE

PINNED = {"trl": "1.16.0", "verl": "0.9.1", "openrlhf": "0.11.2", "areal": "1.0.4", "torchtune": "0.6.1",
          "skyrl_train": "0.3.1", "tinker_cookbook": "0.6.1"}
# every name `klbench-audit --all` reports: the runnable libraries, then those listed with why they cannot run here
ALL = tuple(LIBRARIES) + tuple(UNAVAILABLE)


def load(name: str) -> Library:
    """The named library's settings; LibraryMissing if it is absent, of another version, or has none."""
    if name in UNAVAILABLE:
        release, reason = UNAVAILABLE[name]
        raise LibraryMissing(f"{release}: {reason}")
    if name not in LIBRARIES:
        raise ValueError(f"unknown library {name!r}; known: {', '.join(ALL)}")
    module = importlib.import_module(f"klbench.libraries.{name}")
    try:
        return module.load()
    except LibraryMissing:
        raise
    except Exception as e:  # installed but its import chain is incomplete (TRL's lazy modules raise RuntimeError)
        raise LibraryMissing(f"{name}: installed but cannot be imported ({last_line(e)}); "
                             f"pip install --no-deps {getattr(module, 'DIST', name)}=={PINNED[name]}  "
                             "(or: bash scripts/install_libraries.sh)"
                             ) from e


def last_line(e: BaseException) -> str:
    """The last non-empty line of an exception's message, with its type: what the table shows of it."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


__all__ = ["ALL", "LIBRARIES", "PINNED", "Library", "LibraryMissing", "Setting", "load"]
