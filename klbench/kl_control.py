"""The `kl_ctl` group: the coefficient beta of reward - beta * KL(pi || pi_ref), fixed or adapted.

`fixed` keeps beta = estimator.beta for the whole run. `adaptive` is the proportional controller of
Ziegler et al. (2019), as verl (`kl_ctrl.type: adaptive`) and OpenRLHF (`--kl_target`) offer it:
users choose the KL they want instead of a beta, and after every step

    beta <- beta * (1 + clip(KL_est / target - 1, -clip, clip) * n / horizon)

where KL_est is a value estimate of the sequence KL(pi || pi_ref) on the step's own samples (the
`signal`) and n the number of sequences in the step. The update is multiplicative, so it acts on
log beta; it stops only where KL_est averages the target, so the mean KL has no steady offset, and
whatever noise the signal carries goes into beta.

Plain Python floats (no torch, no Lightning, no Hydra): the caller turns the batch into KL_est, and
the state is a small dict that the checkpoint carries, so a resumed run continues the same beta.
"""
from __future__ import annotations

import math

# labels of klbench.estimators.values.REPORTED that may drive the controller (klbench.schema lists them
# without importing torch; tests/test_kl_control.py keeps the two lists equal)
SIGNALS = ("mc", "k2", "k3", "cv_seq", "cv_opt", "rb")


class FixedKL:
    """beta never changes: today's runs, and distillation (beta = 1)."""

    name = "fixed"
    signal = None

    def __init__(self, beta: float):
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        self.beta = float(beta)

    def update(self, kl_est: float, n: int) -> float:
        return self.beta

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.name, state)  # beta stays the config's: a resume may change it on purpose


class AdaptiveKL:
    """Proportional controller on log beta towards a target sequence KL(pi || pi_ref), in nats."""

    name = "adaptive"

    def __init__(self, init_beta: float, target: float, horizon: float, clip: float = 0.2, signal: str = "rb"):
        for key, v in (("init_beta", init_beta), ("target", target), ("horizon", horizon), ("clip", clip)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"kl_ctl.{key} must be a finite number > 0, got {v!r}")
        if signal not in SIGNALS:
            raise ValueError(f"kl_ctl.signal={signal!r} is unknown; valid: {', '.join(SIGNALS)}")
        self.beta, self.target, self.horizon = float(init_beta), float(target), float(horizon)
        self.clip, self.signal = float(clip), signal

    def error(self, kl_est: float) -> float:
        """The clipped proportional error: a wild estimate (k1 can be far off, even negative) moves beta
        by at most `clip * n / horizon` per step."""
        return min(max(kl_est / self.target - 1.0, -self.clip), self.clip)

    def update(self, kl_est: float, n: int) -> float:
        """One step with KL_est (nats per sequence, mean over the step's n sequences); returns the new beta."""
        if not math.isfinite(kl_est):
            raise FloatingPointError(f"the KL signal {self.signal!r} is {kl_est}: beta cannot be adapted")
        factor = 1.0 + self.error(kl_est) * n / self.horizon
        if factor <= 0:  # beta would reach 0 and stay there (or flip sign): a step far larger than the horizon
            raise ValueError(f"kl_ctl: a step of {n} sequences against horizon {self.horizon:g} with clip "
                             f"{self.clip:g} can drive beta to 0; raise kl_ctl.horizon above {self.clip * n:g}")
        self.beta *= factor
        return self.beta

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.name, state)
        self.beta = float(state["beta"])


def _check_kind(name: str, state: dict) -> None:
    if state.get("name", name) != name:
        raise ValueError(f"the checkpoint's KL controller is {state.get('name')!r}, this run's is {name!r}")


def build_kl_control(cfg: dict | None, beta: float):
    """The `kl_ctl` group from its (resolved) config; `beta` is estimator.beta, the fixed coefficient.
    No config (a caller from before the group existed) means fixed."""
    cfg = dict(cfg or {"name": "fixed"})
    name = cfg.pop("name")
    if name == "fixed":
        return FixedKL(beta)
    if name == "adaptive":
        return AdaptiveKL(**cfg)
    raise ValueError(f"kl_ctl.name={name!r} is unknown; valid: fixed, adaptive")
