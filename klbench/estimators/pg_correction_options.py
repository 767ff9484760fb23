"""task.pg_correction: the policy-gradient correction for a rollout engine that is not the trainer, declared without
torch so that the config schema reads it (the math: klbench/estimators/pg_correction.py, docs/mismatch.md "PG
corrections").

The modes are the libraries' own (TRL 1.16's `vllm_importance_sampling_mode`, verl 0.9.1's rollout correction):
the weight is the trainer's probability of the sampled tokens over the engine's, r = pi / pi_s, per token
(`token_*`) or as the product over the sequence (`sequence_*`); `*_truncate` clamps it into [floor, cap] (TRL's
clamp, verl's TIS), `*_mask` zeroes it outside [floor, cap] (TRL's mask, verl's IcePop and rejection). `none`: no
weight. cap defaults to TRL's vllm_importance_sampling_clip_max 3.0, floor to TRL's clip_min None (no lower bound).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import Field, model_validator

from klbench.estimators.options import Expect, Options

PG_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def check_bounds(cap: float, floor: float | None, where: str = "") -> None:
    """One line when the bounds cannot form an interval [floor, cap] of positive weights (names the keys)."""
    if not cap > 0 or cap != cap or cap == float("inf"):
        raise ValueError(f"{where}cap={cap} must be a finite number > 0 (the largest weight kept)")
    if floor is not None and not 0 < floor <= cap:
        raise ValueError(f"{where}floor={floor} must be in (0, {where}cap={cap}] or null (no lower bound)")


class PGCorrectionFields(Options):
    """task.pg_correction.{mode, cap, floor}: mode one of PG_CORRECTIONS; the weight's bounds [floor, cap]."""
    mode: Literal[PG_CORRECTIONS] = "none"
    cap: Annotated[float, Field(gt=0, allow_inf_nan=False),
                   Expect("a finite number > 0 (the largest weight kept; TRL's clip_max)")] = 3.0
    floor: Annotated[Optional[float], Field(gt=0, allow_inf_nan=False),
                     Expect("a number > 0 or null (no lower bound; TRL's clip_min)")] = None

    @model_validator(mode="after")
    def _bounds(self):
        check_bounds(self.cap, self.floor)
        return self
