"""A library setting as a klbench gradient estimator: `LibraryGradient(setting="trl.grpo")(batch)` is the
setting's per-sequence loss (the library's own code, see klbench/libraries/), so a training run can put
"TRL's default GRPO KL" on the same frontier as `rb`.

Importing this module registers the name "library" in klbench.estimators.GRADIENT_ESTIMATORS: the RL task
imports it when estimator=library (the estimators layer may not import klbench.libraries). A setting that is
unknown, or whose library is missing or of another version, is a ConfigError (one line, with the pip line)."""
from __future__ import annotations

from typing import Any

import torch

from klbench.estimators import KLBatch
from klbench.estimators.base import GRADIENT_ESTIMATORS, Estimate, Estimator, register
from klbench.config.errors import ConfigError
from klbench.estimators.options import LibraryOptions
from klbench.libraries import LibraryMissing, Setting, load

_SETTINGS: dict[str, Setting] = {}


def setting(name: str) -> Setting:
    """The named library setting, loaded once per process; ConfigError naming the valid ones if unknown."""
    if name not in _SETTINGS:
        try:
            lib = load(str(name).split(".")[0])
        except (ValueError, LibraryMissing) as e:
            raise ConfigError(f"estimator.setting={name}: {e}") from None
        if name not in lib.settings:
            raise ConfigError(f"estimator.setting={name}: {lib.name} {lib.version} has no such setting; valid: "
                              f"{', '.join(lib.settings)}")
        _SETTINGS[name] = lib.settings[name]
    return _SETTINGS[name]


@register(GRADIENT_ESTIMATORS)
class LibraryGradient(Estimator):
    """The surrogate [B] of a library setting (trl.grpo, verl.kl_penalty.low_var_kl, ...). Off-policy batches
    are passed on: the library code reads old_logp as it would its rollout log-probs, and what that gives is
    in docs/libraries.md (often "none of the above")."""

    name = "library"
    defaults: dict[str, Any] = LibraryOptions().model_dump()
    off_policy = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._setting = setting(self.options["setting"])

    def compute(self, batch: KLBatch) -> torch.Tensor | Estimate:
        out = self._setting.loss(batch)
        if not torch.isfinite(out).all():
            raise FloatingPointError(f"estimator 'library' (setting={self.options['setting']!r}): the library "
                                     f"returned non-finite values")
        return out
