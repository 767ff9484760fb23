"""task=probe: measure every estimator on a policy/reference pair, and the small probe that task=rl /
task=distill run at validations with task.probe_every. The measurement is klbench/probe/measure.py, its tables,
files and plots klbench/probe/report.py; this runner builds the pair and records the run.

    klbench task=probe                                    # the embedded reference against itself (KL 0)
    klbench task=probe ckpt_path=<run>/checkpoints/last.ckpt   # a run's policy against its pi_ref
    klbench experiment=distill task=probe                 # student against teacher

Writes probe_values.{csv,md}, probe_gradients.{csv,md}, probe_value_std.png, probe_gradients.png and
probe_meta.json into the run folder, and logs them with metrics named by estimator to one MLflow run, which
ends FINISHED only when everything is written.
"""
from __future__ import annotations

import os
import time

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from klbench.probe import measure as P, report
from klbench.probe.config import ProbeOptions
from klbench.record import resume, tracking
from klbench.record.lifecycle import recorded_run


def probe_config(options) -> ProbeOptions:
    """The probe's options from task (task=probe: beside name and max_new_tokens) or task.probe."""
    opts = OmegaConf.to_container(options, resolve=True) if isinstance(options, DictConfig) else dict(options)
    return ProbeOptions(**{k: opts[k] for k in ProbeOptions.model_fields if k in opts})


def probe_prompts(cfg: DictConfig, policy, n: int) -> list[str]:
    if policy.fixed_prompt is not None:  # one implicit prompt: n independent groups of samples
        return [policy.fixed_prompt] * n
    from klbench.data.prompts import load_prompts
    _, val = load_prompts(cfg.dataset, policy)
    if len(val) < n:
        raise ValueError(f"task.prompts={n} but the dataset's val split has {len(val)} prompts")
    return val[:n]


def run_probe(cfg: DictConfig) -> dict[str, float]:
    """task=probe: build the pair, probe it, write and record tables and plots; returns the headline metrics."""
    from klbench.console import messages as console
    from klbench.models.policies import build_policy, sampling_params, sampling_text, task_sampling
    t0 = time.time()
    pcfg = probe_config(cfg.task)  # bad options fail before anything is built
    ckpt_path = resume.resolve_ckpt(cfg)
    if ckpt_path is not None:
        resume.load_payload(ckpt_path)  # not a klbench checkpoint: refused before anything is built or logged
    torch.manual_seed(cfg.seed)
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache, cfg.get("teacher"),
                          *task_sampling(cfg.task))
    if policy.sampling != task_sampling(cfg.task)[0]:  # model.generation_config=follow chose the folder's
        from klbench.config.schema import check_followed_sampling
        s = policy.sampling
        check_followed_sampling(cfg, s.temperature, s.top_k, s.top_p)
    if cfg.hardware.accelerator in ("gpu", "cuda"):
        policy = policy.to("cuda")
    step = resume.load_policy_weights(policy, ckpt_path, cfg) if ckpt_path else 0
    prompts = probe_prompts(cfg, policy, cfg.task.prompts)
    build_s = time.time() - t0
    if cfg.logger.kind == "mlflow" and not cfg.logger.run_name:
        with open_dict(cfg):
            cfg.logger.run_name = _run_name(cfg, step)
    run_dir = os.path.dirname(cfg.paths.ckpt_dir)
    print(f"klbench: {sampling_text(policy)}")
    with recorded_run(cfg) as record:
        tracking.log_params(record.logger, sampling_params(policy))
        result = P.run_probe(policy, prompts, pcfg, progress=True)
        result.meta.update({"step": step, "ckpt_path": ckpt_path, "build_s": build_s})
        files = report.write_outputs(result, run_dir)
        print(report.summary(result))
        print(f"klbench: probe tables and plots in {run_dir}")
        metrics = report.headline_metrics(result)
        record.commit(1, metrics, step=step)  # one step done: the probe (the record's klbench.max_steps is 1)
        record.attach(files)
        console.print_run_where(cfg, record.logger)
    return metrics


def _run_name(cfg: DictConfig, step: int) -> str:
    m = cfg.model
    named = m.preset if m.kind == "embedded" else os.path.basename(str(m.name_or_path)) if m.kind == "hf" else None
    who = named or m.kind
    parts = ["probe", str(m.kind), str(who)]
    if cfg.get("teacher") is not None:
        parts.append("vs-" + str((cfg.teacher.preset if cfg.teacher.kind == "embedded" else None) or cfg.teacher.kind))
    return "-".join(parts + [f"step{step}", f"seed{cfg.task.seed}"])


# ---- task.probe_every: a small probe inside rl / distill ----

def probe_during_training(policy, prompts: list[str], options) -> dict[str, float]:
    """probe/* metrics of a small probe of the current policy; its samples come from the probe's own
    stream (run_probe restores the RNG state), so training is not shifted."""
    pcfg = probe_config(options)
    prompts = list(dict.fromkeys(prompts))[: pcfg.prompts]
    return report.training_metrics(P.run_probe(policy, prompts, pcfg, progress=False))
