"""Opening the record safely: the MLflow store and a sweep's Optuna storage, created under locks.

Where they live (the outputs folder, the tracking URI, sqlite:/// and file:// paths) is
klbench.record.store_paths, re-exported here; what state a store is in and its repair, klbench.record.store_repair.

A SQLite store is created or checked exactly once per process, under an inter-process file lock next to the
database: MLflow migrates a fresh database on first open, and parallel first opens race on that migration and
can leave it half-done. A sweep's SQLite
Optuna storage (optuna.db) is created under the same kind of lock (`open_optuna`).

A fresh store is a copy of an empty one: MLflow's chain of schema migrations (each step its own
transaction: most of a short run's record cost) runs once per machine and MLflow version, into a
template kept in the caller's cache folder (`template_dir`: a run passes paths.cache).

No torch, Lightning or Hydra here; MLflow loads only when a store has to be created.

    python -m klbench.record.store check  PATH/mlflow.db   # what state a store is in (klbench.record.store_repair)
    python -m klbench.record.store repair PATH/mlflow.db   # finish a migration an older klbench left half-done
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import sqlite3
import sys
from pathlib import Path
from urllib.parse import unquote

# callers reach the paths through this module (store.tracking_uri(), store.StoreError)
from klbench.record.store_paths import (OUTPUTS_ENV, StoreError, file_uri, outputs_dir, sqlite_path,  # noqa: F401
                                        sqlite_uri, tracking_uri)
from klbench.record.store_repair import _advice, inspect, main  # main: `python -m klbench.record.store check|repair`

LOCK_TIMEOUT_S = 300  # a first migration takes seconds; a lock held longer than this is a stuck process
_checked: set[str] = set()  # stores this process has already opened


def open_store(uri: str, create: bool = True, template_dir: str | os.PathLike | None = None) -> None:
    """Makes sure the store at `uri` is usable before MLflow touches it: created and migrated once under
    a file lock (with `template_dir`, copied from the migrated template there), or found current.
    Raises StoreError (path and a recovery command) otherwise.

    Server stores (http://, postgresql://) are the server's business and pass through unchecked.
    """
    path = sqlite_path(uri)
    logging.getLogger("mlflow.store.db.utils").addFilter(_raised_anyway)  # any database store, once
    if path is None and _file_store(uri):
        raise StoreError(f"MLFLOW_TRACKING_URI={uri} is a file store, which this MLflow ({_mlflow_version()}) "
                         "no longer writes; use a database: MLFLOW_TRACKING_URI="
                         f"{sqlite_uri(Path(_file_store(uri)).parent / 'mlflow.db')} (`mlflow migrate-filestore` "
                         "copies an existing file store into one)")
    if path is None or uri in _checked:
        return
    if not create:  # reading (klbench-pareto): no lock, nothing written, so a read-only store can be read
        state, detail = inspect(path)
        if state == "absent":
            raise StoreError(f"no MLflow store at {path} (set MLFLOW_TRACKING_URI or KLBENCH_OUTPUTS, "
                             "or pass --tracking-uri)")
        if state != "current":
            raise StoreError(_advice(path, state, detail))
        _checked.add(uri)
        return
    from filelock import FileLock, Timeout
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S)
        with lock:
            state, detail = inspect(path)
            if state in ("absent", "empty"):
                _create(uri, path, template_dir)
            elif state != "current":
                raise StoreError(_advice(path, state, detail))
    except Timeout:
        raise StoreError(f"waited {LOCK_TIMEOUT_S} s for the lock {path}.lock: another process is creating "
                         f"the MLflow store {path} and does not finish; if none is running, delete the lock "
                         "file") from None
    except OSError as e:  # read-only folder, a file where a folder should be, a full disk
        raise StoreError(f"cannot open the MLflow store {path}: {e.strerror or e}") from e
    _checked.add(uri)


def open_optuna(url: str) -> None:
    """A SQLite Optuna storage created once, under a file lock next to it, as the MLflow store is: Optuna
    creates its tables and stamps its schema version on first open, and two sweeps opening a fresh
    optuna.db at once race on that (sqlite3.IntegrityError on alembic_version, "table study_directions
    already exists"). Database servers (store=server) pass through: their storage is the server's business."""
    path = sqlite_path(url)
    if path is None or url in _checked:
        return
    from filelock import FileLock, Timeout
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{path}.lock", timeout=LOCK_TIMEOUT_S):
            from optuna.storages import RDBStorage
            RDBStorage(url).engine.dispose()  # creates the tables and stamps their version, or checks them
    except Timeout:
        raise StoreError(f"waited {LOCK_TIMEOUT_S} s for the lock {path}.lock: another process is creating "
                         f"the Optuna storage {path} and does not finish; if none is running, delete the lock "
                         "file") from None
    except OSError as e:  # read-only folder, a file where a folder should be, a full disk
        raise StoreError(f"cannot open the Optuna storage {path}: {e.strerror or e}") from e
    _checked.add(url)


def _file_store(uri: str) -> str | None:
    """The folder of an MLflow file store (`file:` URI or a bare path), else None."""
    if uri.startswith("file:"):
        return unquote(uri[len("file:"):].removeprefix("//")) or "."
    return uri if ":" not in uri and uri != "databricks" else None  # a bare path is MLflow's file store too


def _mlflow_version() -> str:
    from importlib.metadata import version
    return version("mlflow")


def ensure_experiment(tracking_uri: str, name: str, artifact_root: str | None,
                      template_dir: str | os.PathLike | None = None) -> str:
    """Opens the store (created once, under a lock; see open_store for `template_dir`) and returns the
    experiment's id, creating it if needed.
    New and existing experiments alike get klbench's tags (`klbench.record.experiments.tags_to_set`): the
    model-training kind and a description of what the experiment holds, neither over a person's choice."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from klbench.record.experiments import tags_to_set
    open_store(tracking_uri, template_dir=template_dir)
    client = mlflow.MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        location = None  # None: the tracking server's own artifact store
        if artifact_root is not None:
            os.makedirs(artifact_root, exist_ok=True)
            location = file_uri(Path(artifact_root) / name)
        try:
            return client.create_experiment(name, artifact_location=location, tags=tags_to_set(name, {}))
        except MlflowException:  # another process created it since we looked
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    for key, value in tags_to_set(name, exp.tags).items():  # an experiment from before these tags
        client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def _create(uri: str, path: Path, template_dir: str | os.PathLike | None = None) -> None:
    """Creating the SqlAlchemyStore runs MLflow's migration, or with `template_dir` only adds MLflow's
    Default experiment to a copy of the template; the caller holds the lock. A creation that fails midway
    (a full disk) is removed, so that the next attempt starts clean instead of finding a store that looks
    half-migrated or old."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    try:
        if template_dir is not None:
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                shutil.copyfile(_template(Path(template_dir)), tmp)
                os.replace(tmp, path)  # a copy cut short never looks like a store
            finally:
                tmp.unlink(missing_ok=True)
        SqlAlchemyStore(uri, file_uri(path.parent / "mlartifacts")).engine.dispose()
    except Exception as e:
        path.unlink(missing_ok=True)  # absent or empty before: nothing of anyone's is lost
        if type(e).__name__ == "CacheUnusable":  # the template's folder: its own one line (config.errors)
            raise
        cause = "the disk is full" if disk_full(e) else f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        raise StoreError(f"cannot create the MLflow store {path}: {cause} "
                         f"({shutil.disk_usage(path.parent).free // 1024} KiB free in {path.parent})") from e
    print(f"klbench: created the MLflow store {path}", file=sys.stderr)


def _template(folder: Path) -> Path:
    """<folder>/mlflow/empty-<MLflow version>.db: a migrated store without experiments (each copy gets its
    own Default experiment, whose artifact folder is next to that copy), made once under a lock."""
    import mlflow
    from filelock import FileLock
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    template = folder / "mlflow" / f"empty-{mlflow.__version__}.db"
    if template.is_file():
        return template
    lock = FileLock(f"{template}.lock", timeout=LOCK_TIMEOUT_S)
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as e:  # the cache is a file, or read-only: said as the cache's, not as the store's
        from klbench.config.errors import unusable
        raise unusable(str(folder), "hold the empty MLflow store every new store is copied from", e) from None
    with lock:  # held since the acquire above (a FileLock counts its acquisitions)
        if not template.is_file():
            tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            try:
                SqlAlchemyStore(sqlite_uri(tmp), file_uri(tmp.parent / "unused-artifacts")).engine.dispose()
                con = sqlite3.connect(tmp)
                try:
                    con.execute("DELETE FROM experiments")  # only the Default one: MLflow adds it on first open
                    con.commit()
                finally:
                    con.close()
                tmp.chmod(0o444)  # an MLflow client that opened it would add a Default experiment to every copy
                os.replace(tmp, template)
            finally:
                tmp.unlink(missing_ok=True)
    return template


def _raised_anyway(record: logging.LogRecord) -> bool:
    """MLflow logs each failed SQLite write with its traceback and then raises it: klbench's caller says
    it once, in one line (a full disk) or with the traceback of the exception it re-raises."""
    return not str(record.msg).startswith("SQLAlchemy database error")


def disk_full(e: BaseException | None) -> BaseException | None:
    """The link of `e`'s chain of causes that says the disk is full (an OSError, or SQLite's error as
    SQLAlchemy and MLflow wrap it), None where none does."""
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "database or disk is full" in str(e):
            return e
        e = e.__cause__ or e.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
