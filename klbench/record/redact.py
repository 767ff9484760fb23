"""Passwords out of everything klbench writes: the record, checkpoints, run folders and the console.

A store URL may carry a password: `postgresql+psycopg://klbench:PASSWORD@db/klbench`,
`http://user:PASSWORD@mlflow-host:5000`, `...?password=PASSWORD`. The process that connects gets the URL
as given; whatever klbench writes or prints goes through `redact`, which keeps the URL readable with
`***` in place of the password. Better still, keep the password out of the config altogether: a URL
without one, and libpq's PGPASSWORD / PGPASSFILE / ~/.pgpass (docs/scale-out.md).

What klbench does not write itself is covered here too: `RedactHydraFiles` (a Hydra callback in
conf/config.yaml) rewrites the files Hydra saves in every run folder (.hydra/*.yaml) and a sweep's
multirun.yaml, and `redact_logs` redacts every log record and warning of the process (Hydra's,
Optuna's, the sweeper plugin's `Storage: ...` line, klbench.log).

Stdlib only (and omegaconf, inside the callback): the console and the schema's neighbours use it early.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

MASK = "***"
# scheme://user:password@ ; Hydra's overrides escape the colons (http\://user\:password@), so a backslash
# may precede them, and a URL taken for a path loses a slash (os.path.abspath: https:/user:password@), so
# one to three slashes. The password stops at '@' (URLs percent-encode one inside a password), and at a
# quote, whitespace or bracket, so that a URL inside YAML, a Python repr or a log line is cut at its end.
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*\\?:/{1,3}[^\s/:@'\"<>\[\]]*\\?:)[^\s@'\"<>\[\]]+@")
# ?password=... (libpq and SQLAlchemy take the password as a query parameter too), and key=value strings
_PARAM = re.compile(r"(?i)(?P<head>\b(?:password|passwd|pwd)=)[^\s&;'\"#\[\]]+")


def redact(text: str) -> str:
    """`text` with every password in a URL replaced by ***; the rest, user and host included, unchanged."""
    return _PARAM.sub(rf"\g<head>{MASK}", _USERINFO.sub(rf"\g<head>{MASK}@", text))


def has_secret(text: str) -> bool:
    return redact(text) != text


def redact_obj(obj: Any) -> Any:
    """A copy of a JSON-like value (dicts, lists, tuples, strings) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


def redact_exception(e: BaseException | None) -> None:
    """Rewrites, in place, the text of `e` and of every exception chained to it (cause and context) that
    carries a password, so that a traceback printed or written afterwards (Hydra's, Python's, a log
    record's) shows it as ***. An exception's text is what its traceback shows of the values involved."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
        if isinstance(e, OSError):  # its text is made of errno, strerror and the file names
            for attr in ("strerror", "filename", "filename2"):
                if isinstance(getattr(e, attr), str):
                    setattr(e, attr, redact(getattr(e, attr)))
        if any(isinstance(a, str) and has_secret(a) for a in e.args) or has_secret(str(e)):
            e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
            if has_secret(str(e)):  # a text made of something other than args
                e.args = (redact(str(e)),)
        if notes := getattr(e, "__notes__", None):
            e.__notes__ = [redact(n) for n in notes]


def redact_file(path: Path) -> bool:
    """Rewrites a text file redacted, atomically (a reader sees the old file or the new one). True if changed."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    clean = redact(text)
    if clean == text:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.redact")
    tmp.write_text(clean, encoding="utf-8")
    os.replace(tmp, path)
    return True


# ---- log records ----

def redact_logs() -> None:
    """Every log record this process makes from now on is redacted, whatever its logger and handlers:
    a record factory, because Hydra replaces the handlers at every job and libraries add their own."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "_klbench_redact", False):
        return

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging reports it where it handles the record
            return record
        if has_secret(message):
            record.msg, record.args = redact(message), None
        if record.exc_info and record.exc_info[0] is not None:
            text = logging.Formatter().formatException(record.exc_info)
            if has_secret(text):
                record.exc_text = redact(text)  # formatters print exc_text when it is set
        return record

    factory._klbench_redact = True
    logging.setLogRecordFactory(factory)
    # warnings print without logging (e.g. Hydra's "Callback ... raised MlflowException: API request to <url>")
    format_warning = warnings.formatwarning
    warnings.formatwarning = lambda *args, **kwargs: redact(format_warning(*args, **kwargs))


# ---- Hydra's own files ----

def _select(config, key: str) -> str:
    from omegaconf import OmegaConf
    try:
        return str(OmegaConf.select(config, key, default="") or "")
    except Exception:  # an interpolation that cannot resolve here: the run reports it where it needs it
        return ""


class RedactHydraFiles:
    """Hydra callback (conf/config.yaml, every run and sweep). Hydra saves .hydra/config.yaml, hydra.yaml
    and overrides.yaml just before on_job_start (hydra.core.utils.run_job), and the basic sweeper its
    multirun.yaml after on_multirun_start; a password given on the command line is in them. Each hook
    rewrites what is there by then, redacted, and installs the log redaction in its process.

    A plain class, not Hydra's Callback, so that importing this module imports no Hydra; it defines
    every hook Hydra calls. Holds nothing: submitit pickles it into every trial."""

    @staticmethod
    def _here() -> None:
        redact_logs()
        # with a tracking server MLflow prints "View run ... at: <tracking URI>" when a run ends: after the
        # run's last lines, a second link to the page klbench's own line opens in the model-training view
        # (klbench.console.messages), and with the login in it where the URI has one
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"

    def _warn_command_line(self, config, sweep: bool) -> None:
        from omegaconf import OmegaConf
        given = [o for part in ("task", "hydra")
                 for o in (OmegaConf.select(config, f"hydra.overrides.{part}", default=None) or []) if has_secret(o)]
        if given:
            where = ("your shell history, the launcher's job files (.submitit/) and the Optuna trials' attributes "
                     "keep it" if sweep else "your shell history keeps it")
            logging.getLogger(__name__).warning(
                "a password on the command line (%s): klbench records it nowhere, but %s. Give the URL without "
                "it and the password in ~/.pgpass, $PGPASSFILE or $PGPASSWORD (docs/scale-out.md)",
                " ".join(redact(o) for o in given), where)

    def _sweep_files(self, config) -> None:
        sweep_dir = _select(config, "hydra.sweep.dir")
        if sweep_dir:
            for path in (Path(sweep_dir) / "multirun.yaml", *sorted((Path(sweep_dir) / ".hydra").glob("*.yaml"))):
                if path.is_file():
                    redact_file(path)

    def _job_files(self, config) -> None:
        out, sub = _select(config, "hydra.runtime.output_dir"), _select(config, "hydra.output_subdir")
        if out and sub:
            for path in sorted((Path(out) / sub).glob("*.yaml")):
                redact_file(path)

    def on_run_start(self, config, **kwargs) -> None:
        self._here()
        self._warn_command_line(config, sweep=False)

    def on_run_end(self, config, **kwargs) -> None:
        self._job_files(config)

    def on_multirun_start(self, config, **kwargs) -> None:
        self._here()
        self._warn_command_line(config, sweep=True)
        self._sweep_files(config)

    def on_multirun_end(self, config, **kwargs) -> None:
        self._sweep_files(config)

    def on_job_start(self, config, **kwargs) -> None:
        self._here()
        self._job_files(config)
        if "MULTIRUN" in _select(config, "hydra.mode"):  # reading hydra.sweep.dir in a single run claims a folder
            self._sweep_files(config)  # the basic sweeper's multirun.yaml exists by the first job

    def on_job_end(self, config, **kwargs) -> None:
        self._job_files(config)
