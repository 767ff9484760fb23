#!/bin/bash
# Whole-process time of a short tabular run at two commits, interleaved (docs/console.md: start-up time).
#   bash scripts/startup_bench.sh BEFORE_REV [AFTER_REV=HEAD] [RUNS=5]
# Each commit is exported with `git archive` and put first on PYTHONPATH; the active venv provides the
# packages. Prints one line per run (wall and CPU seconds, load average before it) and the medians.
set -euo pipefail
before=${1:?usage: bash scripts/startup_bench.sh BEFORE_REV [AFTER_REV] [RUNS]}
after=${2:-HEAD}
runs=${3:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for v in before after; do
  mkdir "$work/$v"
  git archive "$([ $v = before ] && echo "$before" || echo "$after")" | tar -x -C "$work/$v"
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
