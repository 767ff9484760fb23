"""The KLBENCH_* environment variables that take a value klbench parses, checked by the CLI with the config
(klbench.cli.check: before torch is imported, no run folder, no MLflow run), so that a typo is one line naming
the variable at once, not a traceback 40 s into a run that MLflow then shows FAILED (issue 50).

The other KLBENCH_* variables are paths (KLBENCH_CACHE, KLBENCH_OUTPUTS: said where they are used, naming the
variable), flags read as on/off (KLBENCH_VERBOSE), or set by klbench itself for a sweep's trials; the sweep's
KLBENCH_OPTUNA_RETRY_S is checked where the sweep starts (klbench.sweep.storage.retry_budget)."""
from __future__ import annotations

from klbench.record.env_values import EnvError, positive_seconds, stop_timeout

__all__ = ["EnvError", "PROGRESS_SECONDS", "progress_seconds", "check_environment"]

PROGRESS_SECONDS = "KLBENCH_PROGRESS_SECONDS"
PROGRESS_DEFAULT = 60.0


def progress_seconds() -> float:
    """$KLBENCH_PROGRESS_SECONDS (the longest wait between two progress lines), a number > 0; 60 if unset or empty.
    0 or a negative value was taken as "a line every step" without a word: refused as the typo it likely is."""
    return positive_seconds(PROGRESS_SECONDS, PROGRESS_DEFAULT,
                            "the longest wait in seconds between two progress lines")


def check_environment() -> None:
    """EnvError for the first KLBENCH_* variable whose value klbench cannot use."""
    progress_seconds()
    stop_timeout()  # KLBENCH_STOP_TIMEOUT_S
