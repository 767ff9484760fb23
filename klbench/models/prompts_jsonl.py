"""The one reader of jsonl prompt files (dataset=jsonl): used by klbench.models.data to load them and by
klbench.config.schema to check them before torch is imported, so both agree on what a valid file is."""
from __future__ import annotations

import json
import os


def read_prompts(path: str, field: str) -> list[str]:
    """The `field` string of every non-blank line; errors name `path:line`. UTF-8, a byte-order mark at the
    start accepted (editors on Windows write one)."""
    if os.path.isdir(path):
        raise FileNotFoundError(f"dataset file {path!r} is a directory; give a .jsonl file (one JSON object a line)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    out = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i} is not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i} is not a JSON object (got {type(row).__name__})")
            if field not in row:
                raise ValueError(f"{path}:{i} has no field {field!r} (dataset.field); keys: {sorted(row)}")
            if not isinstance(row[field], str):  # str(None) or str(3) would be a silent, meaningless prompt
                raise ValueError(f"{path}:{i} field {field!r} is not a string: {row[field]!r}")
            out.append(row[field])
    if not out:
        raise ValueError(f"dataset file {path!r} holds no prompts")
    return out
