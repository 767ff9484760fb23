"""The lines that refuse a rollout engine's combination (task.sampler, task.behaviour), without torch: the config
schema (klbench/config/sampler_rules.py) and the policies (klbench.models.interface) say the same words."""
from __future__ import annotations


def engine_truncation(engine: str, sampling: str) -> str:
    """The one line that refuses task.behaviour=sampler for an engine that is not the trainer, under truncation."""
    return (f"task.behaviour=sampler with task.sampler's {engine} and a truncating sampler ({sampling}): the engine "
            "cuts top-k/top-p on its own logits, so it may never draw tokens the trainer's pi_s keeps, and no "
            "importance weight can fix that; sample without top_k/top_p, or use task.behaviour=scorer")
