"""What state a SQLite MLflow store is in, what to do about each bad state, and the repair of a store whose
migration was left half-done; the command line of both:

    python -m klbench.record.store check  PATH/mlflow.db   # what state a store is in
    python -m klbench.record.store repair PATH/mlflow.db   # finish a migration an older klbench left half-done

(klbench.record.store runs main() here.) MLflow loads only to compare schema revisions or to rebuild a store.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from urllib.parse import quote

from klbench.record.store_paths import StoreError, file_uri, sqlite_uri


def inspect(path: Path) -> tuple[str, str]:
    """(state, detail), state one of absent, empty, current, old, newer, half-migrated, corrupt.
    Read-only, with a short busy timeout, and without MLflow's retry loop."""
    if not path.exists():
        return "absent", ""
    if not path.is_file():
        raise StoreError(f"the MLflow store {path} is not a file")
    try:
        con = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True, timeout=10)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            versions = [r[0] for r in con.execute("SELECT version_num FROM alembic_version")] \
                if "alembic_version" in tables else []
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        return "corrupt", str(e)
    if not tables:
        return "empty", ""
    stray = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if stray or len(versions) != 1 or "runs" not in tables:
        return "half-migrated", (f"leftover tables {stray}; " if stray else "") + f"schema versions {versions}"
    head, known = _revisions()
    if versions[0] == head:
        return "current", head
    if versions[0] in known:
        return "old", f"schema {versions[0]}, this MLflow needs {head}"
    return "newer", f"schema {versions[0]} is unknown to this MLflow (its newest is {head})"


def _advice(path: Path, state: str, detail: str) -> str:
    uri = sqlite_uri(path)
    fix = {
        "corrupt": f"it is not a SQLite database ({detail}). Move it aside to start a new store: mv {path} {path}.corrupt",
        "half-migrated": f"a schema migration was left half-done ({detail}): the process creating or upgrading "
                         f"it stopped midway (older klbench versions did when several runs started at once). "
                         f"Recover with: python -m klbench.record.store repair {path}",
        "old": f"it was made by an older MLflow ({detail}). Back it up, then: mlflow db upgrade {uri}",
        "newer": f"it was made by a newer MLflow ({detail}). Upgrade MLflow, or use another store",
    }[state]
    return f"MLflow store {path}: {fix}"


def _revisions() -> tuple[str, set[str]]:
    """The newest MLflow schema revision and every revision before it."""
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config
    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    (head,) = script.get_heads()
    return head, {rev.revision for rev in script.walk_revisions()}


def repair(path: Path) -> str:
    """Rebuilds a half-migrated store: a fresh store of the current schema, into which every row of the
    old one is copied (table by table, the columns both have; a table caught mid-copy by the failed
    migration is read from its `_alembic_tmp_` twin). The original is kept as a backup. Re-running the
    migration instead is not safe: MLflow's steps are not idempotent."""
    state, detail = inspect(path)
    if state != "half-migrated":
        return f"{path} is {state}: nothing to repair"
    backup = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.bak")
    shutil.copy2(path, backup)
    fresh = path.with_name(path.name + ".rebuilt")
    fresh.unlink(missing_ok=True)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    SqlAlchemyStore(sqlite_uri(fresh), file_uri(path.parent / "mlartifacts")).engine.dispose()
    con = sqlite3.connect(fresh)
    try:
        con.execute("ATTACH DATABASE ? AS old", (str(backup),))
        old = {r[0] for r in con.execute("SELECT name FROM old.sqlite_master WHERE type='table'")}
        new = [r[0] for r in con.execute("SELECT name FROM main.sqlite_master WHERE type='table'")]
        for table in new:
            src = table if table in old else f"_alembic_tmp_{table}"
            if table == "alembic_version" or src not in old:
                continue
            have = {r[1] for r in con.execute(f'PRAGMA old.table_info("{src}")')}
            cols = ", ".join(f'"{r[1]}"' for r in con.execute(f'PRAGMA main.table_info("{table}")') if r[1] in have)
            con.execute(f'INSERT OR REPLACE INTO main."{table}" ({cols}) SELECT {cols} FROM old."{src}"')
        con.commit()
        n_runs = con.execute("SELECT count(*) FROM main.runs").fetchone()[0]
    finally:
        con.close()
    os.replace(fresh, path)
    if inspect(path)[0] != "current":
        raise StoreError(f"repair left {path} unusable; the original is kept at {backup}")
    return f"repaired {path} ({detail}): {n_runs} runs kept; the original is kept at {backup}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("check", "repair"):
        print("usage: python -m klbench.record.store check|repair PATH/mlflow.db", file=sys.stderr)
        return 2
    path = Path(args[1]).resolve()
    try:
        if args[0] == "check":
            state, detail = inspect(path)
            print(f"{path}: {state}" + (f" ({detail})" if detail else ""))
            return 0 if state in ("current", "absent", "empty") else 1
        print(repair(path))
        return 0
    except StoreError as e:
        print(f"klbench.record.store: error: {e}", file=sys.stderr)
        return 1
