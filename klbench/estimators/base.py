"""Estimator base class and the name registries behind value_estimator() / gradient_estimator()."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from klbench.estimators.batch import KLBatch

VALUE_ESTIMATORS: dict[str, type["Estimator"]] = {}
GRADIENT_ESTIMATORS: dict[str, type["Estimator"]] = {}


@dataclass(frozen=True)
class Estimate:
    """What one call of an estimator gave: `est.estimate(batch)`; `est(batch)` is its `.values`.

    values:     [B] the per-sequence estimate (value estimators: detached) or surrogate (gradient estimators)
    n_clamped:  entries that `clamp=c` clamped, or importance weights that `max_weight=c` truncated (see the
                estimator's docstring for what an entry is); 0 when none fired, None when the option is unset
    fitted_lam: cv_opt's multiplier, fitted on this very batch; None for every other estimator
    """

    values: torch.Tensor
    n_clamped: int | None = None
    fitted_lam: float | None = None


class Estimator:
    """A callable `estimator(batch) -> Tensor[B]` with declared, validated options.

    `estimator.estimate(batch)` gives the same values as an `Estimate`, with what the call did on the way
    (clamps that fired, a fitted multiplier). Estimators hold no state between calls.
    Subclasses set `name`, `defaults` (option -> default value) and implement `compute`, which returns
    Tensor[B], or an Estimate when the call has more to report.
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    # whether samples from a behaviour policy pi_old != pi (KLBatch.old_logp) are corrected for; see
    # supports_off_policy(), which options may refine
    off_policy: ClassVar[bool] = False
    # whether the surrogate differentiates the exact per-position KL kappa_t (KLBatch.kappa): a scorer then builds
    # it with the log-probs in one pass (klbench.estimators.vocab_exact.token_scores: one softmax, one gradient)
    kappa_gradient: ClassVar[bool] = False
    # whether it reads kappa_t at all (its gradient or as a detached baseline): a scorer then computes it
    reads_kappa: ClassVar[bool] = False
    # whether it reads the whole [B, T, V] distributions (top-k sets): a language model then scores through its
    # logits, not its hidden states (klbench.models.scoring)
    reads_logits: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.defaults))
        if unknown:
            valid = ", ".join(sorted(self.defaults)) or "none"
            raise ValueError(f"estimator {self.name!r} got unknown option(s) {unknown}; valid options: {valid}")
        self.options = {**self.defaults, **options}
        for key, value in self.options.items():
            _check_option(self.name, key, value)

    def __getattr__(self, key: str) -> Any:
        options = self.__dict__.get("options", {})
        if key in options:
            return options[key]
        raise AttributeError(key)

    def __call__(self, batch: KLBatch) -> torch.Tensor:
        """[B] one estimate (or surrogate) per sequence."""
        return self.estimate(batch).values

    def estimate(self, batch: KLBatch) -> Estimate:
        if not isinstance(batch, KLBatch):
            raise ValueError(f"estimator {self.name!r} expects a KLBatch, got {type(batch).__name__}")
        if not self.supports_off_policy() and batch.is_off_policy:
            raise ValueError(
                f"estimator {self!r} assumes y ~ pi, but KLBatch.old_logp differs from logp (samples from a "
                "behaviour policy pi_old): use an estimator that corrects for it (in_reward, in_loss with "
                "ratio='token' or 'sequence', the rb gradient), or drop old_logp if the samples are on-policy")
        out = self.compute(batch)
        return out if isinstance(out, Estimate) else Estimate(out)

    def supports_off_policy(self) -> bool:
        return self.off_policy

    def compute(self, batch: KLBatch) -> torch.Tensor | Estimate:
        raise NotImplementedError

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"


def _check_option(name: str, key: str, value: Any) -> None:
    if key == "lam" and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ValueError(f"estimator {name!r}: lam must be a finite number, got {value!r}")
    if key == "level" and value not in ("token", "sequence"):
        raise ValueError(f"estimator {name!r}: level must be 'token' or 'sequence', got {value!r}")
    if key == "clamp" and value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"estimator {name!r}: clamp must be None or a positive number, got {value!r}")


def register(registry: dict[str, type[Estimator]]):
    def add(cls: type[Estimator]) -> type[Estimator]:
        registry[cls.name] = cls
        return cls
    return add


def _lookup(registry: dict[str, type[Estimator]], kind: str, name: str) -> type[Estimator]:
    if name not in registry:
        raise ValueError(f"unknown {kind} estimator {name!r}; valid names: {', '.join(registry)}")
    return registry[name]


def value_estimator(name: str, **options: Any) -> Estimator:
    """Build a value estimator: `est(batch) -> Tensor[B]`, a detached estimate of KL(pi || pi_ref) per sequence."""
    return _lookup(VALUE_ESTIMATORS, "value", name)(**options)


def gradient_estimator(name: str, **options: Any) -> Estimator:
    """Build a gradient estimator: `est(batch) -> Tensor[B]` surrogate; autograd of its mean is one gradient sample."""
    return _lookup(GRADIENT_ESTIMATORS, "gradient", name)(**options)


# ---- small tensor helpers shared by values and gradients ----

def seq_sum(x: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: inputs are already zero off the mask."""
    return x.sum(-1)


def reward_to_go(x: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: sum_{s >= t} x_s."""
    return x.flip(-1).cumsum(-1).flip(-1)


def prefix_weights(batch: KLBatch) -> torch.Tensor:
    """[B, T] detached W_<t = prod_{s<t} pi(y_s|y_<s) / pi_old(y_s|y_<s): the importance weight of the prefix that
    position t's exact KL depends on (exactly 1 on-policy); 1 past the mask, where kappa is 0."""
    log_w = batch.log_w.detach()  # [B, T], zero off the mask
    return torch.exp(log_w.cumsum(-1) - log_w)


def control_variate(batch: KLBatch, lam: float, level: str, clamp: float | None) -> Estimate:
    """rho + lam * (exp(-rho) - 1) per token or per sequence, summed to [B]; differentiable.

    Clamping (verl-style, on the estimate) happens only if asked, and every clamp that fires is counted.
    """
    rho = batch.rho  # [B, T], zero off the mask, so expm1(-0) = 0 adds nothing there
    if level == "token":
        terms, live = rho + lam * torch.expm1(-rho), batch.mask  # [B, T]
    else:
        r = seq_sum(rho)  # [B]
        terms, live = r + lam * torch.expm1(-r), torch.ones_like(r, dtype=torch.bool)
    n_clamped = None
    if clamp is not None:
        n_clamped = int(((terms.abs() > clamp) & live).sum())
        terms = terms.clamp(-clamp, clamp)
    return Estimate(seq_sum(terms) if level == "token" else terms, n_clamped)
