"""The rules a policy and its reference (model, and model@teacher) must meet, declared once and without torch: the
config schema checks them before torch is imported (klbench.config.schema), the builders again on what they build
(klbench.models.policies, klbench.models.tabular_policy). Each refusal is one line.

    check_kinds("tabular", "embedded")          # ValueError: ... both be tabular or both be language models
    check_tabular_pair(model, teacher)          # ValueError: student and teacher vocabularies differ: ...
    context_refusal(24, "embedded model (preset reference)", "its model.spec.n_positions", 16)  # the sentence
"""
from __future__ import annotations


def check_kinds(model_kind: str, teacher_kind: str) -> None:
    """A tabular student needs a tabular teacher, and a language model a language model."""
    if (model_kind == "tabular") != (teacher_kind == "tabular"):
        raise ValueError(f"teacher.kind={teacher_kind} and model.kind={model_kind}: student and teacher must both be "
                         "tabular or both be language models")


def check_tabular_pair(model, teacher) -> None:
    """A tabular teacher shares the student's vocabulary, horizon and EOS (model, teacher: their K, T, eos)."""
    if (model.K, model.T, model.eos) != (teacher.K, teacher.T, teacher.eos):
        raise ValueError(f"student and teacher vocabularies differ: model (K={model.K}, T={model.T}, eos={model.eos}) "
                         f"vs teacher (K={teacher.K}, T={teacher.T}, eos={teacher.eos})")


def context_refusal(max_new_tokens: int, what: str, positions: str, n: int) -> str:
    """The refusal of task.max_new_tokens that leaves a context of `n` positions no room for a prompt."""
    return (f"task.max_new_tokens={max_new_tokens} does not fit the context of the {what}: {positions}={n} positions "
            f"hold the prompt and the response together, so task.max_new_tokens must be < {n}")
