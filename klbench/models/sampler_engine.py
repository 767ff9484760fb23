"""The rollout engine when it is not the trainer (task.sampler): real mismatches, not simulated ones.

    spec = EngineSpec(precision="bf16", attn_implementation="same", lag=2)
    engine = Engine(spec, trainable={name: param, ...}, model=policy_model)   # model None: the tabular table
    engine.sync()                 # at a training step's rollout: push the trainer's weights, load those of `lag` ago
    engine.model                  # the copy that draws (a language model), or engine.table(theta) (tabular)

A pipelined RL system (vLLM or SGLang beside an FSDP trainer, AReaL, PipelineRL) samples with another copy of
the policy than the one it trains: in another precision (bf16 kernels for a float32 trainer), with another
attention kernel, and weights some optimiser steps old. Each is an option here:

  precision             the engine's copy of the policy cast to bf16 or float16 (same: the trainer's dtype)
  attn_implementation   the engine's attention implementation (eager or sdpa; same: the trainer's)
  lag                   step s samples with the weights of step max(0, s - lag): a queue of the last `lag`
                        weight snapshots (of the trainable parameters, in the engine's dtype), checkpointed so that
                        a resume draws what the uninterrupted run draws

The engine keeps its own log-probs of what it draws (Rollout.sampled_logp): the behaviour policy of the batch
(task.behaviour=sampler) and the sampler's side of the mismatch meter (train/mismatch_*). Pure torch; the engine
is no part of the module tree (not trained, not checkpointed as weights, not sharded): its queue travels in the
checkpoint as `sampler_engine` (klbench/tasks/rl.py).
"""
from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import torch

from klbench.config.errors import ConfigError

DTYPES = {"bf16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """task.sampler's options (klbench/config/training.py SamplerFields)."""
    precision: str = "same"
    attn_implementation: str = "same"
    lag: int = 0

    @property
    def differs(self) -> bool:
        """Whether the engine is not the trainer's own model."""
        return self != EngineSpec()

    def describe(self) -> str:
        if not self.differs:
            return "the trainer's own model (same weights, precision and attention)"
        parts = []
        if self.precision != "same":
            parts.append(f"a {self.precision} copy of the policy")
        if self.attn_implementation != "same":
            parts.append(f"{self.attn_implementation} attention")
        if self.lag:
            parts.append(f"the weights of {self.lag} optimiser step{'s' * (self.lag > 1)} ago")
        return "an engine that is not the trainer: " + ", ".join(parts)


def engine_spec(task) -> EngineSpec:
    """The EngineSpec of a task config (task.sampler); the trainer's own model where the task has none."""
    s = task.get("sampler") if hasattr(task, "get") else getattr(task, "sampler", None)
    if s is None:
        return EngineSpec()
    return EngineSpec(str(s["precision"]), str(s["attn_implementation"]), int(s["lag"]))


def check_device(precision: str, device: str) -> None:
    """ConfigError in one line where `device` cannot run the engine's precision (a tiny linear layer, a softmax
    and a multinomial draw in that dtype: what a decode step runs); nothing for `same`."""
    if precision not in DTYPES:
        return
    dtype = DTYPES[precision]
    try:
        x = torch.ones(2, 4, dtype=dtype, device=device)
        w = torch.ones(4, 4, dtype=dtype, device=device)
        torch.multinomial(torch.softmax(torch.nn.functional.linear(x, w).float(), -1), 1)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"task.sampler.precision={precision}: this {device} cannot run {dtype} ({first}); "
                          f"use task.sampler.precision=bf16 or same") from None


class Engine:
    """The rollout engine of an EngineSpec that differs from the trainer. trainable: the trainer's trainable
    parameters by name (their values are what the queue snapshots); model: the trainer's language model, copied
    once into the engine's precision and attention (None for the tabular model, whose engine is a table)."""

    def __init__(self, spec: EngineSpec, trainable: dict[str, torch.Tensor], model=None):
        self.spec, self.trainable = spec, trainable
        first = next(iter(trainable.values()))
        self.dtype = DTYPES.get(spec.precision, first.dtype)
        self.model = None
        if model is not None:
            self.model = copy.deepcopy(model).requires_grad_(False).eval()
            if spec.precision != "same":
                self.model.to(self.dtype)
            if spec.attn_implementation != "same":
                try:
                    self.model.set_attn_implementation(spec.attn_implementation)
                except (ValueError, ImportError, AttributeError) as e:
                    raise ConfigError(f"task.sampler.attn_implementation={spec.attn_implementation}: "
                                      f"{type(model).__name__} cannot run it ({str(e).splitlines()[0][:160]})") \
                        from None
        # the last `lag` snapshots before the current step's, oldest first (dtype: the engine's)
        self.queue: deque[dict[str, torch.Tensor]] = deque()
        self.current: dict[str, torch.Tensor] = self._snapshot()
        self.weights, self.synced = self.current, False  # before the first step: the initial weights

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().to(self.dtype, copy=True) for n, p in self.trainable.items()}

    @torch.no_grad()
    def sync(self) -> None:
        """At a training step's rollout: snapshot the trainer's weights now and give the engine those of `lag`
        steps ago (the initial weights for the first `lag` steps)."""
        if self.synced:  # the previous step's snapshot joins the queue only once that step has trained
            self.queue.append(self.current)
        self.current, self.synced = self._snapshot(), True
        while len(self.queue) > self.spec.lag:
            self.queue.popleft()
        # step s: the queue holds the snapshots of steps max(0, s - lag) ... s - 1, so its head is the step lag ago
        # (the initial weights while s < lag); lag 0: this step's own weights
        weights = self.queue[0] if self.queue else self.current
        self.weights = weights
        if self.model is not None:
            params = dict(self.model.named_parameters())
            for name, value in weights.items():
                params[name].copy_(value.to(params[name].device))

    def table(self) -> torch.Tensor:
        """The tabular engine's logit table [P, K] in float64: the weights it samples with, rounded to its
        precision (a bf16 engine's table is the trainer's rounded to bf16)."""
        (value,) = self.weights.values()
        return value.to(torch.float64)

    def to(self, device: torch.device) -> "Engine":
        """The engine's copy on the trainer's device (Lightning moves the policy after it is built)."""
        if self.model is not None and next(self.model.parameters()).device != device:
            self.model.to(device)
        return self

    # ---- the checkpoint: the queue a resume needs to draw what the uninterrupted run draws ----

    def state_dict(self) -> dict:
        return {"lag": self.spec.lag, "queue": [dict(s) for s in self.queue] + ([self.current] if self.synced else [])}

    def load_state_dict(self, state: dict) -> None:
        if int(state["lag"]) != self.spec.lag:
            raise ValueError(f"the checkpoint's rollout engine ran at task.sampler.lag={state['lag']}, this run at "
                             f"{self.spec.lag}")
        snaps = [{n: v.to(self.dtype) for n, v in s.items()} for s in state["queue"]]
        self.queue = deque(snaps[-self.spec.lag:] if self.spec.lag else [])
        self.synced = False  # the next sync snapshots the restored weights and appends nothing twice
        if self.queue:
            self.current = self.queue.pop()
            self.synced = True
