"""FSDP2 (`fully_shard`) on a language-model policy (hardware=fsdp; the Lightning side: klbench/tasks/sharding.py).

    shard_policy(policy, mesh, mp)   # the policy's decoder layers, then its root; the reference on its own
    with gathered(modules): ...      # those modules' whole parameters, held across forwards (rollouts, LM heads)

Why each choice:
- The reference is sharded as a tree of its own, never under the policy's root: a root over both would put the
  frozen reference in the policy's unit (and a unit mixing trainable and frozen tensors of two models). Under LoRA
  the reference is the policy's own base (klbench.models.lora.WithoutAdapter): nothing more to shard.
- The policy's root keeps its parameters after forward (FSDP2's default for a root: backward needs them at
  once); the reference's root reshards after forward, since no backward follows.
- A rollout gathers every unit once and decodes unsharded (`gathered`): a decode step through sharded layers
  would all-gather each layer at each token.
- klbench scores from hidden states and reads the LM head's weight outside the model's forward
  (klbench.models.head). Between forwards that weight is a shard (a DTensor), so scoring gathers the unit that owns
  the head around each micro-batch and its backward (klbench.models.head.gathered_heads); the head's gradient lands
  in the unsharded parameter, which FSDP's post-backward reduce-scatters into the shard like any other.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# each unit's own reshard_after_forward, restored when a `gathered` block ends
_RESHARD: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformers' `_no_split_modules`: LlamaDecoderLayer, GPT2Block, ...)."""
    base = model
    while not hasattr(base, "_no_split_modules") and hasattr(base, "base_model") and base.base_model is not base:
        base = base.base_model  # peft: PeftModel -> LoraModel -> the transformers model
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _shard(module: nn.Module, mesh, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    _RESHARD[module] = reshard


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_policy(policy, mesh, mp: MixedPrecisionPolicy) -> None:
    """Shards policy.model (each decoder layer, then the root) and policy.ref (the same, as its own tree) in place
    over `mesh`; idempotent (Lightning calls configure_model before validate and again before fit)."""
    if is_sharded(policy.model):
        return
    for name, model, root_reshard in (("policy", policy.model, False), ("reference", policy.ref, True)):
        if getattr(model, "peft_model", None) is policy.model:
            continue  # LoRA: the reference is the policy's base with the adapter off, sharded with it
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(f"hardware=fsdp: the {name} ({type(model).__name__}) names no decoder layer class "
                             "(transformers' _no_split_modules) to shard by")
        for layer in layers:
            _shard(layer, mesh, mp, True)
        _shard(model, mesh, mp, root_reshard)
    policy.sampler = GatheredSampler(policy.sampler)


@contextmanager
def gathered(modules, release: bool = True):
    """The FSDP units `modules` hold whole parameters inside the block: one all-gather each on entry, none at
    the forwards inside, and (release) resharded on exit. Non-units are skipped."""
    units = [m for m in dict.fromkeys(modules) if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            if release:
                m.reshard()
            m.set_reshard_after_forward(_RESHARD.get(m, True), recurse=False)


def head_owner(model: nn.Module, head: nn.Module) -> FSDPModule | None:
    """The innermost FSDP unit whose parameters include the LM head's (None: the head is not sharded)."""
    owner = None
    for m in model.modules():  # parents before children: the last match is the innermost
        if isinstance(m, FSDPModule) and any(x is head for x in m.modules()):
            owner = m
    return owner


class GatheredSampler:
    """A rollout sampler (klbench.models.rollout) that decodes a sharded model unsharded: every unit gathered once
    for the whole rollout, then resharded. Costs the whole model's parameters on each rank for the rollout's length
    (docs/scale-out.md)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, model, *args, **kwargs):
        with gathered([m for m in _tree(model).modules() if isinstance(m, FSDPModule)]):
            return self.inner(model, *args, **kwargs)


def _tree(model: nn.Module) -> nn.Module:
    """The module tree that holds a model's parameters (a LoRA reference's is its peft model's)."""
    return getattr(model, "peft_model", None) or model


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        total += t.numel() * t.element_size()
    return total


def memory_per_rank(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds for parameters (policy and reference), gradients and the optimizer's state."""
    params = list(module.parameters())
    state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
            "optimizer": local_bytes(state)}
