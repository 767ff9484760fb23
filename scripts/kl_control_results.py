"""Regenerates the kl_ctl results table and figure (README, docs/kl-control.md) from an MLflow store.

    KLBENCH_OUTPUTS=outputs/kl_ctl_results python scripts/kl_control_results.py \
        --experiment kl_ctl_embedded_target2 --out docs/img/kl_ctl_embedded_target2.png

Takes the FINISHED runs with kl_ctl.name=adaptive of the experiment and groups them by kl_ctl.signal (or
another param: --group-by kl_ctl.kp compares controllers). Per group (mean over seeds, +- the std over seeds
where there are several):
- beta at the first, middle and last step, and the step-to-step std of beta: the std over steps of
  beta_{t+1} - beta_t, and of log(beta_{t+1} / beta_t) in percent (the controller's noise, scale-free);
- train/kl_rb averaged over the last third of the steps (KL on the training batches, every log_every steps,
  measured with rb whatever the signal): how well the KL is held, not only where it ends;
- val/seq_kl / target (rb on fresh held-out samples, never the signal; the exact KL on model=tabular) averaged
  over the validations of the last third (steps > 2/3 of the run), and its std over the validations from the
  first third on (ringing: the controller's oscillation plus the policy's own noise);
- the final val/seq_kl against the target, and val/reward.
--exact plots val/seq_kl as lines (every validation: the exact KL on tabular) instead of train/kl_rb.
The store is --tracking-uri, else $MLFLOW_TRACKING_URI, else mlflow.db in $KLBENCH_OUTPUTS (default ./outputs),
as for klbench runs (klbench.analysis.mlflow_io.open_client).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path
from statistics import mean, pstdev

from klbench.analysis.mlflow_io import (TRACKING_URI_HELP, UnknownExperiment, experiment_ids, open_client,
                                        search_runs)
from klbench.record.store import StoreError

SIGNAL_ORDER = ("mc", "k3", "cv_seq", "cv_opt", "k2", "rb")


def series(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def per_run(client, run, group_by: str) -> dict:
    rid, p = run.info.run_id, run.data.params
    beta = [v for _, v in series(client, rid, "train/beta")]
    d = [b - a for a, b in zip(beta, beta[1:])]
    dlog = [math.log(b / a) for a, b in zip(beta, beta[1:])]
    rb = series(client, rid, "train/kl_rb")
    last = max(s for s, _ in rb)
    held = [v for s, v in rb if s >= last * 2 / 3]
    target, n = float(p["kl_ctl.target"]), int(p["task.max_steps"])
    val = series(client, rid, "val/seq_kl")
    val_last = [v / target for s, v in val if s > n * 2 / 3]
    val_after = [v / target for s, v in val if s >= n / 3]
    group = p["kl_ctl.signal"] if group_by == "kl_ctl.signal" else f"{group_by.split('.')[-1]}={p[group_by]}"
    return {"signal": p["kl_ctl.signal"], "group": group, "seed": int(p["seed"]), "target": target,
            "val_last": mean(val_last), "val_ring": pstdev(val_after),
            "beta": beta, "beta_steps": (beta[0], beta[len(beta) // 2], beta[-1]),
            "dbeta_std": pstdev(d), "dlog_std_pct": 100 * pstdev(dlog), "held_kl": mean(held),
            "seq_kl": run.data.metrics["val/seq_kl"], "reward": run.data.metrics["val/reward"],
            "rb": rb, "val_kl": val}


def fmt(values: list[float], digits: int) -> str:
    m = f"{mean(values):.{digits}f}"
    return m if len(values) < 2 else f"{m} +- {pstdev(values):.{digits}f}"


def table(groups: dict[str, list[dict]]) -> str:
    target = next(iter(groups.values()))[0]["target"]
    n_steps = len(next(iter(groups.values()))[0]["beta"])
    head = ("| group | seeds | beta at step 0 / {} / {} | step-to-step std of beta (x1e-4) | ... of log beta (%) "
            "| train KL (rb), last third | `val/seq_kl` / target, last third | its std from the first third on "
            "| final `val/seq_kl` (target {:g}) | final `val/reward` |"
            .format(n_steps // 2, n_steps - 1, target))
    lines = [head, "|" + "---|" * 10]
    for sig, runs in groups.items():
        b = [" / ".join(f"{x:.4f}" for x in (mean(r["beta_steps"][i] for r in runs) for i in range(3)))]
        lines.append(f"| `{sig}` | {len(runs)} | {b[0]} | {fmt([1e4 * r['dbeta_std'] for r in runs], 2)} | "
                     f"{fmt([r['dlog_std_pct'] for r in runs], 2)} | {fmt([r['held_kl'] for r in runs], 2)} | "
                     f"{fmt([r['val_last'] for r in runs], 3)} | {fmt([r['val_ring'] for r in runs], 3)} | "
                     f"{fmt([r['seq_kl'] for r in runs], 2)} | {fmt([r['reward'] for r in runs], 3)} |")
    return "\n".join(lines)


def plot(groups: dict[str, list[dict]], out: str, title: str, exact: bool) -> None:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_b, ax_k = fig.subplots(1, 2)
    target = next(iter(groups.values()))[0]["target"]
    for i, (sig, runs) in enumerate(groups.items()):
        color = f"C{i}"
        kl_key = "val_kl" if exact else "rb"  # the line on the right: exact val/seq_kl, or train/kl_rb
        for j, r in enumerate(runs):  # one thin line per seed, the mean over seeds bold
            ax_b.plot(r["beta"], color=color, alpha=0.25, linewidth=0.8)
            ax_k.plot(*zip(*r[kl_key]), color=color, alpha=0.25, linewidth=0.8)
        n = min(len(r["beta"]) for r in runs)
        ax_b.plot([mean(r["beta"][t] for r in runs) for t in range(n)], color=color, linewidth=2,
                  label=f"{sig} ({len(runs)} seeds)")
        steps = [s for s, _ in runs[0][kl_key]]
        ax_k.plot(steps, [mean(dict(r[kl_key])[s] for r in runs) for s in steps], color=color, linewidth=2,
                  label=f"{sig}: " + ("val/seq_kl (exact)" if exact else "train/kl_rb"))
        if not exact:
            vsteps = [s for s, _ in runs[0]["val_kl"]]
            ax_k.plot(vsteps, [mean(dict(r["val_kl"])[s] for r in runs) for s in vsteps], "o", color=color,
                      markeredgecolor="black", markersize=4)
    ax_k.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g} nats")
    if not exact:
        ax_k.plot([], [], "o", color="gray", markeredgecolor="black", label="val/seq_kl (held-out)")
    ax_b.set(xlabel="step", ylabel="beta   (train/beta)", title="beta set by the controller")
    ax_k.set(xlabel="step", ylabel="sequence KL(pi || pi_ref) [nats]", title="KL held")
    for ax in (ax_b, ax_k):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experiment", required=True, help="MLflow experiment holding the kl_ctl=adaptive runs")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default=None)
    p.add_argument("--group-by", default="kl_ctl.signal", help="param that groups the runs (kl_ctl.kp: controllers)")
    p.add_argument("--exact", action="store_true", help="plot val/seq_kl as lines (exact on model=tabular)")
    p.add_argument("--tracking-uri", default=None, help=TRACKING_URI_HELP)
    args = p.parse_args()
    try:
        client, _ = open_client(args.tracking_uri)
        ids = experiment_ids(client, [args.experiment])
    except (StoreError, UnknownExperiment) as e:
        raise SystemExit(str(e)) from None
    found = search_runs(client, ids, "params.`kl_ctl.name` = 'adaptive'")
    done = [r for r in found if r.info.status == "FINISHED"]
    print(f"{len(done)} FINISHED adaptive runs ({len(found) - len(done)} others skipped)")
    if not done:
        raise SystemExit("nothing to report")
    runs = [per_run(client, r, args.group_by) for r in done]
    if len({r["target"] for r in runs}) > 1:
        raise SystemExit(f"runs with different targets: {sorted({r['target'] for r in runs})}")
    groups: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: (SIGNAL_ORDER.index(r["signal"]) if r["signal"] in SIGNAL_ORDER else 99,
                                         r["group"], r["seed"])):
        groups.setdefault(r["group"], []).append(r)
    print(table(groups))
    print("\nper run: group seed | final val/seq_kl | final val/reward | held train KL | std dbeta | std dlog% "
          "| val/seq_kl/target last third | its std from n/3")
    for sig, rs in groups.items():
        for r in rs:
            print(f"  {sig:6} {r['seed']} | {r['seq_kl']:.3f} | {r['reward']:.3f} | {r['held_kl']:.3f} | "
                  f"{r['dbeta_std']:.2e} | {r['dlog_std_pct']:.3f} | {r['val_last']:.3f} | {r['val_ring']:.3f}")
    plot(groups, args.out, args.title or f"kl_ctl=adaptive, target {runs[0]['target']:g} nats ({args.experiment})",
         args.exact)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
