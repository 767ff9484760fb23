"""A model path or a LoRA target that cannot work is refused before any model loads (the CLI's check).

    check_model_folders(cfg)    # raises ConfigError naming the setting, in well under a second for a path

Loading a model to learn that its folder is missing took 22 s on a loaded VM (torch, Lightning and
transformers first), and a LoRA target that matches no module 26 s. A path needs no import at all: the
same tests as klbench.models.hf.resolve_pretrained, with its words, without importing torch. A LoRA target
is checked against the modules that own a weight matrix in the folder's safetensors headers (JSON, read in
milliseconds); where the folder has no safetensors, or ties its output layer to the input embedding (which
save_pretrained leaves out of the file), against the architecture built on the meta device from its
config.json (no weights read; torch and transformers imported, which the run needs next anyway). Anything
this check cannot tell (a hub id, remote code, a config transformers cannot build) is left to the load,
which says it as before.
"""
from __future__ import annotations

import json
import os
import re

from omegaconf import DictConfig

from klbench.config.errors import ConfigError
from klbench.models.folder import check_config_json


def check_model_folders(cfg: DictConfig) -> None:
    for setting, node, keys in (("model", cfg.get("model"), ("name_or_path", "ref_name_or_path")),
                                ("teacher", cfg.get("teacher"), ("name_or_path",))):
        if node is None or node.get("kind") != "hf":
            continue
        for key in keys:
            check_path(str(node[key]), f"{setting}.{key}")
        lora = node.get("lora") or {}
        if lora.get("r") and lora.get("target_modules"):
            check_lora_targets(str(node.name_or_path), list(lora.target_modules), bool(node.get("trust_remote_code")))


def _looks_like_path(name: str) -> bool:
    # as klbench.models.hf: hub ids are "name" or "owner/name"; anything else is meant as a path
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def check_path(name: str, what: str) -> None:
    """klbench.models.hf.resolve_pretrained's refusals, word for word, before torch is imported."""
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", name):
        raise ConfigError(f"{what}={name} is a URL, which transformers does not load: give a hub id "
                          "(owner/name) or a local folder written by save_pretrained")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        check_config_json(path, what)
    elif os.path.exists(path):
        raise ConfigError(f"{what}: {name!r} is a file, expected a directory written by save_pretrained")
    elif _looks_like_path(name):
        raise ConfigError(f"{what}: local path {os.path.abspath(path)!r} does not exist; give a folder "
                          "written by save_pretrained or a hub id (owner/name)")


def check_lora_targets(name: str, targets: list[str], trust_remote_code: bool) -> None:
    """Every model.lora.target_modules entry must name some module of the model, as peft matches a list (the
    module's name, or its last dotted parts). peft refuses only a list that matches nothing; one misspelt
    name among others would train fewer modules without a word, so each is checked here."""
    folder = os.path.expanduser(name)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return  # a hub id: its config may be in no cache yet; the load says what it finds
    names = saved_matrices(folder)  # milliseconds: the safetensors headers, no torch
    missing = _missing(targets, names)
    if missing and (names is None or _ties_embeddings(folder)):
        # no safetensors, or an output layer tied to the input embedding, which save_pretrained leaves out of
        # the file: the modules of the architecture itself, built on the meta device (seconds: torch, transformers)
        names = module_matrices(folder, trust_remote_code)
        missing = _missing(targets, names)
    if missing:
        raise ConfigError(f"model.lora.target_modules={targets}: {', '.join(missing)} "
                          f"{'names' if len(missing) == 1 else 'name'} no module of {name}; its modules with a "
                          f"weight matrix are named {sorted({n.rsplit('.', 1)[-1] for n in names})}")


def _missing(targets: list[str], names) -> list[str]:
    if names is None:
        return []  # nothing to check against: the load (peft) says it
    return [t for t in targets if t != "all-linear" and not any(n == t or n.endswith("." + t) for n in names)]


def _ties_embeddings(folder: str) -> bool:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return bool(config.get("tie_word_embeddings", True))  # transformers' default


def saved_matrices(folder: str) -> set[str] | None:
    """The modules that own a 2-D weight in the folder's safetensors files (`model.layers.0.self_attn.q_proj`),
    read from the files' JSON headers; None where the folder has no safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    try:
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(folder, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            return None
        names = set()
        for file in files:
            with open(os.path.join(folder, file), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))  # safetensors: length, JSON
            names |= {k[:-len(".weight")] for k, v in header.items()
                      if k.endswith(".weight") and len(v.get("shape", ())) == 2}
        return names
    except (OSError, ValueError, KeyError, AttributeError):  # a file safetensors cannot read either: the load says it
        return None


def module_matrices(folder: str, trust_remote_code: bool) -> set[str] | None:
    """The modules that own a 2-D weight in the folder's architecture, built on the meta device from its
    config.json (no weights read); None where transformers cannot build it that way."""
    import torch
    import transformers
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True,
                                                         trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # remote code not trusted, an architecture of another kind: the load reports it
        return None
    return {n for n, m in model.named_modules()
            if n and getattr(getattr(m, "weight", None), "ndim", 0) == 2}
