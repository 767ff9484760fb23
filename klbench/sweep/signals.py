"""submitit's requeue signal, kept out of database writes.

submitit's handler ends the process with SystemExit wherever the signal lands. Inside an MLflow
SQLite write, that leaves the transaction holding the database lock; Lightning's logger.finalize
then waits on the lock until MLflow gives up, and the trial fails instead of being requeued.
"""
from __future__ import annotations

import os


def requeue_outside_database() -> None:
    """Delays submitit's requeue signal while the trial is inside database code (in a trial's process)."""
    import signal
    import threading
    sig = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
    submitit_handler = signal.getsignal(sig)
    if not callable(submitit_handler):
        return

    def handler(signum, frame):
        f = frame
        while f is not None:
            if f.f_globals.get("__name__", "").startswith(("sqlalchemy", "mlflow.store")):
                threading.Timer(0.05, os.kill, (os.getpid(), signum)).start()  # ask again shortly
                return
            f = f.f_back
        submitit_handler(signum, frame)

    signal.signal(sig, handler)
