"""Causal LMs from the Hugging Face hub or a local save_pretrained folder, one code path for both.

    load_causal_lm(name_or_path, dtype="float32") -> (model, tokenizer)
    check_same_vocab(tok_a, tok_b, what_a="policy", what_b="reference")
    context_length(config) -> ("n_positions", 1024): the positions prompt and response share

The embedded models are folders like any other: klbench.models.embedded builds and caches
them, and they load here.
"""
from __future__ import annotations

import json
import os
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klbench.config.errors import MissingInput
from klbench.console import messages as console
from klbench.models import DTYPES


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
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        held = sorted(os.listdir(path))
        has = f"holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''} but" if held else "is empty:"
        raise MissingInput(f"{what}: the folder {path} {has} no config.json; give a folder written by "
                           "save_pretrained (model and tokenizer)")
    try:
        with open(config, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MissingInput(f"{what}: {config} is not valid JSON ({e}); the folder is not a saved model: "
                           "save it again with save_pretrained") from None


def _from_pretrained(loader, name_or_path: str, what: str, **kwargs):
    name, extra = resolve_pretrained(name_or_path, what)
    console.quiet_transformers()  # its "Loading weights" bar, at default verbosity
    auto = getattr(getattr(loader, "__self__", None), "__name__", "transformers")  # AutoModelForCausalLM, ...
    try:
        return loader(name, **extra, **kwargs)
    except OSError as e:  # transformers raises OSError (or subclasses) for missing files / cache misses
        where = ("not in the local Hugging Face cache and HF_HUB_OFFLINE=1" if extra and not os.path.isdir(name)
                 else "could not be loaded")
        raise MissingInput(f"{what}: {name_or_path!r} {where}: {_first_line(e)}") from e
    except ValueError as e:  # a config of another kind of model (Unrecognized configuration class ...)
        if not os.path.isdir(name):
            raise
        kind = {"AutoModelForCausalLM": "a causal LM", "AutoModelForSequenceClassification": "a sequence "
                "classifier"}.get(auto, f"what {auto} loads")
        with open(os.path.join(name, "config.json"), encoding="utf-8") as f:  # read by _check_model_folder
            model_type = json.load(f).get("model_type")
        raise MissingInput(f"{what}: {name_or_path} is not {kind}: its config.json says model_type "
                           f"{model_type!r}, which {auto} does not load; give a folder holding {kind} and "
                           "its tokenizer") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def load_causal_lm(name_or_path: str, dtype: str = "float32", setting: str = "load_causal_lm"):
    """(AutoModelForCausalLM, AutoTokenizer) from a hub id or a local directory; eval mode, left padding.
    `setting` names the config value in errors (model.name_or_path, ...)."""
    if dtype not in _DTYPES:
        raise ValueError(f"load_causal_lm: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    resolve_pretrained(name_or_path, setting)  # a missing path fails here, before any loading
    tok = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, f"{setting} (tokenizer)")
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name_or_path, f"{setting} (model)",
                             dtype=_DTYPES[dtype])
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
