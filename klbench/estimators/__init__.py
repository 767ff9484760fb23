"""Pure-torch KL value and gradient estimators (no Lightning, no Hydra).

    from klbench.estimators import KLBatch, value_estimator, gradient_estimator
"""
from klbench.estimators import gradients as _gradients  # noqa: F401  (registers)
from klbench.estimators import placement as _placement  # noqa: F401  (registers in_reward, in_loss)
from klbench.estimators import values as _values  # noqa: F401  (registers)
from klbench.estimators.base import (GRADIENT_ESTIMATORS, VALUE_ESTIMATORS, Estimate, Estimator, gradient_estimator,
                                     value_estimator)
from klbench.estimators.batch import KLBatch
from klbench.estimators.chunked import exact_token_kl, exact_token_kl_naive

__all__ = ["KLBatch", "value_estimator", "gradient_estimator", "VALUE_ESTIMATORS", "GRADIENT_ESTIMATORS",
           "Estimate", "Estimator", "exact_token_kl", "exact_token_kl_naive"]
