"""The `kl_ctl` group: the coefficient beta of reward - beta * KL(pi || pi_ref), fixed or adapted.

`fixed` keeps beta = estimator.beta for the whole run. `adaptive` holds a target KL instead (users choose
the KL they want, as with verl's `kl_ctrl.type: adaptive` and OpenRLHF's `--kl_target`): after every step,
with e = clip(KL_est / target - 1, -clip, clip),

    beta_i <- beta_i * (1 + e * m / horizon)        (integral part: m = 1 a step, or n sequences)
    beta   <- beta_i * exp(kp * e)                  (proportional part)

a PI controller on log beta. KL_est is a value estimate of the sequence KL(pi || pi_ref) on the step's own
samples (the `signal`) and n the number of sequences in the step. The integral part alone (kp = 0,
horizon_unit = sequences) is the proportional controller of Ziegler et al. (2019), klbench's controller
before issue 18; it stops only where the clipped error averages 0, so the held KL has no steady offset. Alone it
rings against the policy's lag (docs/kl-control.md derives why and when); the proportional part damps it.
The horizon counts steps by default because the policy's lag does: an optimiser step moves the policy by
about the same amount whatever the batch size.

Plain Python floats (no torch, no Lightning, no Hydra): the caller turns the batch into KL_est, and
the state is a small dict that the checkpoint carries, so a resumed run continues the same beta. The options,
their bounds and defaults are kl_ctl=adaptive's (klbench.config.training.KLCtlAdaptive), read from there.
"""
from __future__ import annotations

import math

from klbench.config.training import HORIZON_UNITS, KLCtlAdaptive
from klbench.estimators.options import REPORTED_VALUES

# the value estimators klbench reports (train/kl_<label>): any of them may drive the controller
SIGNALS = tuple(REPORTED_VALUES)
_DEFAULT = {k: f.default for k, f in KLCtlAdaptive.model_fields.items() if not f.is_required()}


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
    """PI controller on log beta towards a target sequence KL(pi || pi_ref), in nats."""

    name = "adaptive"

    # defaults: kl_ctl=adaptive's (KLCtlAdaptive); kp=0, horizon_unit="sequences" is the controller before issue 18
    def __init__(self, init_beta: float, target: float = _DEFAULT["target"], horizon: float = _DEFAULT["horizon"],
                 clip: float = _DEFAULT["clip"], signal: str = _DEFAULT["signal"], kp: float = _DEFAULT["kp"],
                 horizon_unit: str = _DEFAULT["horizon_unit"]):
        for key, v in (("init_beta", init_beta), ("target", target), ("horizon", horizon), ("clip", clip)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"kl_ctl.{key} must be a finite number > 0, got {v!r}")
        if not (isinstance(kp, (int, float)) and math.isfinite(kp) and kp >= 0):
            raise ValueError(f"kl_ctl.kp must be a finite number >= 0, got {kp!r}")
        if signal not in SIGNALS:
            raise ValueError(f"kl_ctl.signal={signal!r} is unknown; valid: {', '.join(SIGNALS)}")
        if horizon_unit not in HORIZON_UNITS:
            raise ValueError(f"kl_ctl.horizon_unit={horizon_unit!r} is unknown; valid: {', '.join(HORIZON_UNITS)}")
        self.target, self.horizon, self.horizon_unit = float(target), float(horizon), horizon_unit
        self.clip, self.signal, self.kp = float(clip), signal, float(kp)
        self.beta = self.beta_i = float(init_beta)  # beta_i: the integral part, beta without the kp term

    def error(self, kl_est: float) -> float:
        """The clipped relative error: a wild estimate (k1 can be far off, even negative) moves beta_i by
        at most `clip * m / horizon` a step and beta by at most exp(kp * clip) around beta_i."""
        return min(max(kl_est / self.target - 1.0, -self.clip), self.clip)

    def update(self, kl_est: float, n: int) -> float:
        """One step with KL_est (nats per sequence, mean over the step's n sequences); returns the new beta."""
        if not math.isfinite(kl_est):
            raise FloatingPointError(f"the KL signal {self.signal!r} is {kl_est}: beta cannot be adapted")
        e = self.error(kl_est)
        m = n if self.horizon_unit == "sequences" else 1
        factor = 1.0 + e * m / self.horizon
        if factor <= 0:  # beta would reach 0 and stay there (or flip sign): a step far larger than the horizon
            raise ValueError(f"kl_ctl: a step of {m} {self.horizon_unit} against horizon {self.horizon:g} with "
                             f"clip {self.clip:g} can drive beta to 0; raise kl_ctl.horizon above {self.clip * m:g}")
        self.beta_i *= factor
        self.beta = self.beta_i * math.exp(self.kp * e)
        return self.beta

    def state_dict(self) -> dict:
        return {"name": self.name, "beta": self.beta, "beta_i": self.beta_i}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(self.name, state)
        self.beta = float(state["beta"])
        # checkpoints from before issue 18 hold beta alone: that controller was its integral part
        self.beta_i = float(state.get("beta_i", self.beta))


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
