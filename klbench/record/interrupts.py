"""Ctrl-C (SIGINT) and SIGTERM: which signal stopped klbench, so that the run or sweep ends KILLED and the
process exits with 128 + its number (130, 143), as a shell, SLURM or Kubernetes expects of a stopped job.

Python turns SIGINT into KeyboardInterrupt, which Lightning's Trainer turns into `sys.exit(1)`; Lightning
answers SIGTERM by stopping at the next step with SIGTERMException, a SystemExit with no code (exit 0).
Neither says which signal came. `install()` puts klbench's handler in first (the CLI's main, a sweep's
start): it notes the signal, and raises where nobody else will (outside Lightning's loops). Inside them
Lightning's own SIGTERM handler runs first and calls this one, which then only notes it: the training
stops at the next step boundary, as Lightning intends, not in the middle of a checkpoint or database write.

No torch, Lightning, MLflow or Hydra here: installed before they are imported.
"""
from __future__ import annotations

import signal
import sys

NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
received: int | None = None  # the first SIGINT or SIGTERM this process got
_early = False  # installed by the command before Hydra has called klbench's main: nothing to end yet


class Terminated(KeyboardInterrupt):
    """SIGTERM outside Lightning's loops. A KeyboardInterrupt, so that whatever treats Ctrl-C as a stop (and
    not as a failure: Hydra's job runner, the Optuna sweeper, Lightning) treats it alike."""


class Stopped(SystemExit):
    """A run or sweep stopped by `signum`: the process exits with 128 + signum, without a traceback.
    `run_id`: its MLflow run, `marked`: whether that run is marked KILLED (klbench.record.lifecycle)."""

    def __init__(self, signum: int, run_id: str | None = None, marked: bool = False):
        super().__init__(128 + signum)
        self.signum, self.run_id, self.marked = signum, run_id, marked


def install(early: bool = False) -> None:
    """klbench's handler for SIGINT and SIGTERM where Python's defaults are in place (main thread only;
    idempotent). Another handler is left as it is: submitit's in a SLURM trial, which lets SIGTERM pass so
    that its USR2 requeue works (docs/scale-out.md), and SIG_IGN, which `nohup` and the background jobs of a
    script start with."""
    import threading
    global _early
    _early = early
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in NAMES:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _handler)


def _handler(signum: int, frame) -> None:
    global received
    if received is None:
        received = signum
    if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is not _handler:
        return  # Lightning's handler called this one: it stops at the next step (SIGTERMException)
    if _early:  # Hydra is still loading or composing the config: no run folder, nothing recorded
        print(f"klbench: stopped by {name(signum)} while starting: nothing was run or recorded", file=sys.stderr)
        raise Stopped(signum)
    raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def signal_of(e: BaseException | None) -> int | None:
    """The signal that `e` stands for, or None when `e` is no interrupt (an error, a sys.exit of klbench's)."""
    if isinstance(e, Stopped):
        return e.signum
    if isinstance(e, KeyboardInterrupt):
        return received or signal.SIGINT
    if isinstance(e, SystemExit) and received is not None:
        return received  # Lightning's sys.exit(1) after Ctrl-C, its SIGTERMException
    if isinstance(e, SystemExit) and "lightning.pytorch" in sys.modules:
        from lightning.pytorch.utilities.exceptions import SIGTERMException
        if isinstance(e, SIGTERMException):  # SIGTERM reached Lightning without klbench's handler
            return signal.SIGTERM
    return None


def name(signum: int) -> str:
    return NAMES.get(signum) or signal.Signals(signum).name
