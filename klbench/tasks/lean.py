"""Importing Lightning without what it pulls in and klbench never uses.

`import lightning.pytorch` imports torchmetrics, and torchmetrics' __init__ imports every optional
integration it finds installed: transformers (for BERTScore), scipy.signal and matplotlib.pyplot. On the
tabular path that is a large part of Lightning's import time (docs/console.md has the figures), for
nothing: klbench uses no torchmetrics metric and imports transformers itself, where a model needs it.

`lightning()` imports Lightning with these three packages out of torchmetrics' sight: its availability
flags for them read False, and an import of one of them while Lightning loads raises
ModuleNotFoundError (loudly: nothing falls back). A package already imported stays visible. Once
Lightning is in, every package imports as usual; klbench.models.hf imports transformers when a run loads
a Hugging Face or embedded model. tests/test_console.py checks that a tabular run does not import them.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from contextlib import contextmanager

HIDDEN = ("transformers", "scipy", "matplotlib")
FLAGS_MODULE = "torchmetrics.utilities.imports"


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if top in HIDDEN and top not in sys.modules:
            raise ModuleNotFoundError(f"{name} is not importable while Lightning loads (klbench.tasks.lean)", name=name)
        if name != FLAGS_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_hide(module):
            exec_module(module)
            _flags_off(module)

        spec.loader.exec_module = exec_and_hide
        return spec


def _flags_off(module) -> None:
    """torchmetrics' RequirementCache flags (e.g. _TRANSFORMERS_GREATER_EQUAL_4_4) of the hidden packages."""
    from lightning_utilities.core.imports import RequirementCache
    from packaging.requirements import Requirement
    for value in vars(module).values():
        if isinstance(value, RequirementCache) and value.requirement:
            name = Requirement(value.requirement).name
            if name in HIDDEN and name not in sys.modules:
                value.available = False
                value.message = f"{name}: not used by klbench (klbench.tasks.lean)"


@contextmanager
def lightning():
    """`with lean.lightning(): import lightning.pytorch` (a no-op once torchmetrics is imported)."""
    if "torchmetrics" in sys.modules:
        yield
        return
    finder = _Hide()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
