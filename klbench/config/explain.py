"""pydantic's validation errors told as klbench's: the dotted field first, then what it must be, with the
value that was given.

    estimator.beta must be a finite number >= 0 and <= 10000 (...), got nan
    estimator.level must be 'token' or 'sequence', got 'x'
    estimator.lam does not apply to estimator 'rb' (its options: beta)
    task.grad_samples=64 must be <= task.samples=32: ...        (a model_validator's own message)

What a field must be is read from its annotation and constraints (Field(ge=..), Literal, Optional), or from
an `Expect` marker (klbench.estimators.options) where those do not say it.
"""
from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from klbench.estimators.options import Expect


def explain(err: dict, model: type[BaseModel], data: Any, path: str, what: str, tag: str | None = None,
              disc: str | None = None) -> str:
    """One pydantic error (an item of ValidationError.errors()) as klbench words it. `model` (the union member
    `tag` of a config group told apart by `disc`) validated `data`, the node at the dotted `path`; `what` names
    that node in a message about an unknown key ("estimator 'rb'")."""
    loc = list(err["loc"])
    if tag is not None and loc and loc[0] == tag:  # the union member pydantic chose
        loc = loc[1:]
    names, field, value = [], None, data
    holder, holder_names = model, []  # the model whose field (or unknown key) the error is about
    current = model
    for part in loc:
        if current is None or not isinstance(part, str):  # a list index, a union member's type
            break
        holder, holder_names = current, list(names)
        if part not in current.model_fields:  # an unknown key
            names.append(part)
            break
        field = current.model_fields[part]
        names.append(part)
        value = value.get(part) if isinstance(value, dict) else None
        current = _model_in(field.annotation)
    full = ".".join(filter(None, [path, *names]))
    kind = err["type"]
    if kind == "extra_forbidden":
        where = what if holder is model else ".".join(filter(None, [path, *holder_names]))
        keys = [k for k in holder.model_fields if not (holder is model and k == disc)]
        return f"{full} does not apply to {where} (its options: {', '.join(keys) or 'none'})"
    if kind == "missing":
        return f"{full} is missing"
    if current is not None and kind == "value_error":
        # a check across a model's fields (a model_validator): its message names them; qualify the names
        text = str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else err["msg"]
        names_re = "|".join(sorted(map(re.escape, current.model_fields), key=len, reverse=True))
        return re.sub(rf"(?<![\w.])({names_re})=", lambda m: f"{full}.{m.group(1)}=" if full else m.group(0), text)
    if field is None:
        return f"{full or what} must be a mapping, got {value!r}"
    return f"{full} must be {describe(field.annotation, field.metadata)}, got {value!r}"


def _model_in(tp: Any) -> type[BaseModel] | None:
    """The model a field holds (directly or as Optional[model]), else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    return next((m for m in map(_model_in, get_args(tp)) if m is not None), None) if _is_union(tp) else None


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def describe(tp: Any, meta: list) -> str:
    """What a value of annotation `tp` with constraints `meta` must be, in words: "an integer >= 1 or null"."""
    while get_origin(tp) is Annotated:
        tp, meta = get_args(tp)[0], [*meta, *get_args(tp)[1:]]
    meta = [c for m in meta for c in (m.metadata if hasattr(m, "metadata") else [m])]  # a Field() inside Annotated
    expect = [m.text for m in meta if isinstance(m, Expect)]
    if expect:
        return expect[0]
    if _is_union(tp):
        args = get_args(tp)
        kinds = " or ".join(describe(t, meta) for t in args if t is not type(None))
        return kinds + (" or null" if type(None) in args else "")
    if get_origin(tp) is Literal:
        args = get_args(tp)
        return " or ".join(map(repr, args)) if len(args) == 2 else "one of " + ", ".join(map(repr, args))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping"
    what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(tp, str(tp))
    bounds = {k: getattr(m, k) for m in meta for k in ("ge", "gt", "le", "lt", "min_length")
              if getattr(m, k, None) is not None}
    if tp is str and bounds.get("min_length") == 1:
        what = "a non-empty string"
    lo = [(k, bounds[k]) for k in ("ge", "gt") if k in bounds]
    hi = [(k, bounds[k]) for k in ("le", "lt") if k in bounds]
    if lo and hi:
        (lk, lv), (hk, hv) = lo[0], hi[0]
        return f"{what} in {'[' if lk == 'ge' else '('}{_num(lv)}, {_num(hv)}{']' if hk == 'le' else ')'}"
    sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return what + "".join(f" {sym[k]} {_num(v)}" for k, v in lo + hi)


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)
