"""The files an analysis writes into a folder, the same whether they stay on disk (the CLIs, a sweep's
folder) or become MLflow artifacts (klbench.analysis.mlflow_io logs this folder's files):

- the Pareto frontier: pareto.png and pareto.csv, one row per run; pareto.html, the interactive figure
  (klbench.analysis.plotly_figure), self-contained so that it draws without a network;
- the distillation report: distill_seq_kl.png, .md (a few steps) and .csv (every validation step).

No MLflow here.
"""
from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from klbench.analysis.distill_curves import Curve, aggregate, common_steps, format_markdown, pick_steps, summary_rows
from klbench.analysis.plots import plot_bands, plot_pareto
from klbench.record.experiments import FIGURE

if TYPE_CHECKING:
    from klbench.exact.tabular import Frontier

PARETO_COLUMNS = ("run_id", "run_name", "estimator", "beta", "lam", "seed", "reward", "seq_kl", "on_frontier",
                  "experiment")
REPORT_FILES = ("distill_seq_kl.png", "distill_seq_kl.md", "distill_seq_kl.csv")


def write_pareto_csv(recs: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=PARETO_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for p in sorted(recs, key=lambda p: (str(p["estimator"]), p["seq_kl"])):
            w.writerow({c: ("" if p.get(c) is None else p.get(c)) for c in PARETO_COLUMNS})
    return path


def write_pareto(recs: list[dict], folder: str | Path, title: str, ref_point: tuple[float, float] | None = None,
                 exact_frontier: Frontier | None = None) -> tuple[Path, Path]:
    """pareto.png and pareto.csv in folder, for points that klbench.analysis.frontier.summarize has marked."""
    folder = Path(folder)
    png = plot_pareto(recs, folder / "pareto.png", exact_frontier, title, ref_point)
    return png, write_pareto_csv(recs, folder / "pareto.csv")


def write_figure_html(fig, folder: str | Path) -> Path:
    """The interactive figure as `folder/pareto.html`, with plotly's script inside it (no network needed)."""
    path = Path(folder) / FIGURE
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs=True, auto_open=False)
    return path


def _write_rows(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_report(curves: Sequence[Curve], out_dir: str | Path, title: str = "", steps: Sequence[int] | None = None,
                 log_y: bool | None = None) -> dict[str, Any]:
    """The plot, the markdown table (`steps`, default about six) and the CSV (every step) in out_dir;
    returns their paths, the table's rows and the bands."""
    bands = aggregate(curves)
    if not bands:
        raise ValueError("no usable runs: every run lacks a val/seq_kl history")
    out = Path(out_dir)
    every = sorted({int(s) for b in bands.values() for s in b.steps})
    table_steps = list(steps) if steps else pick_steps(common_steps(bands))
    rows = summary_rows(bands, table_steps)  # the markdown table: a few steps
    png = plot_bands(bands, out / REPORT_FILES[0], title, log_y)
    md = out / REPORT_FILES[1]
    md.write_text(format_markdown(rows))
    csv_path = _write_rows(summary_rows(bands, every), out / REPORT_FILES[2])  # the CSV: every validation step
    return {"png": png, "md": md, "csv": csv_path, "rows": rows, "bands": bands}
