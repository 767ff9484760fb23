"""Does the sampler's mismatch bend the frontier? Each real mismatch of task.sampler (a bf16 engine for a float32
trainer, eager attention against the trainer's sdpa, a lag of 2 optimiser steps) against none, with rb, loo and seq,
rb with task.behaviour=sampler (the engine's log-probs as the behaviour policy) and =scorer (the trainer's: the
mismatch hidden from the KL term), rb/sampler with the reward term corrected too (+pg: task.pg_correction.mode=
sequence_truncate), over seeds. Each run is a klbench subprocess (logger=csv); the final val/reward
and val/seq_kl (the trainer's KL(pi || pi_ref), from the trainer's own samples; exact on tabular) of each are read
from its metrics.csv, with the run's mean train/mismatch_k1 and train/mismatch_chi2.

    python scripts/mismatch_study.py --model embedded --steps 40 --seeds 0 1 2 --out outputs/mismatch_study
    python scripts/mismatch_study.py --model tabular --steps 60 --seeds 0 1 2 --out outputs/mismatch_study
    python scripts/mismatch_study.py --plot-only --out outputs/mismatch_study --png docs/img/mismatch_frontier.png
      (--plot-only rebuilds <out>/<model>_runs.csv from the run folders: a study stopped early is read as far as it got)

Writes <out>/<model>_runs.csv (one row per run), <out>/<model>_arms.csv (per arm: mean and 95% t-interval over the
seeds) and, with --png, the plot of final reward against KL(pi || pi_ref), one point per arm with both intervals.
loo and seq assume y ~ pi, so with an engine they run behaviour=scorer only (klbench refuses behaviour=sampler
for them in one line).
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = {"none": [], "lag2": ["task.sampler.lag=2"], "bf16": ["task.sampler.precision=bf16"],
           "eager": ["task.sampler.attn_implementation=eager"]}
ESTIMATORS = {"rb/sampler": ["estimator=rb", "task.behaviour=sampler"],
              "rb/scorer": ["estimator=rb", "task.behaviour=scorer"],
              "loo/scorer": ["estimator=loo", "task.behaviour=scorer"],
              "seq/scorer": ["estimator=seq", "task.behaviour=scorer"]}
MODELS = {"embedded": [], "tabular": ["experiment=tabular"]}
# the PG correction of the +pg arms (klbench/estimators/pg_correction.py): pi / pi_s over the sequence, capped at 3
# (TRL's clip_max), whose expected gradient is grad E_pi[R] exactly while no weight reaches the cap
PG = ["task.pg_correction.mode=sequence_truncate"]


def arms(model: str, engines: list[str]) -> list[tuple[str, list[str]]]:
    """(name, overrides): without an engine behaviour has nothing to choose (one arm per estimator); eager
    attention is a language model's (rb only: its gap is the smallest); tabular has no attention."""
    out = []
    for engine, eo in ENGINES.items():
        if engine not in engines or engine == "eager" and model == "tabular":
            continue
        for est, so in ESTIMATORS.items():
            if engine == "none" and est == "rb/scorer" or engine == "eager" and not est.startswith("rb"):
                continue
            name = f"{engine} {est.split('/')[0] if engine == 'none' else est}"
            out.append((name, MODELS[model] + eo + so))
            if engine != "none" and est == "rb/sampler":  # the reward term corrected too: sequence-level weights
                out.append((f"{name}+pg", MODELS[model] + eo + so + PG))
    return out


def final_metrics(folder: Path) -> dict[str, float]:
    rows = list(csv.DictReader(open(next(folder.rglob("metrics.csv")))))
    last = lambda key: next(float(r[key]) for r in reversed(rows) if r.get(key))  # noqa: E731
    mean = lambda key: statistics.fmean(float(r[key]) for r in rows if r.get(key))  # noqa: E731
    out = {"val_reward": last("val/reward"), "val_seq_kl": last("val/seq_kl")}
    if any(r.get("val/frontier_gap") for r in rows):  # tabular: the exact distance below the optimal frontier
        out["val_frontier_gap"] = last("val/frontier_gap")
    for key in ("train/mismatch_k1", "train/mismatch_chi2"):
        out[key.split("/")[1]] = mean(key) if any(r.get(key) for r in rows) else 0.0
    return out


def run(model: str, steps: int, seeds: list[int], out: Path, engines: list[str], extra: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{model}_runs.csv"
    done = {(r["arm"], r["seed"]) for r in csv.DictReader(open(path))} if path.exists() else set()
    # one thread a run: on a shared 2-core machine torch's own threads fight the other processes' (docs/embedded.md)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for seed in seeds:  # seeds outermost: a study stopped early still has every arm at the first seeds
        for name, over in arms(model, engines):
            if (name, str(seed)) in done:
                continue
            folder = out / "runs" / model / f"{name.replace(' ', '_').replace('/', '-')}_s{seed}"
            cmd = [sys.executable, "-m", "klbench.cli", *over, *extra, f"seed={seed}", f"task.max_steps={steps}",
                   f"task.val_every={steps}", "logger=csv", f"hydra.run.dir={folder}", f"paths.outputs={out}/outputs"]
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name} seed {seed} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
            row = {"arm": name, "seed": seed, **final_metrics(folder), "wall_s": round(time.time() - t0, 1)}
            new = not path.exists()
            with open(path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    w.writeheader()
                w.writerow(row)
            print(f"{model} {name} s{seed}: reward {row['val_reward']:.4f} KL {row['val_seq_kl']:.4f} "
                  f"mismatch k1 {row['mismatch_k1']:.2e} chi2 {row['mismatch_chi2']:.2e} ({row['wall_s']} s)", flush=True)
    return path


def reread(model: str, out: Path) -> Path:
    """<out>/<model>_runs.csv rebuilt from the run folders (what --plot-only reads: a metric added since is read too)."""
    rows = []
    for name, _ in arms(model, list(ENGINES)):
        for folder in sorted((out / "runs" / model).glob(f"{name.replace(' ', '_').replace('/', '-')}_s*")):
            try:
                rows.append({"arm": name, "seed": int(folder.name.rsplit("_s", 1)[1]), **final_metrics(folder)})
            except (StopIteration, ValueError):  # a run still going, or stopped before its final validation
                continue
    path = out / f"{model}_runs.csv"
    if rows:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return path


def t95(n: int) -> float:
    """The two-sided 95% Student t quantile with n - 1 degrees of freedom (n <= 10 tabulated, else 1.96)."""
    return {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(n, 1.96)


def summarise(path: Path) -> list[dict]:
    by: dict[str, list[dict]] = {}
    for r in csv.DictReader(open(path)):
        by.setdefault(r["arm"], []).append(r)
    out = []
    for arm, rows in by.items():
        s = {"arm": arm, "seeds": len(rows)}
        for key in ("val_reward", "val_seq_kl", "val_frontier_gap", "mismatch_k1", "mismatch_chi2"):
            if not rows[0].get(key):
                continue
            v = [float(r[key]) for r in rows]
            m = statistics.fmean(v)
            h = t95(len(v)) * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else float("nan")
            s[key], s[key + "_ci"] = m, h
        out.append(s)
    with open(path.with_name(path.name.replace("_runs", "_arms")), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    return out


def markdown(rows: list[dict]) -> str:
    gap = "val_frontier_gap" in rows[0]
    lines = ["| arm | seeds | val/reward | val/seq_kl = KL(pi \\|\\| pi_ref) |" + (" val/frontier_gap (exact) |" * gap)
             + " train/mismatch_k1 | train/mismatch_chi2 |", "|---|---|---|---|---|---|" + "---|" * gap]
    for r in rows:
        g = f" {r['val_frontier_gap']:.3f} ± {r['val_frontier_gap_ci']:.3f} |" if gap else ""
        lines.append(f"| {r['arm']} | {r['seeds']} | {r['val_reward']:.3f} ± {r['val_reward_ci']:.3f} | "
                     f"{r['val_seq_kl']:.3f} ± {r['val_seq_kl_ci']:.3f} |{g} {r['mismatch_k1']:.1e} | "
                     f"{r['mismatch_chi2']:.1e} |")
    return "\n".join(lines)


def plot(summaries: dict[str, list[dict]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(summaries), figsize=(6.5 * len(summaries), 5), squeeze=False)
    colours = {"none": "black", "bf16": "tab:blue", "eager": "tab:green", "lag2": "tab:red"}
    markers = {"rb/sampler+pg": "D", "rb/sampler": "o", "rb/scorer": "s", "loo/scorer": "^", "seq/scorer": "v", "rb": "o", "loo": "^",
               "seq": "v"}
    for ax, (model, rows) in zip(axes[0], summaries.items()):
        for r in rows:
            engine, est = r["arm"].split(" ", 1)
            ax.errorbar(r["val_seq_kl"], r["val_reward"], xerr=r["val_seq_kl_ci"], yerr=r["val_reward_ci"],
                        fmt=markers[est], color=colours[engine], capsize=3, label=r["arm"],
                        mfc="none" if est.endswith("scorer") else colours[engine])
        ax.set_xlabel("final KL(pi || pi_ref) of the trainer (val/seq_kl)")
        ax.set_ylabel("final val/reward")
        ax.set_title(f"{model}: mean and 95% CI over seeds")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), action="append")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("outputs/mismatch_study"))
    ap.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    ap.add_argument("--extra", nargs="*", default=[], help="more klbench overrides for every run (task.val_prompts=16)")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--plot-only", action="store_true", help="summarise and plot the runs already in --out")
    a = ap.parse_args()
    models = a.model or list(MODELS)
    summaries = {}
    for model in models:
        path = reread(model, a.out) if a.plot_only else run(model, a.steps, a.seeds, a.out, a.engines, a.extra)
        if path.exists():
            summaries[model] = summarise(path)
            print(f"\n{model}:\n" + markdown(summaries[model]))
    if a.png and summaries:
        plot(summaries, a.png)


if __name__ == "__main__":
    main()
