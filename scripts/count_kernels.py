"""The kernels a run launches on tensors big enough for torch to run them in parallel, counted: this checkout's
default run against an older commit's (docs/scale.md, "The default run against 4229a51").

    python scripts/count_kernels.py                                  # this checkout against 4229a51
    python scripts/count_kernels.py --args model.scoring_path=logits # the new side with an override

Why count: with a second process holding a core, each parallel kernel waits for the thread the scheduler has put
aside, so a run's time under load follows how many such kernels it launches, and the scheduler's luck; timing
pairs then spread 0.9-2x. The count is the same every time. A kernel counts when a floating-point output or any
input holds at least 32,768 elements (torch's grain for a parallel loop on the CPU); views, slices, detaches and
dtype no-ops are left out (they launch no loop). Counted by a TorchDispatchMode around the whole run, in process;
CPU backward runs on the calling thread, so the backward's kernels are in the count. Each side runs in a process of
its own (the old side: a git worktree of --old first on PYTHONPATH, as bench_default_run.py makes it).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAIN = 32768  # at::internal::GRAIN_SIZE: a loop over fewer elements runs on one thread
NO_LOOP = {"view", "_unsafe_view", "slice", "select", "detach", "unsqueeze", "squeeze", "transpose", "t", "expand",
           "reshape", "permute", "alias", "as_strided", "split", "unbind", "narrow", "empty", "empty_like",
           "lift_fresh", "to", "_to_copy", "clone"}


def count(args: list[str]) -> dict[str, int]:
    """In this process: klbench's main with `args` under a dispatch mode; kernel name -> launches."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            name = func.overloadpacket.__name__
            o = out[0] if isinstance(out, (tuple, list)) and out else out
            big = isinstance(o, torch.Tensor) and o.dtype.is_floating_point and o.numel() >= GRAIN
            if name not in NO_LOOP and (big or any(isinstance(x, torch.Tensor) and x.numel() >= GRAIN for x in a)):
                counts[name] += 1
            return out

    from klbench.cli import main as klbench_main
    sys.argv = ["klbench", *args]
    with Count():
        try:
            klbench_main()
        except SystemExit as e:
            if e.code:
                raise
    return dict(counts)


def side(code: Path | None, args: list[str], work: Path) -> dict[str, int]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    work.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, __file__, "_count", json.dumps(args)], env=env, cwd=work,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"count_kernels: the run failed: {r.stderr.strip()[-800:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["_count"]:
        print(json.dumps(count(json.loads(sys.argv[2]))))
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_default_run import worktree
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="4229a51", help="the older commit (default 4229a51)")
    p.add_argument("--steps", type=int, default=30, help="task.max_steps of each run (default 30)")
    p.add_argument("--args", nargs="*", default=[], help="more overrides for the new side")
    p.add_argument("--work", default="outputs/.bench-default", help="the worktree and the runs' folders")
    a = p.parse_args()
    work = Path(a.work).resolve()
    base = [f"task.max_steps={a.steps}", f"task.val_every={a.steps}", "logger=none"]
    new = side(None, base + a.args, work / "count-new")
    old = side(worktree(a.old, work), base, work / "count-old")
    n, o = sum(new.values()), sum(old.values())
    print(f"parallel-size kernels, the default run ({a.steps} steps): new {n:,}, old ({a.old}) {o:,}, "
          f"new/old {n / o:.3f}" + (f" (new with {' '.join(a.args)})" if a.args else ""))
    diff = sorted(((new.get(k, 0) - old.get(k, 0), k) for k in set(new) | set(old)), key=lambda d: -abs(d[0]))
    print("largest differences (new - old): " + ", ".join(f"{k} {d:+d}" for d, k in diff[:12] if d))


if __name__ == "__main__":
    main()
