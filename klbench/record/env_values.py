"""KLBENCH_* environment values in seconds, parsed in one place: the CLI checks them with the config
(klbench.console.env_checks.check_environment), and the code that uses them reads them here. No imports beyond
the stdlib: klbench.record.interrupts reads one inside a signal handler's thread."""
from __future__ import annotations

import math
import os


class EnvError(ValueError):
    """A KLBENCH_* variable holds a value klbench cannot use; the message names it."""


def positive_seconds(var: str, default: float, what: str, zero_ok: bool = False) -> float:
    """$var as a number of seconds > 0 (>= 0 with zero_ok), `default` if unset or empty; EnvError naming it
    otherwise (0 and negative values included: taken silently, they meant "every step" or "at once", likely not
    what was meant)."""
    raw = os.environ.get(var, "").strip()
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or zero_ok and value == 0)):
        raise EnvError(f"{var}={raw!r}: expected {what}, a number {'>=' if zero_ok else '>'} 0 (unset: {default:g})")
    return value


STOP_TIMEOUT = "KLBENCH_STOP_TIMEOUT_S"
STOP_TIMEOUT_DEFAULT = 120.0  # a step, the ranks' barrier and the KILLED mark fit in it; SLURM's KillWait is 30 s


def stop_timeout() -> float:
    """How long a rank of a multi-process run may take to stop after SIGTERM or Ctrl-C before it ends itself
    (klbench.record.interrupts.watchdog)."""
    return positive_seconds(STOP_TIMEOUT, STOP_TIMEOUT_DEFAULT,
                            "the seconds a rank may take to stop after SIGTERM or Ctrl-C")
