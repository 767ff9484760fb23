"""The one reader of jsonl prompt files (dataset=jsonl): used by klbench.models.data to load them and by
klbench.config.schema to check them before torch is imported, so both agree on what a valid file is."""
from __future__ import annotations

import json
import os


def read_prompts(path: str, field: str) -> list[str]:
    """The `field` string of every non-blank line; errors name `path:line`."""
    return [p for p, _ in read_rows(path, field)]


def read_rows(path: str, field: str, answer_field: str | None = None) -> list[tuple[str, object]]:
    """(prompt, answer) of every non-blank line: the `field` string and, with answer_field, that field's value
    (a string or a number; None without it). Errors name `path:line` and the field."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file {path!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
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
            answer = None
            if answer_field is not None:
                if answer_field not in row:
                    raise ValueError(f"{path}:{i} has no field {answer_field!r} (dataset.answer_field); "
                                     f"keys: {sorted(row)}")
                answer = row[answer_field]
                if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                    raise ValueError(f"{path}:{i} field {answer_field!r} (dataset.answer_field) is not a string or "
                                     f"a number: {answer!r}")
            out.append((row[field], answer))
    if not out:
        raise ValueError(f"dataset file {path!r} holds no prompts")
    return out
