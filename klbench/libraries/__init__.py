"""Adapters that run the KL code of installed RL libraries (TRL, verl, OpenRLHF, AReaL, torchtune) as
per-sequence losses on a KLBatch, so that klbench.exact.tabular.audit can say which gradient each follows.
Each library module has `load() -> Library` (raising LibraryMissing with a one-line reason)."""
from __future__ import annotations

import importlib

from klbench.libraries.base import Library, LibraryMissing, Setting

from klbench.estimators.options import LIBRARY_NAMES as LIBRARIES  # declared with estimator=library's options

PINNED = {"trl": "1.16.0", "verl": "0.9.1", "openrlhf": "0.11.2", "areal": "1.0.4", "torchtune": "0.6.1"}


def load(name: str) -> Library:
    """The named library's settings; LibraryMissing if it is absent, of another version, or has none."""
    if name not in LIBRARIES:
        raise ValueError(f"unknown library {name!r}; known: {', '.join(LIBRARIES)}")
    module = importlib.import_module(f"klbench.libraries.{name}")
    try:
        return module.load()
    except LibraryMissing:
        raise
    except ImportError as e:  # installed but its import chain is incomplete
        raise LibraryMissing(f"{name}: installed but cannot be imported ({type(e).__name__}: {e}); "
                             f"bash scripts/install_libraries.sh") from e


__all__ = ["LIBRARIES", "PINNED", "Library", "LibraryMissing", "Setting", "load"]
