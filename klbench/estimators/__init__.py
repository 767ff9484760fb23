"""Pure-torch KL value and gradient estimators (no Lightning, no Hydra).

    from klbench.estimators import KLBatch, value_estimator, gradient_estimator

The names below load on first use (a module __getattr__, PEP 562), and with them every estimator module,
which registers its estimators. Importing the package alone imports no torch, so that the config schema
can read klbench.estimators.options, the torch-free declarations of the estimators' options, before torch
is imported.
"""
from __future__ import annotations

_NAMES = {"KLBatch": "batch", "value_estimator": "base", "gradient_estimator": "base", "VALUE_ESTIMATORS": "base",
          "GRADIENT_ESTIMATORS": "base", "Estimate": "base", "Estimator": "base", "exact_token_kl": "vocab_exact",
          "exact_token_kl_naive": "vocab_exact", "PGCorrection": "pg_correction"}
__all__ = list(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:  # a submodule (`from klbench.estimators import values`) is imported by Python then
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from klbench.estimators import base, batch, pg_correction, vocab_exact
    from klbench.estimators import gradients, opd, placement, values  # noqa: F401  (register, in this order)
    modules = {"base": base, "batch": batch, "vocab_exact": vocab_exact, "pg_correction": pg_correction}
    globals().update({n: getattr(modules[m], n) for n, m in _NAMES.items()})
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
