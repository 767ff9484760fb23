"""What the MLflow record costs a short run: logger=mlflow against logger=none, whole process, interleaved
(docs/running.md, "Speed").

    python scripts/bench_record_cost.py [--runs 5] [--rev REV ...] [-- OVERRIDE ...]
    python scripts/bench_record_cost.py --rev HEAD --rev WORKTREE      # before/after a change, one session

Each run gets a fresh outputs folder, so logger=mlflow creates its store (mlflow.db) every time, as a first
run in a new folder does. The default run is `experiment=tabular task.max_steps=300`; overrides after `--`
replace it. `--rev` (repeatable; default the working tree, WORKTREE) runs a commit exported with
`git archive`, first on PYTHONPATH, with this venv's packages; OMP_NUM_THREADS=1. KLBENCH_CACHE is a folder
of this bench's own, shared by every run of a rev: one untimed run per rev first fills it (the embedded models, the migrated
template of an empty MLflow store), as a machine's first run would. Prints each run (wall and CPU seconds,
the load average before it), the medians and the ratio mlflow/none per rev.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUN = ["experiment=tabular", "task.max_steps=300"]
ENTRY = "from klbench.cli import main; main()"


def export(rev: str, into: Path) -> Path:
    """The code of `rev` (WORKTREE: this checkout as it is) in a folder to put first on PYTHONPATH."""
    if rev == "WORKTREE":
        return ROOT
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run(code: Path, overrides: list[str], logger: str, work: Path, cache: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one whole klbench process in a fresh outputs folder."""
    outputs = Path(tempfile.mkdtemp(dir=work, prefix="out-"))
    # one OpenMP thread, as scripts/startup_bench.sh: on a busy machine spinning threads make CPU time meaningless
    env = {**os.environ, "PYTHONPATH": str(code), "KLBENCH_OUTPUTS": str(outputs), "KLBENCH_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)  # the store is the outputs folder's own
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # the working directory is not the checkout: `python -c` puts it first on sys.path, where it would shadow `code`
    proc = subprocess.run([sys.executable, "-c", ENTRY, *overrides, f"logger={logger}"], cwd=work, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"bench_record_cost: klbench logger={logger} failed (exit {proc.returncode}):\n"
                 + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    shutil.rmtree(outputs, ignore_errors=True)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1:] if "--" in argv else DEFAULT_RUN
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="timed runs per (rev, logger) (default 5)")
    p.add_argument("--rev", action="append", help="a commit to measure (repeatable; default WORKTREE)")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.runs < 1:
        sys.exit("bench_record_cost: --runs must be >= 1")
    revs = a.rev or ["WORKTREE"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the running klbench is killed, the folder removed
    with tempfile.TemporaryDirectory(prefix="klbench-record-cost-") as tmp:
        work = Path(tmp)
        code = {rev: export(rev, work / f"code-{i}") for i, rev in enumerate(revs)}
        cache = {rev: work / f"cache-{i}" for i, rev in enumerate(revs)}
        print(f"run: klbench {' '.join(overrides)} logger=none|mlflow, a fresh outputs folder each time; "
              f"{os.cpu_count()} cores", flush=True)
        for rev in revs:  # untimed: fills the rev's cache as a machine's first run would
            run(code[rev], overrides, "mlflow", work, cache[rev])
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for i in range(1, a.runs + 1):
            for rev in revs:
                for logger in (("none", "mlflow") if i % 2 else ("mlflow", "none")):
                    load = os.getloadavg()[0]
                    wall, cpu = run(code[rev], overrides, logger, work, cache[rev])
                    times.setdefault((rev, logger), []).append((wall, cpu))
                    print(f"{rev} logger={logger} run {i}: wall {wall:.2f} s, CPU {cpu:.2f} s, load1 {load:.2f}",
                          flush=True)
    print()
    for rev in revs:
        med = {lg: (statistics.median(w for w, _ in times[rev, lg]), statistics.median(c for _, c in times[rev, lg]))
               for lg in ("none", "mlflow")}
        print(f"{rev}: median wall none {med['none'][0]:.2f} s, mlflow {med['mlflow'][0]:.2f} s, "
              f"mlflow/none {med['mlflow'][0] / med['none'][0]:.2f}; median CPU none {med['none'][1]:.2f} s, "
              f"mlflow {med['mlflow'][1]:.2f} s, mlflow/none {med['mlflow'][1] / med['none'][1]:.2f}")
    print("load average (1, 5, 15 min) at the end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
