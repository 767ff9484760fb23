"""How a recorded run starts, commits and ends: one helper, `recorded_run`, for every task that keeps an
MLflow record (training and the probe).

- A run is RUNNING while it works, FINISHED only when its task's block completes (for training: after
  its last step and final validation), FAILED (error in the `klbench.error` tag) on an exception, KILLED
  when interrupted (Ctrl-C, SIGTERM, a requeue; after a signal, klbench.record.interrupts.Stopped carries
  on) or, for `kill -9`, when something notices its process is gone (klbench.record.runs.reap).
  Lightning does not set the status: its loggers finalise the run after the step-0 `validate()`.
- Metrics computed before a failure are committed: they show how the run failed. When the store itself
  stopped taking the record (its server does not answer, its disk is full), the run is marked FAILED in
  one quick try and RecordUnavailable says so.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from klbench.record import interrupts, store
from klbench.record.redact import redact
from klbench.record.tracking import RecordLogger, build_logger

RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"  # read by MLflow at every request


class Record:
    """A run's record as its task sees it. `logger` is what klbench.record.tracking.build_logger returned
    (a RecordLogger, a CSVLogger, or False), for Lightning's Trainer; the methods act on an MLflow record
    only, and do nothing for the other loggers and on DDP ranks other than zero."""

    def __init__(self, logger):
        self.logger = logger
        self.mlflow = isinstance(logger, RecordLogger)

    def commit(self, steps_done: int, metrics: dict[str, float] | None = None, step: int = 0) -> None:
        """Writes the pending metrics (with `metrics` at `step` added) and says `steps_done` steps are done."""
        if not self.mlflow:
            return
        if metrics:
            self.logger.log_metrics(metrics, step=step)
        self.logger.commit(steps_done)

    def attach(self, paths: list[str]) -> None:
        """Files become the run's artifacts."""
        if self.mlflow and self.logger.client is not None:
            for path in paths:
                self.logger.client.log_artifact(self.logger.run_id, path)


@contextmanager
def recorded_run(cfg: DictConfig, resume: bool = False, pending: list[list] | None = None) -> Iterator[Record]:
    """Starts the run's record (a new MLflow run, or with `resume` the run folder's own, back to RUNNING),
    adds the metrics a checkpoint carried (`pending`), and ends it when the block ends: FINISHED when it
    completes, FAILED or KILLED as `recorded` says when it does not."""
    logger = build_logger(cfg, resume=resume)
    if pending and isinstance(logger, RecordLogger):
        logger.restore(pending)
    with recorded(logger):
        yield Record(logger)
        if isinstance(logger, RecordLogger):
            logger.end("FINISHED")


@contextmanager
def recorded(logger):
    """Ends the MLflow run FAILED (error tagged) on an exception, KILLED on an interrupt, and re-raises.
    Metrics computed before a failure are committed: they show how the run failed."""
    if not isinstance(logger, RecordLogger):
        yield
        return

    def stuck(signum: int) -> None:  # a rank blocked after a signal ends itself (interrupts.watchdog): KILLED first
        _end_quietly(logger, "KILLED", f"interrupted: {interrupts.name(signum)}; the ranks did not stop in time "
                     "(blocked in a collective)", commit=False, retries=0)
    interrupts._on_stuck.append(stuck)
    try:
        yield
    except Exception as e:
        if logger.client is not None and (why := store_failure(e, logger.client.tracking_uri)):
            # one quick try to say FAILED: another round of MLflow's minutes of retries helps nobody
            marked = _end_quietly(logger, "FAILED", why, commit=False, retries=0, say=False)
            raise RecordUnavailable(why, logger.run_id, marked) from e
        _end_quietly(logger, "FAILED", f"{type(e).__name__}: {e}", commit=True)
        raise
    except BaseException as e:  # KeyboardInterrupt, SystemExit (SIGTERM, a requeue): it may resume
        sig = interrupts.signal_of(e)
        why = f"interrupted: {interrupts.name(sig)}" if sig else f"interrupted: {type(e).__name__} {e}".strip()
        interrupts.release(e)
        marked = _end_quietly(logger, "KILLED", why, commit=False)
        if sig:  # the CLI says where the run is and how to resume it, and exits 128 + sig
            raise interrupts.Stopped(sig, logger.run_id, marked) from e
        raise
    finally:
        interrupts._on_stuck.remove(stuck)


class RecordUnavailable(RuntimeError):
    """The store stopped taking the run's record (its server does not answer, its disk is full).
    The CLI says so in one line, with whether the run is marked FAILED and the command that resumes it."""

    def __init__(self, why: str, run_id: str, marked: bool):
        super().__init__(why)
        self.why, self.run_id, self.marked = why, run_id, marked


def store_failure(e: BaseException, tracking_uri: str) -> str | None:
    """What made the record unwritable, in words; None when `e` is another failure. Looks down the chain
    of causes: MLflow wraps the connection error, SQLAlchemy the SQLite one."""
    if (full := store.disk_full(e)) is not None:
        if isinstance(full, OSError):  # a checkpoint, an artifact
            where = full.filename2 or full.filename or "the run folder"
        else:  # SQLite's
            where = store.sqlite_path(tracking_uri) or "the store"
        return f"the disk is full (writing {where}; {_free(where)})"
    seen: BaseException | None = e
    while seen is not None:
        text = str(seen)
        if "API request to" in text and ("Max retries exceeded" in text or "onnection" in text):
            return f"the MLflow server {redact(tracking_uri)} does not answer"
        seen = seen.__cause__ or seen.__context__
    return None


def _free(path) -> str:
    for p in (path, *Path(path).parents):
        if os.path.exists(p):
            return f"{shutil.disk_usage(p).free // 1024} KiB free there"
    return "free space unknown"


def _end_quietly(logger: RecordLogger, status: str, why: str, commit: bool, retries: int | None = None,
                 say: bool = True) -> bool:
    """Ends the run with `status`; False (and, if `say`, one line, no traceback) when the store refuses."""
    old = os.environ.get(RETRIES_ENV)
    if retries is not None:
        os.environ[RETRIES_ENV] = str(retries)
    try:
        if commit:
            logger.commit()
        logger.end(status, why)
        return True
    except Exception as e:  # the store itself may be what failed; the original error matters more
        if say:
            logging.getLogger(__name__).error("could not mark MLflow run %s %s: %s", logger.run_id, status,
                                              str(e).splitlines()[0][:300] if str(e) else type(e).__name__)
        return False
    finally:
        if retries is not None and old is None:
            del os.environ[RETRIES_ENV]
        elif retries is not None:
            os.environ[RETRIES_ENV] = old
