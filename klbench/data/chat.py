"""Chat templates (dataset.chat_template=true, dataset.system_prompt): prompts as an instruct model reads them.

    render_prompts(tok, prompts, system_prompt, source) -> list[str]
    template_source(tok) -> "<folder>/chat_template.jinja": the file the tokenizer's chat template came from

Each prompt (a text, taken as one user turn, or a list of role/content messages) becomes the text the
tokenizer's own chat template renders, ending in the generation prompt (the assistant turn's opening), so the
model answers as it was tuned to. The template writes every special token the model expects, BOS included
where the model has one: such prompts are then tokenized without adding special tokens
(LMPolicy.add_special_tokens = False), as transformers' apply_chat_template(tokenize=True) does, or the
tokenizer would put a second BOS in front of the template's.
"""
from __future__ import annotations

import json
import os

from klbench.config.errors import ConfigError
from klbench.data.jsonl import Prompt


def render_prompts(tok, prompts: list[Prompt], system_prompt: str | None, source: str) -> list[str]:
    """The chat-template rendering of every prompt; ConfigError naming `source` (where the prompts come from)."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"dataset.chat_template=true, but the tokenizer ({tok.name_or_path}) has no chat template: "
                          "use an instruct model's folder, or set dataset.chat_template=false for plain prompts")
    from jinja2 import TemplateError  # transformers renders templates with jinja2

    out = []
    for i, prompt in enumerate(prompts):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt is not None:
            if messages[0]["role"] == "system":  # two system turns: which one the user meant is not ours to pick
                raise ConfigError(f"{source}: prompt #{i + 1} has its own system message and dataset.system_prompt "
                                  "is set too: set dataset.system_prompt=null, or drop the prompts' system messages")
            messages = [{"role": "system", "content": system_prompt}, *messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # e.g. a template that refuses a system turn, or roles out of order
            raise ConfigError(f"{source}: the chat template of {tok.name_or_path} refuses prompt #{i + 1} "
                              f"({e}); dataset.system_prompt={system_prompt!r}") from None
        if not text.strip():  # nothing to condition on: the model would fail on an empty input, 100 lines deep
            raise ConfigError(f"{source}: the chat template ({template_source(tok)}) renders prompt #{i + 1} as an "
                              "empty text: correct the template so that it writes the messages, or set "
                              "dataset.chat_template=false for plain prompts")
        out.append(text)
    return out


# where transformers 5 reads a folder's template from, in its order of precedence
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def template_source(tok) -> str:
    """The file a tokenizer's chat template came from (its folder's chat_template.jinja, chat_template.json or
    tokenizer_config.json), or `<name> (hub id)` where the tokenizer came from the hub cache; `none` without one."""
    if not getattr(tok, "chat_template", None):
        return "none"
    folder = tok.name_or_path
    for name in _TEMPLATE_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if name != "tokenizer_config.json":
            return path
        try:
            with open(path, encoding="utf-8") as f:
                if "chat_template" in json.load(f):
                    return path
        except (ValueError, OSError):
            pass
    return f"{folder} (the tokenizer's own)"
