"""klbench-audit: which expected gradient does each installed RL library's own KL code follow?

  klbench-audit --all                 every setting of every pinned library (absent ones: skipped, with pip line)
  klbench-audit trl verl.kl_penalty.k3+
  klbench-audit --all --markdown docs/libraries.md
  klbench-audit --all --mlflow        also log the table as an artifact of an MLflow run
  klbench-audit --verdicts docs/verdicts.md   the verdicts on open proposals (klbench/exact/verdicts.py)
  klbench-audit --all --markdown docs/libraries.md --mismatch docs/mismatch.md   also the mismatch axis (issue 44)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from klbench.libraries import ALL

VERSIONS = "## Versions over time"
MISMATCH = "## Under a training-inference mismatch"


def _section(page: str, head: str) -> str:
    """The section of a generated page that starts at `head`, up to the next '## ' section ('' if absent)."""
    if head not in page:
        return ""
    body = page.split(head, 1)[1]
    return (head + body.split("\n## ", 1)[0]).strip("\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="klbench-audit", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"libraries ({', '.join(ALL)}) or settings (e.g. trl.grpo)")
    p.add_argument("--all", action="store_true", help="every library")
    p.add_argument("--markdown", metavar="PATH", help="also write the generated docs page here")
    p.add_argument("--mlflow", action="store_true",
                   help="log the table as an artifact of an MLflow run (default when MLFLOW_TRACKING_URI is set)")
    p.add_argument("--experiment", default="library-audit", help="MLflow experiment name (default library-audit)")
    p.add_argument("--verdicts", metavar="PATH", help="write the verdicts on open proposals (docs/verdicts.md) here")
    p.add_argument("--mismatch", metavar="PATH", help="write the mismatch-axis page (docs/mismatch.md) here; with "
                   "--markdown its table also goes into the libraries page")
    a = p.parse_args(argv)
    names = list(ALL) if a.all else a.names
    if not names and not a.verdicts and not a.mismatch:
        p.error("name a library or setting, or pass --all, --verdicts PATH or --mismatch PATH")
    for flag, path in (("--markdown", a.markdown), ("--verdicts", a.verdicts), ("--mismatch", a.mismatch)):
        if path and (why := _unwritable(path)):  # before the work: --mismatch computes for minutes (issue 50)
            print(f"klbench-audit: error: {flag} {path}: {why}; nothing was computed", file=sys.stderr)
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.verdicts:
        _verdicts(a.verdicts, with_claims=bool(a.mismatch))
    extra = _mismatch(a.mismatch) if a.mismatch else []
    if not names:
        return 0
    from klbench.libraries.audit import markdown, run, text_table

    start = time.perf_counter()
    try:
        cells = run(names)
    except ValueError as e:
        print(f"klbench-audit: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    table = text_table(cells)
    print(table)
    print(f"audit run time: {seconds:.1f} s")
    page = markdown(cells, seconds)
    if a.markdown:
        old = Path(a.markdown).read_text() if Path(a.markdown).exists() else ""
        # the mismatch columns (new, or kept when not rerun) and scripts/audit_versions.py's section (other
        # releases, other venvs: always kept) go before the relative errors
        added = ["\n".join(extra).strip("\n")] if extra else [_section(old, MISMATCH)]
        added.append(_section(old, VERSIONS))
        head, sep, tail = page.partition("\n## Relative errors")
        page = head.rstrip("\n") + "".join("\n\n" + x for x in added if x) + "\n" + sep + tail
        Path(a.markdown).write_text(page)
        print(f"wrote {a.markdown}")
    if a.mlflow or os.environ.get("MLFLOW_TRACKING_URI"):
        from klbench.console.messages import display_uri, mlflow_ui_lines
        rid, uri, exp_id = _log(table, page, seconds, a.experiment)
        print(f"MLflow run: {rid} in {display_uri(uri)}")
        for line in mlflow_ui_lines(uri, exp_id, rid):  # links open in the Model training view
            print(f"  {line}")
    return 0


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written as a page, or None."""
    p = Path(path).expanduser()
    folder = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        return "it is a folder; give a file path"
    if not folder.is_dir():
        return f"the folder {folder} does not exist" + (" (it is a file)" if folder.exists() else "")
    if not os.access(folder if not p.exists() else p, os.W_OK):
        return f"{p if p.exists() else folder} is not writable"
    return None


def _verdicts(path: str, with_claims: bool = False) -> None:
    """docs/verdicts.md: each verdict's exact audit, with the installed TRL's own sequence-level cell if TRL loads."""
    from klbench.exact import verdicts
    from klbench.libraries.audit import run

    start = time.perf_counter()
    quoted = {}
    cells = [c for c in run(["trl.grpo.sequence_is"]) if c.policy != "-"] if _loads("trl") else []
    if cells:
        quoted["trl.grpo.sequence_is"] = (cells[0].match, cells[1].match)
    vs = verdicts.run(quoted)
    page = verdicts.markdown(vs, time.perf_counter() - start)
    # issue 44's claims need the libraries' corrections on the mismatch axis (minutes): run with --mismatch, else the
    # section already in the page is kept
    from klbench.libraries import mismatch_verdicts
    old = Path(path).read_text() if Path(path).exists() else ""
    if with_claims:
        claims = mismatch_verdicts.run()
        page = page.rstrip("\n") + "\n\n" + "\n".join(mismatch_verdicts.markdown(claims))
        for c in claims:
            print(f"{c.title}: {({True: 'holds', False: 'does not hold', None: 'not decided here'})[c.holds]}")
    elif mismatch_verdicts.HEAD in old:
        page = page.rstrip("\n") + "\n\n" + mismatch_verdicts.HEAD + old.split(mismatch_verdicts.HEAD, 1)[1]
    Path(path).write_text(page)
    for v in vs:
        print(f"{v.title}: {'holds' if v.holds(v.results[len(v.results) - len(v.cases):]) else 'does not hold'}")
    print(f"wrote {path}")


def _mismatch(path: str) -> list[str]:
    """docs/mismatch.md; returns its library table for the libraries page."""
    from klbench.libraries import mismatch_report as mr

    start = time.perf_counter()
    rows, missing = mr.run()
    own = mr.own_rows()
    page = mr.markdown(rows, own, missing, time.perf_counter() - start)
    old = Path(path).read_text() if Path(path).exists() else ""
    Path(path).write_text(mr.keep_written(page, old))
    print(f"wrote {path}")
    return mr.compact(rows)


def _loads(name: str) -> bool:
    from klbench.libraries import LibraryMissing, load
    try:
        load(name)
        return True
    except LibraryMissing:
        return False


def _log(table: str, page: str, seconds: float, experiment: str) -> tuple[str, str, str]:
    """Logs the audit as a new run of `experiment`; returns (run id, tracking URI, experiment id)."""
    from mlflow import MlflowClient

    from klbench.record import store

    uri = store.tracking_uri()  # $MLFLOW_TRACKING_URI, else outputs/mlflow.db, as klbench runs
    root = str(store.outputs_dir() / "artifacts") if store.sqlite_path(uri) else None
    exp_id = store.ensure_experiment(uri, experiment, root)  # opens (or creates) the store
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(exp_id, run_name="klbench-audit")
    rid = run.info.run_id
    client.log_metric(rid, "audit_seconds", seconds)
    with tempfile.TemporaryDirectory() as d:
        for name, text in (("audit.txt", table), ("libraries.md", page)):
            (Path(d) / name).write_text(text)
            client.log_artifact(rid, str(Path(d) / name))
    client.set_terminated(rid)
    return rid, uri, exp_id


if __name__ == "__main__":
    sys.exit(main())
