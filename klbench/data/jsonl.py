"""The one reader of jsonl prompt files (dataset=jsonl): used by klbench.data.prompts to load them and by
klbench.config.schema to check them before torch is imported, so both agree on what a valid file is.

A prompt is a string, or with dataset.chat_template=true also a conversation: a list of {"role": ..., "content":
...} dicts (the `messages` shape of chat datasets), which klbench.data.chat renders with the tokenizer's
template. check_prompt is the one check of both shapes, for jsonl files and HF datasets alike.
"""
from __future__ import annotations

import json
import os

Prompt = str | list  # a text, or a list of {"role": str, "content": str} messages


def check_prompt(value, chat: bool) -> str | None:
    """Why `value` is not a prompt (None: it is one). chat: dataset.chat_template=true (messages allowed)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):  # str(None) or str(3) would be a silent, meaningless prompt
        return f"is not a string{' or a list of messages' if chat else ''}: {value!r}"[:200]
    if not chat:
        return ("is a list (messages?); a conversation is rendered with the tokenizer's chat template: set "
                "dataset.chat_template=true")
    if not value:
        return "is an empty list of messages"
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"message {i} is not a {{'role': str, 'content': str}} dict: {m!r}"[:200]
    return None


def read_prompts(path: str, field: str, chat: bool = False) -> list[Prompt]:
    """The `field` prompt of every non-blank line; errors name `path:line`. chat: messages are allowed."""
    return [p for p, _ in read_rows(path, field, None, chat)]


def read_rows(path: str, field: str, answer_field: str | None = None, chat: bool = False) -> list[tuple[Prompt, object]]:
    """(prompt, answer) of every non-blank line: the `field` prompt and, with answer_field, that field's value
    (a string or a number; None without it). Errors name `path:line` and the field. chat: messages are allowed.
    UTF-8, a byte-order mark at the start accepted (editors on Windows write one)."""
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
            if (why := check_prompt(row[field], chat)) is not None:
                raise ValueError(f"{path}:{i} field {field!r} {why}")
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
