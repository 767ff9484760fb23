"""A run whose reader went away (`klbench ... | head -1`, a closed ssh pipe) keeps training (issue 50).

Python ignores SIGPIPE, so the first print after the reader closed its end raised BrokenPipeError: a traceback
at the first line, rc 1, a run folder holding only Hydra's files. The run is worth more than its console: from
the first write that finds the pipe closed, that stream's output is dropped (its file descriptor pointed at
/dev/null, so that flushes at exit and C-level writes pass too) and the run goes on, logging to its klbench.log
and MLflow as before, with one warning there that says so. A closed pipe is not a stop signal: who wants the
run stopped sends SIGTERM or Ctrl-C (klbench.record.interrupts).
"""
from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("klbench.console")


class Guarded:
    """`stream` (sys.stdout or sys.stderr) with writes that survive a closed reader."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name, self.lost = stream, name, False

    def _gone(self) -> None:
        if self.lost:
            return
        self.lost = True
        try:
            fd = self._stream.fileno()
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)  # what is still buffered, and every later write, goes nowhere instead of failing
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass
        log.warning("klbench: the reader of %s went away (a closed pipe, e.g. `| head`); the run goes on, "
                    "its console output dropped, logging to klbench.log and MLflow", self._name)

    def write(self, text: str) -> int:
        if self.lost:
            return len(text)
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        if self.lost:
            try:
                self._stream.flush()  # into /dev/null now
            except (BrokenPipeError, ValueError):
                pass
            return
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard() -> None:
    """Wraps sys.stdout and sys.stderr once (the `klbench` command, before Hydra sets up its log handlers)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Guarded):
            setattr(sys, name, Guarded(stream, name))
