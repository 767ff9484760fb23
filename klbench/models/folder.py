"""A model folder's config.json, checked without torch or transformers: by the CLI before anything is imported
(klbench.config.model_checks) and by the loader (klbench.models.hf) before transformers tries the folder."""
from __future__ import annotations

import json
import os

from klbench.config.errors import MissingInput


def check_config_json(path: str, what: str) -> None:
    """MissingInput, one line naming `what` (the setting), unless the folder holds a config.json that is JSON: said
    before transformers tries (it blamed an empty folder on sentencepiece, a broken config.json with 60 lines of
    traceback)."""
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
