"""task=probe: measure every estimator on a policy/reference pair (the math is klbench/probe/measure.py), and the small
probe that task=rl / task=distill run at validations with task.probe_every.

    klbench task=probe                                    # the embedded reference against itself (KL 0)
    klbench task=probe ckpt_path=<run>/checkpoints/last.ckpt   # a run's policy against its pi_ref
    klbench experiment=distill task=probe                 # student against teacher

Writes probe_values.{csv,md}, probe_gradients.{csv,md}, probe_value_std.png, probe_gradients.png and
probe_meta.json into the run folder, and logs them with metrics named by estimator to one MLflow run, which
ends FINISHED only when everything is written.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from klbench.probe import measure as P
from klbench.record import resume, tracking

# the metric keys of a gradient row logged to MLflow (grad/<key>/<estimator>), each with _lo and _hi
GRADIENT_METRICS = ("trace_cov", "var_ratio_seq", "mean_norm_sq", "snr", "cos_kl_pi_ref", "cos_kl_ref_pi",
                    "rel_err_kl_pi_ref", "rel_err_kl_ref_pi")
OPTION_KEYS = ("samples", "grad_samples", "replicates", "ref_batches", "ref_samples", "seed", "bootstrap",
               "ci_level", "boot_dim", "project_dim", "value_estimators", "gradient_estimators")


def probe_config(options) -> P.ProbeConfig:
    opts = OmegaConf.to_container(options, resolve=True) if isinstance(options, DictConfig) else dict(options)
    return P.ProbeConfig(**{k: opts[k] for k in OPTION_KEYS if k in opts})


def load_policy_weights(policy, path: str, cfg: DictConfig) -> int:
    """Loads a klbench checkpoint's policy weights into `policy`; returns the checkpoint's step. Refuses a
    checkpoint made with another model or teacher, naming the keys."""
    payload = resume.load_payload(path)  # "not a klbench checkpoint" for anything else
    changes = [c for c in resume.config_changes(payload["config"], cfg) if c.startswith(("model", "teacher"))]
    if changes:
        raise resume.ResumeError(f"{path} holds a policy of another model: " + "; ".join(changes)
                                 + ". Probe it with the model (and teacher) options of its run")
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    state = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    missing, unexpected = policy.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("ref.")]  # the frozen reference is not checkpointed
    if missing or unexpected:
        raise resume.ResumeError(f"{path}: the policy's weights do not fit this model (missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]})")
    return int(payload.get("step") or 0)


def probe_prompts(cfg: DictConfig, policy, n: int) -> list[str]:
    if policy.fixed_prompt is not None:  # one implicit prompt: n independent groups of samples
        return [policy.fixed_prompt] * n
    from klbench.models.data import load_prompts
    _, val = load_prompts(cfg.dataset)
    if len(val) < n:
        raise ValueError(f"task.prompts={n} but the dataset's val split has {len(val)} prompts")
    return val[:n]


def run_task(cfg: DictConfig) -> dict[str, float]:
    """task=probe: build the pair, probe it, write and log tables and plots; returns the headline metrics."""
    from klbench.models.policies import build_policy
    t0 = time.time()
    pcfg = probe_config(cfg.task)  # bad options fail before anything is built
    ckpt_path = resume.resolve_ckpt(cfg)
    if ckpt_path is not None:
        resume.load_payload(ckpt_path)  # not a klbench checkpoint: refused before anything is built or logged
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache, cfg.get("teacher"))
    if cfg.hardware.accelerator in ("gpu", "cuda"):
        policy = policy.to("cuda")
    step = load_policy_weights(policy, ckpt_path, cfg) if ckpt_path else 0
    prompts = probe_prompts(cfg, policy, cfg.task.prompts)
    build_s = time.time() - t0
    if cfg.logger.kind == "mlflow" and not cfg.logger.get("run_name"):
        with open_dict(cfg):
            cfg.logger.run_name = _run_name(cfg, step)
    logger = tracking.build_logger(cfg)
    run_dir = os.path.dirname(cfg.paths.ckpt_dir)
    with tracking.recorded(logger):
        result = P.run_probe(policy, prompts, pcfg, progress=True)
        result.meta.update({"step": step, "ckpt_path": ckpt_path, "build_s": build_s})
        files = write_outputs(result, run_dir)
        print(result.summary())
        print(f"klbench: probe tables and plots in {run_dir}")
        metrics = headline_metrics(result)
        if isinstance(logger, tracking.RecordLogger):
            logger.log_metrics(metrics, step=step)
            logger.commit(1)
            if logger.client is not None:
                for f in files:
                    logger.client.log_artifact(logger.run_id, f)
            logger.end("FINISHED")
        from klbench.console import messages as console
        console.print_run_where(cfg, logger)
    return metrics


def _run_name(cfg: DictConfig, step: int) -> str:
    m = cfg.model
    who = m.get("preset") or os.path.basename(str(m.get("name_or_path", ""))) or m.kind
    parts = ["probe", str(m.kind), str(who)]
    if cfg.get("teacher") is not None:
        parts.append("vs-" + str(cfg.teacher.get("preset") or cfg.teacher.kind))
    return "-".join(parts + [f"step{step}", f"seed{cfg.task.seed}"])


def headline_metrics(result: P.ProbeResult) -> dict[str, float]:
    """Metrics named by estimator: value/<stat>/<label> (at each estimator's smallest M; value/std/<label>/M<m>
    for every M), grad/<stat>/<label>, each ratio and bias with _lo and _hi (CI bounds); non-finite left out."""
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


def write_outputs(result: P.ProbeResult, folder: str) -> list[str]:
    """csv and md tables, the two plots and the meta as json; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for name, rows, cols in (("probe_values", result.values, P.VALUE_COLUMNS),
                             ("probe_gradients", result.gradients, P.GRADIENT_COLUMNS)):
        path = os.path.join(folder, name + ".csv")
        keys = list(rows[0]) if rows else []
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        md = os.path.join(folder, name + ".md")
        with open(md, "w") as f:
            f.write(P.format_table(rows, cols, markdown=True) + "\n")
        paths += [path, md]
    meta = os.path.join(folder, "probe_meta.json")
    with open(meta, "w") as f:
        json.dump(result.meta, f, indent=1, default=str)
    paths.append(meta)
    paths += plot(result, folder)
    return paths


def plot(result: P.ProbeResult, folder: str) -> list[str]:
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    ci = f"{result.meta['ci_level']:.0%} CI"
    fig = Figure(figsize=(6.5, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for i, lab in enumerate(dict.fromkeys(r["estimator"] for r in result.values)):
        rows = [r for r in result.values if r["estimator"] == lab and r["std"] > 0]
        if not rows:
            continue
        M = [r["M"] for r in rows]
        ax.plot(M, [r["std"] for r in rows], "o-", color=f"C{i}", label=lab)
        ax.fill_between(M, [r["std_lo"] for r in rows], [r["std_hi"] for r in rows], color=f"C{i}", alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("M (samples per prompt in one estimate)")
    ax.set_ylabel("std of the M-sample KL estimate [nats]")
    ax.set_title(f"Value estimators: std vs M (mean over {result.meta['prompts']} prompts, {ci} bands)\n"
                 f"KL reference {result.meta['kl_reference']:.3f} nats, R={result.meta['replicates']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    p1 = os.path.join(folder, "probe_value_std.png")
    fig.savefig(p1, dpi=120)

    rows = result.gradients
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
    ax2.legend(fontsize=8)
    fig.suptitle(f"Gradient estimators ({ci}; batch {result.meta['prompts']} prompts x "
                 f"{result.meta['grad_samples']} samples, R={result.meta['replicates']})", fontsize=9)
    p2 = os.path.join(folder, "probe_gradients.png")
    fig.savefig(p2, dpi=120)
    return [p1, p2]


# ---- task.probe_every: a small probe inside rl / distill ----

def probe_during_training(policy, prompts: list[str], options) -> dict[str, float]:
    """probe/* metrics of a small probe of the current policy; its samples come from the probe's own
    stream (run_probe restores the RNG state), so training is not shifted."""
    prompts = list(dict.fromkeys(prompts))[: int(options["prompts"])]
    result = P.run_probe(policy, prompts, probe_config(options), progress=False)
    out = {"probe/kl_reference": result.meta["kl_reference"]}
    for r in result.value_rows():
        out[f"probe/value_std_ratio_mc/{r['estimator']}"] = r["std_ratio_mc"]
    for r in result.gradients:
        for key in ("var_ratio_seq", "cos_kl_pi_ref", "cos_kl_ref_pi", "snr"):
            out[f"probe/grad_{key}/{r['estimator']}"] = r[key]
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}
