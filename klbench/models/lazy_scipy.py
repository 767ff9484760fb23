"""Loading a causal LM without importing scipy.optimize for transformers' object-detection losses.

transformers' modeling_utils (5.24.0) imports every loss it has (transformers.loss.loss_utils), and six, the
DETR-style matchers, do `from scipy.optimize import linear_sum_assignment` at import wherever scipy is
installed. For a language model that is half a second of every run's start (0.48 s of the peer job's 15 s,
docs/running.md, "Speed") spent on a function nothing calls.

`install()` (klbench.models, before any of its modules imports transformers) adds a finder that acts on one
module, transformers.loss.loss_utils, once. While that module executes, `scipy.optimize` resolves to a
stand-in: every name imported from it is a function that imports the real scipy.optimize at its first call
and returns what the real function returns. The stand-in leaves sys.modules as soon as loss_utils has run.
Nothing else changes: a later `import scipy.optimize` is the real module, a scipy.optimize already imported
is used as it is, and a transformers that names the module otherwise is left alone. tests/test_lazy_scipy.py
checks each. The one window: a second thread importing scipy.optimize during those milliseconds would get the
stand-in (klbench loads its models on the main thread, and none of its threads imports scipy).
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

TARGET = "transformers.loss.loss_utils"


def deferred(name: str):
    """A function that calls scipy.optimize.<name>, importing scipy.optimize at the first call."""
    def call(*args, **kwargs):
        return getattr(importlib.import_module("scipy.optimize"), name)(*args, **kwargs)
    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"scipy.optimize.{name}, imported at the first call (klbench.models.lazy_scipy)"
    return call


def _stand_in() -> types.ModuleType:
    module = types.ModuleType("scipy.optimize", "klbench.models.lazy_scipy's stand-in, during one import")

    @functools.lru_cache(None)
    def attribute(name: str):  # PEP 562: what `from scipy.optimize import f` reads
        if name.startswith("__"):  # the import system's own questions (__path__: is it a package?)
            raise AttributeError(name)
        return deferred(name)

    module.__getattr__ = attribute
    return module


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        uninstall()  # once: the module is imported at most once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or "scipy.optimize" in sys.modules:
            return spec
        exec_module = spec.loader.exec_module

        def exec_with_stand_in(module):
            stand_in = sys.modules["scipy.optimize"] = _stand_in()
            try:
                exec_module(module)
            finally:
                if sys.modules.get("scipy.optimize") is stand_in:
                    del sys.modules["scipy.optimize"]

        spec.loader.exec_module = exec_with_stand_in
        return spec


_FINDER = _Finder()


def install() -> None:
    """Defer scipy.optimize for transformers' losses (a no-op once they are imported)."""
    if TARGET not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
