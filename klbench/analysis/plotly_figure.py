"""The reward-vs-KL frontier as an interactive figure (plotly), the one MLflow's UI shows among a run's
artifacts (`pareto.html`): every run's `val/seq_kl` against `val/reward`, a colour per estimator (the colours
of pareto.png), the empirical frontier with its bootstrap band, and on the tabular model the exact frontier.
Hovering a point names its run, beta and seed.

Drawing only: the maths is klbench.analysis.frontier, the files klbench.analysis.artifacts, MLflow
klbench.analysis.mlflow_io. plotly loads only when a figure is drawn.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from klbench.analysis.frontier import frontier_band, summarize
from klbench.analysis.plots import KL_LABEL, reward_metric

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from klbench.exact.tabular import Frontier


def _hover(p: dict) -> str:
    rows = [f"<b>{p.get('run_name') or p.get('run_id', '')}</b>", f"estimator {p['estimator']}"]
    rows += [f"{k} {p[k]:g}" if isinstance(p[k], float) else f"{k} {p[k]}"
             for k in ("beta", "lam", "seed") if p.get(k) is not None]
    rows += [f"{p.get('reward_metric') or 'val/reward'} {p['reward']:.4f}", f"val/seq_kl {p['seq_kl']:.4f}"]
    return "<br>".join(rows + (["on the empirical frontier"] if p.get("on_frontier") else []))


def pareto_figure(points: Any, exact_frontier: Frontier | None = None, title: str = "Reward vs sequence KL",
                  ref_point: tuple[float, float] | None = None, n_boot: int = 1000) -> go.Figure:
    """The figure for `points` (as klbench.analysis.frontier.summarize takes them); the band is drawn from
    `n_boot` bootstrap resamples of the runs (none with 0), where at least 97.5% of them have a run."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    recs, summary = summarize(points, ref_point)
    fig = go.Figure()
    palette = qualitative.D3  # matplotlib's C0..C9: the colours of pareto.png
    kls = np.array([p["seq_kl"] for p in recs], dtype=float)  # [N]
    rewards = np.array([p["reward"] for p in recs], dtype=float)  # [N]
    grid = np.unique(kls)  # [G] where the attainment step function can change
    if n_boot > 0:
        lo, hi = frontier_band([p["estimator"] for p in recs], rewards, kls, grid, n_boot=n_boot)
        ok = np.isfinite(lo)
        fig.add_trace(go.Scatter(x=grid[ok], y=hi[ok], mode="lines", line={"width": 0, "shape": "hv"},
                                 hoverinfo="skip", showlegend=False, legendgroup="band"))
        fig.add_trace(go.Scatter(x=grid[ok], y=lo[ok], mode="lines", line={"width": 0, "shape": "hv"},
                                 fill="tonexty", fillcolor="rgba(0,0,0,0.12)", hoverinfo="skip",
                                 legendgroup="band", name=f"frontier, 95% bootstrap band ({n_boot} resamples)"))
    front = sorted((p["seq_kl"], p["reward"]) for p in recs if p["on_frontier"])
    if front:
        fk, fr = zip(*front)
        fig.add_trace(go.Scatter(x=list(fk) + [float(kls.max())], y=list(fr) + [fr[-1]], mode="lines",
                                 line={"color": "black", "width": 1.5, "shape": "hv"},
                                 name="empirical frontier (non-dominated runs)", hoverinfo="skip"))
    for i, lab in enumerate(summary["counts"]):
        pts = [p for p in recs if str(p["estimator"]) == lab]
        n, nf = summary["counts"][lab]
        fig.add_trace(go.Scatter(
            x=[p["seq_kl"] for p in pts], y=[p["reward"] for p in pts], mode="markers",
            name=f"{lab}: {n} runs, {nf} on frontier ({summary['share'][lab]:.0%})",
            marker={"color": palette[i % len(palette)], "size": [13 if p["on_frontier"] else 9 for p in pts],
                    "line": {"color": "black", "width": [2 if p["on_frontier"] else 0 for p in pts]}},
            hovertext=[_hover(p) for p in pts], hoverinfo="text"))
    if exact_frontier is not None:
        ek = np.asarray(exact_frontier.kls, dtype=float)
        order = np.argsort(ek)
        fig.add_trace(go.Scatter(x=ek[order], y=np.asarray(exact_frontier.rewards, dtype=float)[order],
                                 mode="lines", line={"color": "black", "dash": "dash", "width": 1.5},
                                 name="exact optimum pi*_beta (tabular)"))
    fig.update_layout(
        title={"text": f"{title}<br><sup>hypervolume {summary['hypervolume']:.4g} (ref: reward="
                       f"{summary['ref_point'][0]:g}, KL={summary['ref_point'][1]:g} nats); ringed: on the "
                       "empirical frontier</sup>"},
        xaxis_title=KL_LABEL, yaxis_title=f"reward   ({reward_metric(recs)})", template="plotly_white", hovermode="closest",
        legend={"orientation": "h", "yanchor": "top", "y": -0.18, "xanchor": "left", "x": 0})
    return fig
