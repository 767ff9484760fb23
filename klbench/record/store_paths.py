"""Where the record lives: the outputs folder and the store URIs, for every command (runs, sweeps,
`klbench-pareto`, `klbench-distill-report`). Pure path arithmetic: nothing is opened or created here
(klbench.record.store opens the stores; callers reach these names through it).
"""
from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

OUTPUTS_ENV = "KLBENCH_OUTPUTS"
SQLITE = "sqlite:///"


class StoreError(RuntimeError):
    """The tracking store cannot be used as it is; the message names the path and what to do."""


def outputs_dir() -> Path:
    """$KLBENCH_OUTPUTS, else ./outputs: everything a run writes."""
    return Path(os.environ.get(OUTPUTS_ENV) or Path.cwd() / "outputs").resolve()


def tracking_uri(outputs: str | Path | None = None) -> str:
    """$MLFLOW_TRACKING_URI (a relative SQLite path made absolute: the `mlflow ui` command klbench prints
    works from any folder), else the SQLite store in the outputs folder."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        path = sqlite_path(uri)
        return sqlite_uri(path, "MLFLOW_TRACKING_URI") if path is not None and not path.is_absolute() else uri
    return sqlite_uri(Path(outputs or outputs_dir()) / "mlflow.db")


# Paths in store URIs. SQLAlchemy (MLflow's and Optuna's SQLite stores) reads the path of sqlite:/// as
# it is, but for '?' (a query starts) and '%' (it percent-decodes); MLflow creates the store's parent folder
# from the URI undecoded (3.17.2, mlflow.store.db.utils._make_parent_dirs_if_sqlite), so an escaped '%3F'
# or '%25' would leave a folder of that name beside the outputs folder: such paths are refused, in one
# line. MLflow's file:// artifact locations are percent-encoded, which MLflow decodes: unescaped, '#' cut
# the location short (artifacts landed outside the outputs folder) and a quote broke the SQL that MLflow
# writes its Default experiment with.
UNSAFE = "?%"


def sqlite_uri(path: str | os.PathLike, setting: str = OUTPUTS_ENV) -> str:
    """sqlite:////<absolute path>; StoreError naming `setting` for a path holding '?' or '%'."""
    path = os.path.abspath(path)
    if bad := sorted({c for c in path if c in UNSAFE}):
        raise StoreError(f"{setting}: the path {path} holds {' and '.join(map(repr, bad))}, which MLflow cannot "
                         "take in a SQLite store's path: choose a folder whose path holds no '?' and no '%'")
    return SQLITE + path


def file_uri(path: str | os.PathLike) -> str:
    """file:///<absolute path>, percent-encoded (MLflow decodes it to the path)."""
    return Path(os.path.abspath(path)).as_uri()


def sqlite_path(uri: str) -> Path | None:
    """The file a sqlite:/// URI names, as SQLAlchemy decodes it (the query after '?' is not the path)."""
    return Path(unquote(uri[len(SQLITE):].split("?", 1)[0])) if uri.startswith(SQLITE) else None
