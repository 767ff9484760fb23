"""Tables of docs/probe.md from the run folders of `klbench task=probe` (their probe_*.csv and probe_meta.json).

    python scripts/probe_results.py NAME=FOLDER [NAME=FOLDER ...]

Prints, per folder, the value table at M=1 (cv_opt at its smallest M), the std of every estimator against M,
and the gradient table; then one headline table (rb/mc value std and rb/seq gradient variance) over folders.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path


def _f(v: str | float) -> str:
    v = float(v)
    if math.isnan(v):
        return "nan"
    return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


def _ci(r: dict, key: str) -> str:
    return f"{_f(r[key])} [{_f(r[key + '_lo'])}, {_f(r[key + '_hi'])}]"


def load(folder: Path) -> tuple[list[dict], list[dict], dict]:
    values = list(csv.DictReader(open(folder / "probe_values.csv")))
    grads = list(csv.DictReader(open(folder / "probe_gradients.csv")))
    return values, grads, json.load(open(folder / "probe_meta.json"))


def report(name: str, folder: Path) -> dict:
    values, grads, meta = load(folder)
    print(f"\n### {name}\n")
    print(f"`{folder}`: {meta['prompts']} prompts, R={meta['replicates']}, M_max={meta['samples']}, gradient batch "
          f"{meta['prompts']} x {meta['grad_samples']}, {meta['n_params']} parameters; KL reference "
          f"{meta['kl_reference']:.3f} nats (s.e. {meta['kl_reference_se']:.3f}, {meta['value_reference']}); "
          f"{meta['time_s']:.0f} s, peak RSS {meta['peak_rss_mb']:.0f} MB\n")
    first = {}
    for r in values:
        first.setdefault(r["estimator"], r)
    print("| value estimator | M | mean | bias [95% CI] | std [CI] | std / mc [CI] |\n|---|---|---|---|---|---|")
    for r in first.values():
        print(f"| `{r['estimator']}` | {r['M']} | {_f(r['mean'])} | {_ci(r, 'bias')} | {_ci(r, 'std')} | "
              f"{_ci(r, 'std_ratio_mc')} |")
    Ms = sorted({int(r["M"]) for r in values})
    print("\n| std of the M-sample estimate | " + " | ".join(f"M={m}" for m in Ms) + " |\n|---|"
          + "---|" * len(Ms))
    for lab in first:
        by = {int(r["M"]): r for r in values if r["estimator"] == lab}
        print(f"| `{lab}` | " + " | ".join(_f(by[m]["std"]) if m in by else "-" for m in Ms) + " |")
    print("\n| gradient estimator | tr Cov / seq [CI] | ||E g||^2 [CI] | SNR [CI] | cos kl_pi_ref [CI] | "
          "cos kl_ref_pi [CI] |\n|---|---|---|---|---|---|")
    for r in grads:
        print(f"| `{r['estimator']}` | {_ci(r, 'var_ratio_seq')} | {_ci(r, 'mean_norm_sq')} | {_ci(r, 'snr')} | "
              f"{_ci(r, 'cos_kl_pi_ref')} | {_ci(r, 'cos_kl_ref_pi')} |")
    v = {r["estimator"]: r for r in first.values()}
    g = {r["estimator"]: r for r in grads}
    return {"kl": meta["kl_reference"], "value": v.get("rb"), "grad": g.get("rb"), "R": meta["replicates"]}


def main(argv: list[str]) -> None:
    heads = {}
    for arg in argv:
        name, _, folder = arg.partition("=")
        heads[name] = report(name, Path(folder))
    print("\n| pair | KL (nats) | value std `rb` / `mc`, M=1 | gradient tr Cov `rb` / `seq` |\n|---|---|---|---|")
    print("| paper 001 (GPT-2, IMDB) | 6.76 | 0.69 (0.11 / 0.16) | 0.754 (-24.6%) |")
    for name, h in heads.items():
        val = _ci(h["value"], "std_ratio_mc") if h["value"] else "-"
        grad = _ci(h["grad"], "var_ratio_seq") if h["grad"] else "-"
        print(f"| {name} (R={h['R']}) | {h['kl']:.2f} | {val} | {grad} |")


if __name__ == "__main__":
    main(sys.argv[1:])
