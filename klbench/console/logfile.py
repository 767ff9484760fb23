"""The run folder's `klbench.log` holds everything the console showed, with times.

Hydra's job logging gives the root logger a FileHandler on `<run folder>/klbench.log`, and log records reach
it with their time. What is printed without a logger (the run's summary, the frontier tables, where the
results are, warnings, an error's last line) goes to stdout and stderr only: `copy_console` wraps both so
that each line is also written to that file, after the time it was printed, through the FileHandler's own
stream (in order with the records). A progress bar's redraws (`\\r`) leave its last state; colour codes go.

Log records are not copied twice: Hydra's console handler holds the stdout it was configured with, not
the wrapper. No torch, Lightning or MLflow imports here.
"""
from __future__ import annotations

import logging
import os
import re
import sys
import time

from klbench.record.redact import redact

LOG_NAME = "klbench.log"  # hydra.job.name (conf/config.yaml) + .log
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def log_handler() -> logging.FileHandler | None:
    """The root logger's FileHandler on a klbench.log (Hydra's job logging), or None outside a Hydra job."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.FileHandler) and os.path.basename(h.baseFilename) == LOG_NAME:
            return h
    return None


def stamp(now: float | None = None) -> str:
    """The time as Hydra's log lines give it: `2026-11-23 18:03:28,123`."""
    now = time.time() if now is None else now
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now % 1 * 1000):03d}"


class _Copy:
    """A stdout or stderr that also writes each finished line, timed, into `handler`'s file."""

    def __init__(self, stream, handler: logging.FileHandler, label: str):
        self.stream, self.handler, self.label, self.partial = stream, handler, label, ""

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        self.partial += text
        *lines, rest = self.partial.split("\n")
        self.partial = rest.rsplit("\r", 1)[-1]  # a bar redraws its line: only its last state is kept
        if lines:
            self._log(lines)
        return n

    def _log(self, lines: list[str]) -> None:
        when = stamp()
        text = "".join(f"[{when}][{self.label}] {redact(line)}\n" if line.strip() else "\n"
                       for line in (_ANSI.sub("", raw.rsplit("\r", 1)[-1]) for raw in lines))
        self.handler.acquire()
        try:
            if self.handler.stream is not None:  # closed at interpreter exit, or by _lost
                self.handler.stream.write(text)
                self.handler.stream.flush()
        except OSError as e:  # raised from a print, it would replace whatever the print was saying
            _lost(self.handler, e)
        finally:
            self.handler.release()

    def flush(self) -> None:
        self.stream.flush()

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):  # isatty, fileno, encoding, buffer, ...: the console's own
        return getattr(self.stream, name)


def _lost(handler: logging.FileHandler, e: OSError) -> None:
    """klbench.log cannot be written (its disk is full): it stops, saying so once on the console, which
    still shows everything. Left alone, each later log record would print logging's own traceback."""
    if handler.level > logging.CRITICAL:  # already stopped
        return
    handler.setLevel(logging.CRITICAL + 1)  # not removed: logging may be going through the handlers now
    try:
        handler.close()  # flushes what it holds, which may fail the same way; the file is closed either way
    except OSError:
        pass
    print(f"klbench: warning: {handler.baseFilename} is no longer written ({e.strerror or e}); "
          "the console still shows everything", file=sys.stderr)


def _on_file_error(handler: logging.FileHandler, default):
    """A FileHandler's handleError: an OSError stops the file (_lost); anything else is logging's own."""
    def handle_error(record: logging.LogRecord) -> None:
        e = sys.exc_info()[1]
        if isinstance(e, OSError):
            _lost(handler, e)
        else:
            default(record)
    return handle_error


def copy_console() -> bool:
    """From now on, what this process prints is also in the run folder's klbench.log; False (nothing done)
    outside a Hydra job, and when already copying. Idempotent; `stop_copy` undoes it."""
    handler = log_handler()
    if handler is None or isinstance(sys.stdout, _Copy):
        return False
    handler.handleError = _on_file_error(handler, handler.handleError)
    sys.stdout = _Copy(sys.stdout, handler, "stdout")
    sys.stderr = _Copy(sys.stderr, handler, "stderr")
    return True


def stop_copy() -> None:
    """Back to the plain console (a sweep's trial ends: the next trial, in this process, has its own file)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Copy):
            if stream.partial.strip():  # a last line without its newline
                stream._log([stream.partial])
            setattr(sys, name, stream.stream)
