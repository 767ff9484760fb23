"""Causal LMs from the Hugging Face hub or a local save_pretrained folder, one code path for both.

    load_causal_lm(name_or_path, dtype="float32", trust_remote_code=False, attn_implementation=None,
                   setting="model") -> (model, tokenizer)
    check_same_vocab(tok_a, tok_b, what_a="policy", what_b="reference")
    context_length(config) -> ("n_positions", 1024): the positions prompt and response share
    generation_defaults(model) -> ([stop ids], {"temperature": 0.7, ...}): what its generation_config sets
    unapplied_generation_options(model) -> {"repetition_penalty": 1.2, ...}: what it sets that klbench does not apply

The embedded models are folders like any other: klbench.models.embedded builds and caches
them, and they load here.
"""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klbench.config.errors import ConfigError, MissingInput
from klbench.console import messages as console
from klbench.models import ATTN_IMPLEMENTATIONS, DTYPES
from klbench.models.folder import check_config_json

log = logging.getLogger(__name__)


# the config attributes that name a causal LM's context (positions for prompt and response together)
_CONTEXT_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length")


def context_length(config) -> tuple[str, int] | None:
    """(attribute, positions) of a model config's context, e.g. ("n_positions", 1024) for GPT-2; None for a
    model whose config names none (then nothing can be checked against it)."""
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


def generation_defaults(model) -> tuple[list[int], dict]:
    """What a loaded model's generation_config sets for sampling: every id of its eos_token_id (one id or a list;
    [] when unset) and those of temperature, top_k, top_p it sets (transformers 5 leaves the others None).
    klbench.models.policies.build_policy says what the run does with them."""
    g = getattr(model, "generation_config", None)
    if g is None:
        return [], {}
    eos = g.eos_token_id
    ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
    return ids, {k: getattr(g, k) for k in ("temperature", "top_k", "top_p") if getattr(g, k, None) is not None}


# generation_config entries that klbench's sampling honours (the stop ids; temperature, top_k, top_p, said by
# klbench.models.policies), or that change nothing in it (it always samples; ids and transformers' bookkeeping)
_HONOURED = {"temperature", "top_k", "top_p", "do_sample", "eos_token_id", "pad_token_id", "bos_token_id",
             "decoder_start_token_id", "transformers_version", "_from_model_config", "use_cache"}
# entries that change what generate() returns or how fast, never which tokens it samples: what it outputs beside
# the ids, its cache and compilation, and speculative decoding (which keeps the sampled distribution). Naming
# them at start-up ("output_attentions=False, which klbench does not apply") was noise in every run (issue 51)
_NOT_SAMPLING = {"output_attentions", "output_hidden_states", "output_scores", "output_logits",
                 "return_dict_in_generate", "num_return_sequences", "cache_implementation", "cache_config",
                 "max_cache_len", "return_legacy_cache", "compile_config", "disable_compile", "low_memory",
                 "prefill_chunk_size", "continuous_batching_config", "is_assistant", "assistant_confidence_threshold",
                 "assistant_early_exit", "assistant_lookbehind", "target_lookbehind", "num_assistant_tokens",
                 "num_assistant_tokens_schedule", "prompt_lookup_num_tokens", "max_matching_ngram_size",
                 "speculation_type"}


def unapplied_generation_options(model) -> dict:
    """What a model's generation_config sets that klbench's rollouts do not apply, e.g. {"repetition_penalty": 1.2,
    "no_repeat_ngram_size": 3}: its non-default entries (GenerationConfig.to_diff_dict) that change what a model
    samples, i.e. less _HONOURED and _NOT_SAMPLING. Under task.max_new_tokens, the folder's max_length or
    max_new_tokens are among them."""
    g = getattr(model, "generation_config", None)
    if g is None:
        return {}
    return {k: v for k, v in sorted(g.to_diff_dict().items()) if k not in _HONOURED and k not in _NOT_SAMPLING}


# ----------------------------------------------------------------------------- loading (hub id or local path)

_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE read now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(name: str) -> bool:
    # hub ids are "name" or "owner/name"; anything else is meant as a path
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def resolve_pretrained(name_or_path: str, what: str = "model") -> tuple[str, dict]:
    """(name to pass to from_pretrained, extra kwargs); raises at once for a missing path.

    A local directory loads as is, once it holds a readable config.json. A URL, something that looks
    like a path but is not a directory, an empty folder or one without a model raise MissingInput
    (`what`: the setting, e.g. model.name_or_path). A hub id under HF_HUB_OFFLINE=1 loads from the cache
    only (local_files_only), so a miss fails in milliseconds instead of hanging on the network.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"{what}: expected a Hugging Face model id or a local directory, got {name_or_path!r}")
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", name_or_path):
        raise MissingInput(f"{what}={name_or_path} is a URL, which transformers does not load: give a hub id "
                           "(owner/name) or a local folder written by save_pretrained")
    expanded = os.path.expanduser(name_or_path)
    if os.path.isdir(expanded):
        _check_model_folder(expanded, what)
        return expanded, {"local_files_only": True}
    if os.path.exists(expanded):
        raise MissingInput(f"{what}: {name_or_path!r} is a file, expected a directory written by save_pretrained")
    if _looks_like_path(name_or_path):
        raise MissingInput(f"{what}: local path {os.path.abspath(expanded)!r} does not exist; give a folder "
                           "written by save_pretrained or a hub id (owner/name)")
    return name_or_path, ({"local_files_only": True} if hub_offline() else {})


def _check_model_folder(path: str, what: str) -> None:
    """A folder is a model when it holds a config.json that is JSON; said before transformers tries (it
    blamed an empty folder on sentencepiece, a broken config.json with 60 lines of traceback)."""
    check_config_json(path, what)
    generation = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation):
        # transformers ignores a generation_config.json it cannot read and falls back to config.json: the
        # folder's sampling options and its extra stop ids would be dropped without a word
        try:
            with open(generation, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, OSError) as e:
            raise MissingInput(f"{what}: {generation} is not valid JSON ({e}): its stop ids and sampling options "
                               "would be ignored; correct the file, or write it again with "
                               "GenerationConfig.save_pretrained") from None


def _from_pretrained(loader, name_or_path: str, what: str, setting: str = "model", **kwargs):
    name, extra = resolve_pretrained(name_or_path, what)
    console.quiet_transformers()  # its "Loading weights" bar, at default verbosity
    auto = getattr(getattr(loader, "__self__", None), "__name__", "transformers")  # AutoModelForCausalLM, ...
    try:
        return loader(name, **extra, **kwargs)
    except OSError as e:  # transformers raises OSError (or subclasses) for missing files / cache misses
        where = ("not in the local Hugging Face cache and HF_HUB_OFFLINE=1" if extra and not os.path.isdir(name)
                 else "could not be loaded")
        raise MissingInput(f"{what}: {name_or_path!r} {where}: {_first_line(e)}") from e
    except ValueError as e:
        if "trust_remote_code" in str(e):
            # transformers' own text asks for a Python argument (or prompts on a terminal): name the setting instead
            raise ConfigError(f"{setting}.trust_remote_code=false, but {name_or_path!r} ships its own Python code "
                              f"(auto_map in its config): set {setting}.trust_remote_code=true to run that code, "
                              "after reading it") from None
        if not os.path.isdir(name):
            raise
        # a config of another kind of model (Unrecognized configuration class ...)
        kind = {"AutoModelForCausalLM": "a causal LM", "AutoModelForSequenceClassification": "a sequence "
                "classifier"}.get(auto, f"what {auto} loads")
        with open(os.path.join(name, "config.json"), encoding="utf-8") as f:  # read by _check_model_folder
            model_type = json.load(f).get("model_type")
        raise MissingInput(f"{what}: {name_or_path} is not {kind}: its config.json says model_type "
                           f"{model_type!r}, which {auto} does not load; give a folder holding {kind} and "
                           "its tokenizer") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_causal_lm(name_or_path: str, dtype: str = "float32", trust_remote_code: bool = False,
                   attn_implementation: str | None = None, setting: str = "model", path_setting: str | None = None):
    """(AutoModelForCausalLM, AutoTokenizer) from a hub id or a local directory; eval mode, left padding.

    trust_remote_code: run the folder's own modelling code (transformers refuses it otherwise).
    attn_implementation: one of ATTN_IMPLEMENTATIONS, or None for the model's default.
    setting: the config group the options came from ("model" or "teacher"), for the messages.
    path_setting: the setting name_or_path came from (e.g. "model.ref_name_or_path"): a missing folder or an
    uncached hub id is then a one-line ConfigError naming it (else FileNotFoundError, for Python callers).
    """
    try:
        return _load_causal_lm(name_or_path, dtype, trust_remote_code, attn_implementation, setting,
                               path_setting or "load_causal_lm")
    except FileNotFoundError as e:
        if path_setting is None or isinstance(e, ConfigError):  # MissingInput names the setting already
            raise
        raise ConfigError(str(e).strip().splitlines()[0]) from None  # the rest: transformers' advice for Python
    except (OSError, ValueError) as e:  # a folder transformers cannot read as a causal LM and its tokenizer
        if path_setting is None or isinstance(e, ConfigError):
            raise
        said = " ".join(str(e).split()) or type(e).__name__  # one line: transformers' lists span several
        raise ConfigError(f"{path_setting}={name_or_path} could not be loaded as a causal LM and its tokenizer: "
                          f"{said[:400]}") from None


def _load_causal_lm(name_or_path: str, dtype: str, trust_remote_code: bool, attn_implementation: str | None,
                    setting: str, what: str):
    if dtype not in _DTYPES:
        raise ValueError(f"load_causal_lm: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if attn_implementation is not None and attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"{setting}.attn_implementation={attn_implementation} is unknown; valid: null, "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    resolve_pretrained(name_or_path, what)  # a missing path fails here, before any loading
    remote = {"trust_remote_code": bool(trust_remote_code)}  # explicit: never transformers' terminal prompt
    tok = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, f"{what} (tokenizer)", setting, **remote)
    attn = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name_or_path, f"{what} (model)", setting,
                                 dtype=_DTYPES[dtype], **remote, **attn)
    except (ImportError, ValueError) as e:
        if not attn or isinstance(e, ConfigError):
            raise
        # the implementation's package is missing, or the architecture does not support it
        # its first sentence: the rest suggests Python arguments (attn_implementation="eager"), not settings
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0]
        raise ConfigError(f"{setting}.attn_implementation={attn_implementation} cannot load {name_or_path!r}: "
                          f"{first} (valid: null, {', '.join(ATTN_IMPLEMENTATIONS)})") from None
    if tok.pad_token is None:  # GPT-2 has no pad token; masks must then come from attention_mask, not ids
        if tok.eos_token is None:
            raise ValueError(f"load_causal_lm: tokenizer of {name_or_path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    impl = model.config._attn_implementation
    if dtype != "float32" and impl != "eager":
        # measured on CPU, tiny models of 8 architectures (docs/instruct.md): up to 0.14 nats with SDPA, 1e-6 eager
        log.warning("%s.dtype=%s with %s attention: the sampler's and the scorer's log-probs of a token differ (up "
                    "to 0.14 nats on tiny models, docs/instruct.md); %s.attn_implementation=eager makes them agree",
                    setting, dtype, impl, setting)
    return model, tok


def check_same_vocab(tok_a, tok_b, what_a: str = "policy", what_b: str = "reference") -> None:
    """Raise ValueError unless both tokenizers map the same strings to the same ids (and agree on special ids)."""
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    if va != vb:
        only_a = sorted(set(va) - set(vb))[:5]
        only_b = sorted(set(vb) - set(va))[:5]
        moved = sorted(t for t in set(va) & set(vb) if va[t] != vb[t])[:5]
        raise ValueError(f"{what_a} and {what_b} tokenizers differ: {what_a} has {len(va)} tokens, {what_b} has {len(vb)}; "
                         f"only in {what_a}: {only_a}; only in {what_b}: {only_b}; different ids: {moved}. "
                         f"KL between them is undefined: use models that share one tokenizer.")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(tok_a, attr), getattr(tok_b, attr)
        if a != b:
            raise ValueError(f"{what_a} and {what_b} tokenizers differ in {attr}: {a} vs {b}")


def enable_checkpointing(model, setting: str = "model") -> None:
    """model.gradient_checkpointing: transformers' activation checkpointing of every decoder layer (its activations
    are recomputed in backward instead of kept), with dropout still off.

    transformers checkpoints a layer only while that layer module is in training mode, and klbench keeps every
    model in eval mode (LMPolicy.train: dropout off). So only the checkpointing layers themselves are flagged as
    training (`checkpointing_layers_on`), not their submodules: their dropout modules stay in eval mode. A ConfigError
    naming `setting` where the architecture has no checkpointing."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"{setting}.gradient_checkpointing=true: {type(model).__name__} does not support "
                          f"gradient checkpointing in transformers; set {setting}.gradient_checkpointing=false")
    model.activation_checkpointing_enable({"use_reentrant": False})
    checkpointing_layers_on(model)


def checkpointing_layers_on(model) -> int:
    """Flags the layers transformers checkpoints as training (they then checkpoint whenever gradients are on; see
    enable_checkpointing); returns how many there are: 0 for a model without checkpointing."""
    from transformers.modeling_layers import GradientCheckpointingLayer
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for m in layers:
        m.training = True  # the attribute alone: submodules (dropout) keep eval mode
    return len(layers)
