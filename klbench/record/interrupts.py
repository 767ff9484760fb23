"""Ctrl-C (SIGINT) and SIGTERM: which signal stopped klbench, so that the run or sweep ends KILLED and the
process exits with 128 + its number (130, 143), as a shell, SLURM or Kubernetes expects of a stopped job.

Python turns SIGINT into KeyboardInterrupt, which Lightning's Trainer turns into `sys.exit(1)`; Lightning
answers SIGTERM by stopping at the next step with SIGTERMException, a SystemExit with no code (exit 0).
Neither says which signal came. `install()` puts klbench's handler in first (the CLI's main, a sweep's
start): it notes the signal, and raises where nobody else will (outside Lightning's loops). Inside them
Lightning's own SIGTERM handler runs first and calls this one, which then only notes it: the training
stops at the next step boundary, as Lightning intends, not in the middle of a checkpoint or database write.

Nor is it raised inside a database write (MLflow's or Optuna's): the signal comes again a moment later,
once the write is done (`_defer`). No torch, Lightning, MLflow or Hydra here: installed before they are imported.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}
received: int | None = None  # the first SIGINT or SIGTERM this process got
_early = False  # installed by the command before Hydra has called klbench's main: nothing to end yet
# A raise inside a database write can leave SQLite's write lock held by a closed connection (release()
# below): the handler never raises inside these packages, but sends the signal again DEFER_S later, for at
# most DEFER_MAX_S (a store that hangs must not make Ctrl-C hang too)
STORE_CODE = tuple(os.sep + p + os.sep for p in ("sqlalchemy", "sqlite3", "alembic", os.path.join("mlflow", "store"),
                                                 os.path.join("optuna", "storages")))
DEFER_S, DEFER_MAX_S = 0.05, 5.0
_deferred_since: float | None = None


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
    global _early
    _early = early
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in NAMES:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _handler)


def _handler(signum: int, frame) -> None:
    global received, _deferred_since
    if received is None:
        received = signum
        if _ranks() > 1:  # a rank stuck in a collective never gets back to Python: bounded (issue 50)
            watchdog(signum)
    if signum == signal.SIGTERM and signal.getsignal(signal.SIGTERM) is not _handler:
        return  # Lightning's handler called this one: it stops at the next step (SIGTERMException)
    if _early:  # Hydra is still loading or composing the config: no run folder, nothing recorded
        print(f"klbench: stopped by {name(signum)} while starting: nothing was run or recorded", file=sys.stderr)
        raise Stopped(signum)
    if _in_store_write(frame) and _defer(signum):
        return
    _deferred_since = None
    raise _interrupt(signum)


def _interrupt(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def _in_store_write(frame) -> bool:
    while frame is not None:
        if any(p in frame.f_code.co_filename for p in STORE_CODE):
            return True
        frame = frame.f_back
    return False


def _defer(signum: int) -> bool:
    """Sends `signum` to this process again in DEFER_S; False once it has been put off for DEFER_MAX_S."""
    global _deferred_since
    now = time.monotonic()
    _deferred_since = _deferred_since or now
    if now - _deferred_since > DEFER_MAX_S:
        return False
    again = threading.Timer(DEFER_S, os.kill, (os.getpid(), signum))
    again.daemon = True  # never holds up the process's exit
    again.start()
    return True


def raise_noted() -> None:
    """Raises the interrupt for a signal this process noted and nobody acted on: Lightning lets a SIGTERM pass
    once a run's last step is done (its final validation, its checkpoint), and the run ends FINISHED. Called where
    a sweep would start its next trial in this process (basic launcher), so the sweep stops there."""
    if received is not None:
        raise _interrupt(received)


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


def release(e: BaseException) -> None:
    """Frees what the interrupted code still holds through `e`'s traceback (and the exceptions chained to it),
    before the run or sweep is marked KILLED. An interrupt raised inside a store write leaves that write's
    cursor in a frame of the traceback. SQLAlchemy closes the interrupted connection, but SQLite keeps a closed
    connection alive, with its write lock, until its statements are freed: the KILLED mark then waited on its
    own process for MLflow's 20 s and failed with 'database is locked' (issue 34, under load)."""
    import gc
    import traceback
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # frames still executing (the caller's) are left as they are
        e = e.__cause__ or e.__context__
    gc.collect()  # the cursor and its statement may sit in a reference cycle


# ---- a stop that does not end: a rank stuck in a collective (issue 50) ----

_on_stuck: list = []  # what to do before the process ends itself: klbench.record.lifecycle marks the run KILLED
_stop_done = threading.Event()


def _ranks() -> int:
    """The process group's size where one is up (torch imported and initialised), else 1."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else 1
    except Exception:  # noqa: BLE001 - a signal handler must not fail on torch's state
        return 1


def stop_timeout() -> float:
    from klbench.record.env_values import STOP_TIMEOUT_DEFAULT, stop_timeout as read
    try:
        return read()
    except ValueError:  # refused by the CLI at start; a rank started otherwise keeps the default
        return STOP_TIMEOUT_DEFAULT


def watchdog(signum: int, timeout: float | None = None, end=os._exit) -> threading.Thread:
    """A rank of a multi-process run (ddp, fsdp) got `signum`: if the process has not ended `timeout` seconds later
    (a rank blocked in a collective that its peers never join: Python's handlers and Lightning's stop never run
    there, and the job held its allocation until its time limit), the run is marked KILLED (_on_stuck), one line
    says why, and the process ends with 128 + signum. A daemon thread: a process that ends sooner ends it."""
    timeout = stop_timeout() if timeout is None else timeout

    def wait() -> None:
        if _stop_done.wait(timeout):
            return
        for mark in list(_on_stuck):
            try:
                mark(signum)
            except Exception:  # noqa: BLE001 - ending the process matters more than the mark
                pass
        print(f"klbench: stopped by {name(signum)}, but this rank had not ended {timeout:g} s later (blocked in a "
              "collective its peers never joined): ending it now (KLBENCH_STOP_TIMEOUT_S)", file=sys.stderr,
              flush=True)
        end(128 + signum)
    thread = threading.Thread(target=wait, name="klbench-stop-watchdog", daemon=True)
    thread.start()
    return thread


def stop_finished() -> None:
    """The stop ended (the process is about to exit): the watchdog has nothing left to do."""
    _stop_done.set()


def name(signum: int) -> str:
    return NAMES.get(signum) or signal.Signals(signum).name
