"""The default run against an older commit's, as interleaved pairs of whole processes (docs/scale.md, "The default
run against 4229a51"); and, with --peer, the TRL peer job's klbench/TRL ratio on each side (scripts/bench_trl_peer.py).

    python scripts/bench_default_run.py                         # 3 pairs: this checkout against 4229a51
    python scripts/bench_default_run.py --old 4229a51 --pairs 5 --busy 1   # with a second process spinning
    python scripts/bench_default_run.py --pairs 1 --steps 4     # a quick check that both sides run
    python scripts/bench_default_run.py --peer --peer-pairs 3   # and the TRL peer job on each side

The job: `klbench task.max_steps=STEPS task.val_every=STEPS logger=none` (the embedded LM, rb, 8 prompts x 4
samples x 24 tokens; the reference LM cached once beforehand, outside the timing), run from a folder of its own.
The old side runs the older commit's code from a git worktree (made once under --work) with the same venv:
PYTHONPATH puts the worktree's klbench first, and it reads its own conf/. Each pair runs both sides, in
alternating order (new first in odd pairs), each timed start to exit; the CPU time (user + system) and the peak
RSS come from the kernel (os.wait4). Printed per pair and as medians: new/old wall, CPU and training time (the
"N steps in X s" line, start-up excluded), each side's val/reward and val/seq_kl (the same seed: they should
match where the two commits draw the same samples), and the load average around each pair.

--busy K runs K processes that spin on the CPU for the whole measurement (a second process on a laptop or a
shared node). --peer runs scripts/bench_trl_peer.py once per side (--peer-pairs pairs of klbench and TRL, the old
side with the worktree first on PYTHONPATH) and prints both klbench/TRL medians and their ratio: TRL's time is
the common yardstick, so the ratio of the two medians is new/old on the peer job.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worktree(rev: str, work: Path) -> Path:
    """A git worktree of `rev` under work (made once)."""
    path = work / f"old-{rev}"
    if not (path / "klbench").is_dir():
        r = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_default_run: git worktree add {path} {rev} failed: {r.stderr.strip()}")
    return path


def run(side: str, code: Path | None, steps: int, work: Path, tag: str) -> dict:
    """One default run as a whole process: wall, CPU (user + system), peak RSS, the training time and the summary."""
    cwd = work / tag
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if code is not None:  # the old side: its klbench before the editable install's
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [str(Path(sys.executable).with_name("klbench")), f"task.max_steps={steps}", f"task.val_every={steps}",
           "logger=none"]
    log = cwd / "out.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out = log.read_text()
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"bench_default_run: the {side} run failed; {log} ends:\n" + "\n".join(out.splitlines()[-20:]))
    train = re.search(r"klbench: \d+ steps in ([0-9.]+) s", out)
    metric = {k: re.search(rf"^val/{k}\s+\S+\s+(\S+)", out, re.M) for k in ("reward", "seq_kl")}
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss / 1024,
            "train": float(train[1]) if train else float("nan"),
            **{k: (m[1] if m else "?") for k, m in metric.items()}}


def spin() -> None:
    while True:
        pass


def peer(code: Path | None, pairs: int, work: Path, trl_python: str | None) -> float:
    """scripts/bench_trl_peer.py on one side: its median klbench/TRL wall-time ratio."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_trl_peer.py"), "--pairs", str(pairs),
           "--work", str(work / "peer")] + (["--trl-python", trl_python] if trl_python else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print(r.stdout, end="", flush=True)
    m = re.search(r"median wall-time ratio klbench/TRL: ([0-9.]+)", r.stdout)
    if r.returncode or not m:
        sys.exit(f"bench_default_run: bench_trl_peer.py failed: {(r.stderr or r.stdout).strip()[-600:]}")
    return float(m[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="4229a51", help="the older commit (default 4229a51)")
    p.add_argument("--pairs", type=int, default=3, help="interleaved (new, old) pairs (default 3)")
    p.add_argument("--steps", type=int, default=30, help="task.max_steps of each run (default 30)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile (default 0)")
    p.add_argument("--work", default="outputs/.bench-default", help="the worktree, the runs' folders and logs")
    p.add_argument("--peer", action="store_true", help="the TRL peer job on each side too (bench_trl_peer.py)")
    p.add_argument("--peer-pairs", type=int, default=3, help="bench_trl_peer.py's --pairs (default 3)")
    p.add_argument("--trl-python", help="passed to bench_trl_peer.py")
    a = p.parse_args()
    if a.pairs < 1 or a.steps < 1 or a.busy < 0:
        sys.exit("bench_default_run: --pairs and --steps must be >= 1, --busy >= 0")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    old = worktree(a.old, work)
    new_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    print(f"new: {ROOT} at {new_rev}{' (with uncommitted changes)' if dirty else ''}; old: {a.old} ({old})")
    print(f"job: klbench task.max_steps={a.steps} task.val_every={a.steps} logger=none; {os.cpu_count()} cores; "
          f"{a.busy} spinning process(es)", flush=True)
    run("new", None, 1, work, "warm-new")  # the embedded LM built and cached once, outside the timing
    import multiprocessing
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(a.busy)]
    for s in spinners:
        s.start()
    rows = []
    try:
        for i in range(1, a.pairs + 1):
            before = "{:.2f}".format(os.getloadavg()[0])
            sides = {}
            for side in (("new", "old") if i % 2 else ("old", "new")):
                sides[side] = run(side, old if side == "old" else None, a.steps, work, f"pair{i}-{side}")
            n, o = sides["new"], sides["old"]
            rows.append((n, o))
            print(f"pair {i}: new {n['wall']:.1f} s wall, {n['cpu']:.1f} s CPU, {n['train']:.1f} s training, "
                  f"{n['rss']:.0f} MiB; old {o['wall']:.1f} s, {o['cpu']:.1f} s, {o['train']:.1f} s, {o['rss']:.0f} MiB; "
                  f"new/old wall {n['wall'] / o['wall']:.2f}, CPU {n['cpu'] / o['cpu']:.2f}, training "
                  f"{n['train'] / o['train'] if o['train'] else float('nan'):.2f}; val/reward {n['reward']} vs {o['reward']}, val/seq_kl "
                  f"{n['seq_kl']} vs {o['seq_kl']}; load {before} -> {os.getloadavg()[0]:.2f}", flush=True)
    finally:
        for s in spinners:
            s.terminate()
    for key, name in (("wall", "wall"), ("cpu", "CPU"), ("train", "training")):
        r = [n[key] / o[key] for n, o in rows]
        print(f"median new/old {name}: {statistics.median(r):.2f} (pairs: {', '.join(f'{x:.2f}' for x in r)})")
    if a.peer:
        k_new = peer(None, a.peer_pairs, work, a.trl_python)
        k_old = peer(old, a.peer_pairs, work, a.trl_python)
        print(f"peer job klbench/TRL: new {k_new:.2f}, old {k_old:.2f}; new/old {k_new / k_old:.2f}")


if __name__ == "__main__":
    main()
