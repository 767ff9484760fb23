"""What a probe result becomes: text tables, metrics named by estimator, and the files of task=probe
(probe_values.{csv,md}, probe_gradients.{csv,md}, probe_meta.json and two plots).

The plots are drawn on matplotlib's `Figure` object, never through pyplot and never with `matplotlib.use`
(as klbench.analysis.plots): the caller's backend stays as it was. matplotlib loads only when a plot is drawn.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from klbench.probe.measure import ProbeResult

VALUE_SUMMARY_COLUMNS = [("estimator", "estimator"), ("M", "M"), ("mean", "mean"), ("mean_se", "s.e."),
                         ("bias", "bias [CI]"), ("std", "std [CI]"), ("std_ratio_mc", "std / mc [CI]")]
VALUE_COLUMNS = VALUE_SUMMARY_COLUMNS
GRADIENT_SUMMARY_COLUMNS = [("estimator", "estimator"), ("trace_cov", "tr Cov [CI]"),
                            ("var_ratio_seq", "tr Cov / seq [CI]"), ("mean_norm_sq", "||E g||^2 [CI]"),
                            ("snr", "SNR ||E g||^2/tr Cov [CI]"), ("cos_kl_pi_ref", "cos kl_pi_ref [CI]"),
                            ("cos_kl_ref_pi", "cos kl_ref_pi [CI]")]
GRADIENT_COLUMNS = GRADIENT_SUMMARY_COLUMNS + [("rel_err_kl_pi_ref", "rel. err kl_pi_ref [CI]"),
                                               ("rel_err_kl_ref_pi", "rel. err kl_ref_pi [CI]")]
# the metric keys of a gradient row logged to MLflow (grad/<key>/<estimator>), each with _lo and _hi
GRADIENT_METRICS = ("trace_cov", "var_ratio_seq", "mean_norm_sq", "snr", "cos_kl_pi_ref", "cos_kl_ref_pi",
                    "rel_err_kl_pi_ref", "rel_err_kl_ref_pi")


# ---- text ----

def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}"
    return str(v)


def _with_ci(row: dict, key: str) -> str:
    lo, hi = row.get(key + "_lo"), row.get(key + "_hi")
    if lo is None:
        return _fmt(row[key])
    return f"{_fmt(row[key])} [{_fmt(lo)}, {_fmt(hi)}]"


def format_table(rows: list[dict], columns: list[tuple[str, str]], markdown: bool = False) -> str:
    cells = [[_with_ci(r, k) if k not in ("estimator", "M") else _fmt(r[k]) for k, _ in columns] for r in rows]
    heads = [h for _, h in columns]
    if markdown:
        out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(heads)]
    out = ["  ".join(h.ljust(w) for h, w in zip(heads, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def summary(result: ProbeResult) -> str:
    """The console's account of a probe: what was measured, the two tables, time and memory."""
    meta = result.meta
    lines = [f"probe: {meta['prompts']} prompts, R={meta['replicates']} replicates, "
             f"M_max={meta['samples']}, gradient batch {meta['prompts']} x {meta['grad_samples']}, "
             f"{meta['n_params']} parameters ({meta['gradient_space']}); value reference: "
             f"{meta['value_reference']} = {meta['kl_reference']:.4f} nats; "
             f"{meta['ci_level']:.0%} bootstrap CIs"]
    if "kl_target" in meta:  # the KL every row is measured against (klbench.estimators.sampling)
        lines.append(f"sampling {meta['sampling']}; task.kl_target={meta['kl_target']}: {meta['target_kl']}")
        if meta.get("target_warning"):
            lines.append(f"warning: {meta['target_warning']}")
    lines.append("")
    lines.append(format_table(result.value_rows(), VALUE_SUMMARY_COLUMNS))
    lines.append("")
    lines.append(format_table(result.gradients, GRADIENT_SUMMARY_COLUMNS))
    if meta.get("skipped"):
        lines.append("skipped: " + "; ".join(f"{k}: {v}" for k, v in meta["skipped"].items()))
    lines.append(f"time {meta['time_s']:.1f} s (references {meta['ref_time_s']:.1f} s), "
                 f"peak RSS {meta['peak_rss_mb']:.0f} MB")
    return "\n".join(lines)


# ---- metrics ----

def headline_metrics(result: ProbeResult) -> dict[str, float]:
    """task=probe's metrics, named by estimator: value/<stat>/<label> (at each estimator's smallest M;
    value/std/<label>/M<m> for every M), grad/<stat>/<label>, each ratio and bias with _lo and _hi (CI
    bounds); non-finite left out."""
    out: dict[str, float] = {"kl_reference": result.meta["kl_reference"]}
    for r in result.value_rows():
        for key in ("mean", "bias", "std", "std_ratio_mc"):
            out[f"value/{key}/{r['estimator']}"] = r[key]
            if key in ("bias", "std_ratio_mc"):
                out[f"value/{key}/{r['estimator']}_lo"] = r[key + "_lo"]
                out[f"value/{key}/{r['estimator']}_hi"] = r[key + "_hi"]
    for r in result.values:
        out[f"value/std/{r['estimator']}/M{r['M']}"] = r["std"]
    for r in result.gradients:
        for key in GRADIENT_METRICS:
            for suffix in ("", "_lo", "_hi"):
                out[f"grad/{key}/{r['estimator']}{suffix}"] = r[key + suffix]
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


def training_metrics(result: ProbeResult) -> dict[str, float]:
    """The probe/* metrics of a small probe inside rl / distill (task.probe_every); non-finite left out."""
    out = {"probe/kl_reference": result.meta["kl_reference"]}
    for r in result.value_rows():
        out[f"probe/value_std_ratio_mc/{r['estimator']}"] = r["std_ratio_mc"]
    for r in result.gradients:
        for key in ("var_ratio_seq", "cos_kl_pi_ref", "cos_kl_ref_pi", "snr"):
            out[f"probe/grad_{key}/{r['estimator']}"] = r[key]
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


# ---- files ----

def write_outputs(result: ProbeResult, folder: str) -> list[str]:
    """csv and md tables, the two plots and the meta as json; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, rows, cols in (("probe_values", result.values, VALUE_COLUMNS),
                             ("probe_gradients", result.gradients, GRADIENT_COLUMNS)):
        path = os.path.join(folder, name + ".csv")
        keys = list(rows[0]) if rows else []
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        md = os.path.join(folder, name + ".md")
        with open(md, "w") as f:
            f.write(format_table(rows, cols, markdown=True) + "\n")
        paths += [path, md]
    meta = os.path.join(folder, "probe_meta.json")
    with open(meta, "w") as f:
        json.dump(result.meta, f, indent=1, default=str)
    paths.append(meta)
    paths.append(plot_value_std(result, os.path.join(folder, "probe_value_std.png")))
    paths.append(plot_gradients(result, os.path.join(folder, "probe_gradients.png")))
    return paths


# ---- plots ----

def plot_value_std(result: ProbeResult, path: str) -> str:
    """The std of each value estimator's M-sample estimate against M, with its CI band."""
    from matplotlib.figure import Figure
    meta = result.meta
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, lab in enumerate(dict.fromkeys(r["estimator"] for r in result.values)):
        rows = [r for r in result.values if r["estimator"] == lab and r["std"] > 0]
        if not rows:
            continue  # zero std (pi = pi_ref) has no place on a log axis
        M = [r["M"] for r in rows]
        ax.plot(M, [r["std"] for r in rows], "o-", color=f"C{i}", label=lab)
        ax.fill_between(M, [r["std_lo"] for r in rows], [r["std_hi"] for r in rows], color=f"C{i}", alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (samples per prompt in one estimate)")
    ax.set_ylabel("std of the M-sample KL estimate [nats]")
    ax.set_title(f"Value estimators: std vs M (mean over {meta['prompts']} prompts, {meta['ci_level']:.0%} CI "
                 f"bands)\nKL reference {meta['kl_reference']:.3f} nats, R={meta['replicates']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:  # no line at all when every std is 0 (pi = pi_ref)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return path


def plot_gradients(result: ProbeResult, path: str) -> str:
    """Per gradient estimator: its covariance trace as a ratio to seq's (left), and the cosine of its mean
    with each reference gradient (right), with CIs."""
    from matplotlib.figure import Figure
    meta, rows = result.meta, result.gradients
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    y = list(range(len(rows)))
    names = [r["estimator"] for r in rows]
    for j, r in enumerate(rows):
        v, lo, hi = r["var_ratio_seq"], r["var_ratio_seq_lo"], r["var_ratio_seq_hi"]
        if math.isfinite(v) and v > 0:
            ax1.errorbar([v], [j], xerr=[[v - lo], [hi - v]] if math.isfinite(lo) else None, fmt="o", color="C0")
    ax1.axvline(1, color="gray", lw=0.8)
    ax1.set_xscale("log")
    ax1.set_yticks(y, names)
    ax1.set_xlabel("tr Cov(per-batch gradient) / seq's")
    for k, (ref, color) in enumerate((("kl_pi_ref", "C1"), ("kl_ref_pi", "C2"))):
        label = f"vs grad {ref}"
        for j, r in enumerate(rows):
            v, lo, hi = r[f"cos_{ref}"], r[f"cos_{ref}_lo"], r[f"cos_{ref}_hi"]
            if math.isfinite(v):
                err = [[max(v - lo, 0)], [max(hi - v, 0)]] if math.isfinite(lo) else None
                ax2.errorbar([v], [j + (k - 0.5) * 0.3], xerr=err, fmt="o", color=color, label=label)
                label = None  # one legend entry per reference
    ax2.axvline(1, color="gray", lw=0.8)
    ax2.axvline(0, color="gray", lw=0.5)
    ax2.set_yticks(y, names)
    ax2.set_xlabel("cosine of E[gradient] with the reference")
    if ax2.get_legend_handles_labels()[0]:  # no cosine at all when no gradient mean is resolved
        ax2.legend(fontsize=8)
    fig.suptitle(f"Gradient estimators ({meta['ci_level']:.0%} CI; batch {meta['prompts']} prompts x "
                 f"{meta['grad_samples']} samples, R={meta['replicates']})", fontsize=9)
    fig.savefig(path, dpi=120)
    return path
