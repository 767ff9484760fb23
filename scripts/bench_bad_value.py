"""Benchmark: wall time from the command to the error for a bad config value or an option that does not exist
(target: well under 2 s; the figures: docs/record.md).

    python scripts/bench_bad_value.py [--repeats 7]

Runs `klbench <overrides>` as a new process for each bad input, several times, and prints the median
wall time with the machine it ran on. Take it while nothing else heavy runs.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

BAD = [["estimator.beta=nan"], ["task.max_steps=0"], ["hardware.precision=garbage"], ["seed=abc"],
       ["+estimator.lam=0.5"],
       ["experiment=tabualr"], ["-m", "sweep=rl_betaa", "experiment=tabular"]]  # unknown options (issue 32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "KLBENCH_OUTPUTS": f"{tmp}/outputs", "HF_HUB_OFFLINE": "1"}
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
        for overrides in BAD:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, "-m", "klbench.cli", *overrides], cwd=tmp, env=env,
                                      capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
                assert proc.returncode == 1 and "klbench: error:" in proc.stderr, proc.stderr[-500:]
            print(f"{' '.join(overrides):<40} median {statistics.median(times):.2f} s  (min {min(times):.2f}, "
                  f"max {max(times):.2f}, n={args.repeats})")


if __name__ == "__main__":
    main()
