#!/bin/bash
# Whole-process time of a short tabular run at two commits, interleaved (docs/console.md: start-up time).
#   bash scripts/startup_bench.sh BEFORE_REV [AFTER_REV=HEAD] [RUNS=5]
# Each commit is exported with `git archive` and put first on PYTHONPATH; the active venv provides the
# packages. WORKTREE as a rev is this checkout as it is, uncommitted changes included. Prints one line per
# run (wall and CPU seconds, load average before it) and the medians, then where the imports go at each
# commit: `python -X importtime` of the run's modules (the entry point and the training flow), cumulative
# seconds for the packages that dominate, the least of three ("-": the run does not import it).
set -euo pipefail
before=${1:?usage: bash scripts/startup_bench.sh BEFORE_REV [AFTER_REV] [RUNS]}
after=${2:-HEAD}
runs=${3:-5}
repo=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for v in before after; do
  rev=$([ $v = before ] && echo "$before" || echo "$after")
  if [ "$rev" = WORKTREE ]; then ln -s "$repo" "$work/$v"; continue; fi
  mkdir "$work/$v"
  git archive "$rev" | tar -x -C "$work/$v"
done
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
cd "$work"  # python -c puts the working directory first on sys.path: a checkout there would shadow both
for i in $(seq "$runs"); do
  for v in before after; do
    load=$(cut -d' ' -f1 /proc/loadavg)
    PYTHONPATH="$work/$v" KLBENCH_OUTPUTS="$work/out_$v" /usr/bin/time -f "%e %U %S" -o "$work/t" \
      python -c "from klbench.cli import main; main()" experiment=tabular task.max_steps=300 logger=none \
      >/dev/null 2>"$work/err"
    read -r wall user sys < "$work/t"
    echo "$v $i wall=$wall cpu=$(python -c "print(round($user + $sys, 2))") load1=$load" | tee -a "$work/results"
  done
done
python - "$work/results" <<'EOF'
import re, statistics, sys
rows = [re.match(r"(\w+) \d+ wall=([\d.]+) cpu=([\d.]+) load1=([\d.]+)", l).groups() for l in open(sys.argv[1])]
med = {v: (statistics.median(float(r[1]) for r in rows if r[0] == v),
           statistics.median(float(r[2]) for r in rows if r[0] == v)) for v in ("before", "after")}
for v, (w, c) in med.items():
    print(f"{v}: median wall {w:.1f} s, median CPU {c:.1f} s")
print(f"after/before: wall {med['after'][0] / med['before'][0]:.2f}, CPU {med['after'][1] / med['before'][1]:.2f}; "
      f"load average {min(float(r[3]) for r in rows):.1f} to {max(float(r[3]) for r in rows):.1f}")
EOF
for v in before after; do
  for i in 1 2 3; do
    PYTHONPATH="$work/$v" python -X importtime -c "import klbench.cli, klbench.tasks.train" 2>"$work/imp_${v}_$i"
  done
done
python - "$work" <<'EOF'
import re, sys
MODULES = ["torch", "torch._dynamo", "sympy", "lightning", "hydra", "omegaconf", "pydantic", "mlflow",
           "transformers", "klbench.cli", "klbench.tasks.train"]


def cumulative(path):
    out = {}
    for line in open(path):
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s*(\S+)$", line)
        if m:
            out[m[2]] = int(m[1]) / 1e6
    return out


runs = {v: [cumulative(f"{sys.argv[1]}/imp_{v}_{i}") for i in (1, 2, 3)] for v in ("before", "after")}
print(f"{'import (cumulative, s)':<24}{'before':>8}{'after':>8}")
for mod in MODULES:
    cells = []
    for v in ("before", "after"):
        seen = [r.get(mod) for r in runs[v]]
        cells.append("-" if None in seen else f"{min(seen):.2f}")
    print(f"{mod:<24}{cells[0]:>8}{cells[1]:>8}")
EOF
