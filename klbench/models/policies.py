"""The `model` group's builder: build_policy turns a `model` config (tabular, the embedded GPT-2, any HF causal LM)
into a Policy (klbench.models.interface; LMPolicy in lm_policy.py, TabularPolicy in tabular_policy.py), and the
lines and params that say how it samples. The classes are re-exported here: `from klbench.models.policies import
LMPolicy` keeps working.
"""
from __future__ import annotations

import torch

from klbench.config.errors import ConfigError
from klbench.console import messages as console
from klbench.estimators.sampling import KL_TARGETS, Sampling, check_target
from klbench.models.embedded import ensure_embedded_lm, preset_spec
from klbench.models.interface import Policy, Rollout, has_distributions, response_mask, token_entropy
from klbench.models.lm_policy import LMPolicy
from klbench.models.logits_budget import size_bytes
from klbench.models.pair_rules import check_kinds, context_refusal
from klbench.models.rollout import PLAIN
from klbench.models.scoring import ScoredBatch
from klbench.models.tabular_policy import TabularPolicy, tabular_policy

__all__ = ["LMPolicy", "Policy", "Rollout", "ScoredBatch", "TabularPolicy", "build_policy", "has_distributions",
           "response_mask", "engine_text", "sampling_params", "sampling_text", "task_sampling", "token_entropy"]


def task_sampling(task) -> tuple[Sampling, str]:
    """(Sampling, kl_target) of a task config (task.temperature, top_k, top_p, kl_target)."""
    return Sampling(float(task.temperature), int(task.top_k), float(task.top_p)), str(task.kl_target)


def sampling_text(policy) -> str:
    """The line that says how the policy samples and which KL the run targets (start and end of a run)."""
    return console.kl_target_line(policy.sampling.describe(), policy.kl_target, KL_TARGETS[policy.kl_target])


def sampling_params(policy) -> dict[str, str]:
    """MLflow params of the sampling a run used (task.* are params already; with model.generation_config=follow
    the folder's values replace them) and the KL it targets."""
    out = {"sampling.used": policy.sampling.describe(), "sampling.kl_target": KL_TARGETS[policy.kl_target]}
    if policy.engine is not None:  # task.sampler: the rollouts' engine, and the behaviour policy its batches carry
        out.update({"sampling.engine": policy.engine.spec.describe(), "sampling.behaviour": policy.behaviour})
    return out


def engine_text(policy) -> str:
    """The line that says what draws a training step's rollouts and which log-probs its batches carry as the
    behaviour policy (task.sampler, task.behaviour): printed at start-up where the engine is not the trainer."""
    which = ("the engine's own log-probs (task.behaviour=sampler)" if policy.behaviour == "sampler" else
             "the trainer's recomputation (task.behaviour=scorer: the mismatch is invisible to the KL estimator)")
    return (f"rollouts: {policy.engine.spec.describe()}; the KL batch's behaviour policy: {which}; "
            "train/mismatch_* measures the gap (docs/mismatch.md)")


def build_policy(cfg, max_new_tokens: int, cache_root: str | None = None, teacher=None, sampling: Sampling = PLAIN,
                 kl_target: str = "sampler", notices: bool = True) -> Policy:
    """The `model` group: tabular, the embedded GPT-2 (built once into the per-user cache), or any HF causal LM.

    cache_root: the embedded models' cache (paths.cache; None: klbench.models.embedded.cache_dir()).
    With `teacher` (a second `model` config, task=distill) the teacher is pi_ref; otherwise pi_ref is the
    policy's own starting point (model.ref_name_or_path for hf).
    sampling, kl_target: how the policy samples and which KL it scores (task_sampling(cfg.task)). A language
    model's generation_config adds its stop ids (every one ends a response) and, with
    model.generation_config=follow, its sampling options replace `sampling` (one line says which are used).
    notices=False: without that line, for a caller that does not run (klbench-export says what it writes).
    """
    if teacher is not None:
        check_kinds(cfg.kind, teacher.kind)
    if cfg.kind == "tabular":
        _warn_target(sampling, kl_target)
        return tabular_policy(cfg, teacher, sampling, kl_target)
    from klbench.models import hf as models  # transformers: imported only for a language model
    path = _lm_path(cfg, cache_root)
    if teacher is not None:
        ref_path, names = _lm_path(teacher, cache_root), ("student (model)", "teacher")
    else:
        ref_path = cfg.ref_name_or_path if cfg.kind == "hf" else path
        names = ("policy (model)", "reference (model.ref_name_or_path)")
    model, tok = models.load_causal_lm(path, cfg.dtype, **_load_options(cfg, "model", "name_or_path"))
    if cfg.gradient_checkpointing:
        models.enable_checkpointing(model, "model")
    ref = ref_tok = None
    if cfg.lora.r:
        from klbench.models.lora import WithoutAdapter, add_lora
        model = add_lora(model, **cfg.lora)
        if teacher is None and ref_path == path:  # pi_ref is the policy's own base, adapter off: one copy
            ref, ref_tok = WithoutAdapter(model), tok
    if ref is None:
        ref_key = ("model", "ref_name_or_path") if teacher is None else ("teacher", "name_or_path")
        ref, ref_tok = models.load_causal_lm(ref_path, (teacher or cfg).dtype,
                                             **_load_options(teacher or cfg, *ref_key))
    models.check_same_vocab(tok, ref_tok, *names)
    for name, where, m in ((names[0], path, model), (names[1], ref_path, ref)):
        context = models.context_length(m.config)
        if context and max_new_tokens >= context[1]:  # no room left for a prompt (embedded: klbench.config.schema)
            raise ConfigError(context_refusal(max_new_tokens, name, f"{where}'s {context[0]}", context[1]))
    stops, options = models.generation_defaults(model)
    eos_ids = list(dict.fromkeys(i for i in (tok.eos_token_id, *stops) if i is not None))  # the tokenizer's first
    sampling = _generation_sampling(cfg, path, options, sampling, notices)
    _warn_target(sampling, kl_target)
    policy = LMPolicy(model, ref, tok, max_new_tokens, sampling=sampling, kl_target=kl_target, eos_ids=eos_ids,
                      logits_budget=size_bytes(cfg.logits_budget), scoring_path=cfg.scoring_path)
    policy.head_dtype = torch.float32 if cfg.head_dtype == "float32" else None  # None: autocast's, as the model's
    return policy


def _warn_target(sampling: Sampling, kl_target: str) -> None:
    warning = check_target(sampling, kl_target)  # refuses a target no estimator can serve, else may warn
    if warning:
        print(f"klbench: warning: {warning}")


def _generation_sampling(cfg, path: str, options: dict, sampling: Sampling, notices: bool = True) -> Sampling:
    """The sampling a language model runs with, given the temperature/top_k/top_p its generation_config sets
    (`options`): klbench's (`sampling`, from task.*), saying so where the folder sets others, or the folder's
    with model.generation_config=follow. Unset options are generate()'s plain values (1, 0, 1)."""
    follow = cfg.kind == "hf" and cfg.generation_config == "follow"
    if not options:
        if follow and notices:
            print(f"klbench: model.generation_config=follow: {path}'s generation_config sets no temperature, top_k "
                  f"or top_p; sampling with task.*'s {sampling.describe()}")
        return sampling
    theirs = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items())
    if not follow:
        if notices and any(getattr(sampling, k) != v for k, v in options.items()):
            print(f"klbench: {path}'s generation_config sets {theirs}; this run samples with klbench's "
                  f"task.* options ({sampling.describe()}): model.generation_config=follow uses the folder's")
        return sampling
    try:
        used = Sampling(float(options.get("temperature", 1.0)), int(options.get("top_k", 0)),
                        float(options.get("top_p", 1.0)))
    except ValueError as e:
        raise ConfigError(f"model.generation_config=follow: {path}'s generation_config sets {theirs}, which "
                          f"klbench cannot train with ({e}); use model.generation_config=klbench") from None
    if notices:
        print(f"klbench: model.generation_config=follow: sampling with {path}'s generation_config "
              f"({used.describe()}) instead of task.*'s ({sampling.describe()})")
    return used


def _load_options(cfg, setting: str, key: str) -> dict:
    """load_causal_lm's options of a `model` config (model.trust_remote_code, model.attn_implementation; the
    embedded models have the second only), the group they are set in and the key of the path, for its messages
    (an embedded model's folder is klbench's cache: no setting names it)."""
    return {"trust_remote_code": cfg.kind == "hf" and bool(cfg.trust_remote_code),
            "attn_implementation": cfg.attn_implementation, "setting": setting,
            "path_setting": f"{setting}.{key}" if cfg.kind == "hf" else None}


def _lm_path(cfg, cache_root: str | None) -> str:
    if cfg.kind == "embedded":
        return ensure_embedded_lm(preset_spec(cfg.preset, cfg.spec), cache_root)
    if cfg.kind == "hf":
        return cfg.name_or_path
    raise ValueError(f"model.kind must be tabular, embedded or hf; got {cfg.kind!r}")
