"""A model's LM head as klbench.estimators.head_scores reads it, and its forward up to the head's input.

    head = read_head(model)        # an LMHead (weight, bias, logit scale, final-logit softcap), or why not (str)
    h = final_hidden(model, ...)   # [B, L, H]: what the output embedding would project, no [B, L, V] logits

Generic over architectures: the hidden states are what the model's own output embedding (`get_output_embeddings()`)
receives in its own forward; for that forward the head's `forward` is replaced by one that hands its input back,
so the logits are never built. A model may change the head's output before returning it (Gemma 2 and 3 softcap
it, Cohere scales it, Granite divides it): `read_head` reads the settings transformers uses for that, then checks
them on the model itself. It runs the forward once with the head returning known values over a wide range and
compares the returned logits with LMHead.post of them. Whatever it cannot read (a head that is no plain
nn.Linear, a LoRA adapter on the head, hooks, a transformation it does not model) is a reason, and the policy
keeps the logits path (klbench.models.lm_policy says so in one line).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from klbench.estimators.head_scores import LMHead


@contextmanager
def gathered_heads(*models, release: bool = True):
    """Whole LM-head weights inside the block, also under hardware=fsdp, where between forwards each is a shard of
    the FSDP unit that owns it: that unit is gathered for the block (klbench.models.fsdp.gathered; release: resharded
    after it, so a block must hold the backward that reads the weights). Nothing happens without sharding."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        yield
        return
    from klbench.models.fsdp import gathered, head_owner
    owners = []
    for model in models:
        tree = getattr(model, "peft_model", None) or model  # a LoRA reference: its peft model holds the head
        head = output_head(model)
        if head is not None:
            owners.append(head_owner(tree, head))
    with gathered([o for o in owners if o is not None], release):
        yield


def output_head(model) -> nn.Module | None:
    """The module that projects the final hidden states onto the vocabulary, or None."""
    get = getattr(model, "get_output_embeddings", None)
    if get is None and hasattr(model, "peft_model"):  # klbench.models.lora.WithoutAdapter
        get = model.peft_model.get_output_embeddings
    return get() if get is not None else None


def _settings(config) -> tuple[float, float | None]:
    """(scale, softcap) of transformers' post-processing of the head's output, from the (text) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = _number(text, "logit_scale") or 1.0  # Cohere: logits * logit_scale
    divide = _number(text, "logits_scaling")  # Granite: logits / logits_scaling
    if divide:
        scale /= divide
    cap = _number(text, "final_logit_softcapping")  # Gemma 2, Gemma 3
    return scale, cap or None


def _number(config, key: str) -> float | None:
    """config.<key> as a finite number (None if absent); ConfigError naming the key otherwise: `logit_scale: "abc"`
    in a config.json was a 34-line ValueError (issue 50)."""
    import math

    from klbench.config.errors import ConfigError
    value = getattr(config, key, None)
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        where = getattr(config, "_name_or_path", "") or "the model folder"
        raise ConfigError(f"{key}={value!r} in {where}'s config.json: the model's logits post-processing needs a "
                          "finite number there; fix the config.json")
    return number


def read_head(model, check: bool = True) -> LMHead | str:
    """The model's LMHead (temperature 1), or the reason the fused path cannot read it. check: run the model once
    to check its post-processing (once per model: LMPolicy reads the head again at each step without it)."""
    head = output_head(model)
    if type(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear (an adapter on the LM head?)"
    if head._forward_hooks or head._forward_pre_hooks:
        return "its output embedding has forward hooks, whose effect on the logits klbench cannot read"
    scale, cap = _settings(model.config)
    spec = LMHead(head.weight, head.bias, scale, cap)
    gap = _post_gap(model, head, spec) if check else None
    if gap is not None:
        return (f"its forward changes the head's output in a way klbench does not model (logits differ from "
                f"LMHead(scale={scale:g}, softcap={cap}) by up to {gap:.3g})")
    return spec


@torch.no_grad()
def _post_gap(model, head: nn.Linear, spec: LMHead) -> float | None:
    """None if the model returns LMHead.post of what its head outputs, on values from -60 to 60 (past any softcap
    in use, 30 for Gemma 2); else the largest difference."""
    device = head.weight.device
    V = head.out_features
    probe = torch.linspace(-60, 60, V, device=device).to(head.weight.dtype)  # [V]
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    out = _with_head(model, head, lambda x: probe.expand(*x.shape[:-1], V),
                     lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits)
    want = spec.post(probe)  # in the head's dtype, as the model's forward does it
    got = out[0, -1].float()
    gap = float((got - want).abs().max())
    return None if gap <= 1e-5 * 60 else gap


@contextmanager
def _forward_replaced(head: nn.Module, forward):
    """head.forward replaced inside the block (an instance attribute shadows the class's forward); one set before
    (head_precision's, under final_hidden's) is put back."""
    before = head.__dict__.get("forward")
    head.forward = forward
    try:
        yield
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def _with_head(model, head: nn.Module, replacement, run):
    """run() with head.forward replaced for one call."""
    with _forward_replaced(head, replacement):
        return run()


@contextmanager
def head_precision(model, dtype: torch.dtype | None):
    """Inside the block the model's own LM head runs its product in `dtype` with autocast off for it, and returns
    logits in that dtype: model.head_dtype on the paths that call the model's head (rollouts, the logits path), as
    head_scores runs it on the hidden-state path (LMHead.dtype), so that both paths and the sampler see one pi.
    dtype None, a float64 head, a head that is no plain nn.Linear, or one that runs in dtype already (its weight's
    dtype, autocast off): the model's own head, unchanged (no wrapper on every decode step of a float32 run)."""
    head = output_head(model)
    if dtype is None or type(head) is not nn.Linear or head.weight.dtype == torch.float64 or (
            head.weight.dtype == dtype and not torch.is_autocast_enabled(head.weight.device.type)):
        yield
        return

    def product(x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] in dtype
        with torch.autocast(x.device.type, enabled=False):
            b = None if head.bias is None else head.bias.to(dtype)
            return nn.functional.linear(x.to(dtype), head.weight.to(dtype), b)

    with _forward_replaced(head, product):
        yield


def final_hidden(model, L: int, **inputs) -> torch.Tensor:
    """[B, L, H] the final hidden states the head would project at the last L positions it is given
    (inputs: model(**inputs) with logits_to_keep selecting them): the model's forward with the head handing its
    input back. A model that ignores logits_to_keep hands back every position: the L before the last are taken."""
    head = output_head(model)
    seen = {}

    def capture(x):
        seen["h"] = x
        return x

    _with_head(model, head, capture, lambda: model(**inputs))
    h = seen["h"]  # [B, L or T, H]
    return h if h.shape[1] == L else h[:, -(L + 1):-1]
