"""A generated arithmetic corpus with worked answers: the offline verifiable task of experiment=arith.

A problem is `a+b=` or `a-b=` with operands of 2 to `digits` digits. Its worked answer goes column by column
from the right, carry (or borrow) written into the next column, then the result after a last `=`:

    47+85= 7+5=12, 4+8+1=13, =132
    85-47= 15-7=8, 7-4=3, =38                  (a borrow: 10 added to the top digit, 1 taken from the next)
    47-85= 85-47: 15-7=8, 7-4=3, =-38          (a < b: the swapped difference, negated)

A share `noise_fraction` of the worked answers slips once: one column's result is off by one (up or down, never
below 0), and every later column and the result follow the slip, as a pupil's would: the answer is then wrong.
A model pretrained on this corpus makes such slips at about the corpus's rate, so its accuracy sits near
1 - noise_fraction, and RL with reward=answer can raise it by making slips rarer: the right answers are already
in the model's support (docs/rlvr.md gives the measured accuracies).

Held-out problems: the pairs (a, op, b) whose hash falls in the validation tenth never appear in the
pretraining corpus nor among the training prompts; validation prompts are drawn from them only.

    generate_arith(n, seed, noise_fraction, digits) -> n texts "prompt worked-answer"
    arith_prompts("train" | "val", n, digits, seed) -> n prompts
    arith_answer(prompt) -> the exact result, as text;  ArithAnswers(): prompt -> answer, for reward=answer
"""
from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping

PROMPT = re.compile(r"^(\d+)([+-])(\d+)=$")


def _is_val(a: int, op: str, b: int) -> bool:
    """The validation tenth of all problems, fixed by a hash of the problem (independent of any seed)."""
    return hashlib.sha256(f"{a}{op}{b}".encode()).digest()[0] < 26  # 26/256 ~ 10%


def _problem(rng: random.Random, digits: int, split: str) -> tuple[int, str, int]:
    while True:
        a, b = (rng.randrange(10, 10 ** rng.randint(2, digits)) for _ in range(2))
        op = rng.choice("+-")
        if _is_val(a, op, b) == (split == "val"):
            return a, op, b


def _columns(x: int, y: int, op: str, slip_at: int | None, slip: int) -> tuple[list[str], int]:
    """The worked columns of x op y (x >= y for -), and the result they add up to; column `slip_at` is off by slip
    (by +1 where -1 would go below 0)."""
    n = max(len(str(x)), len(str(y)))
    xs, ys = [int(c) for c in str(x).zfill(n)[::-1]], [int(c) for c in str(y).zfill(n)[::-1]]
    steps, digits, carry = [], [], 0  # carry: into this column (+), or the borrow taken from it (-)
    for i in range(n):
        if op == "+":
            lhs, value = f"{xs[i]}+{ys[i]}" + (f"+{carry}" if carry else ""), xs[i] + ys[i] + carry
        else:
            top = xs[i] - carry
            borrow = int(top < ys[i])
            top += 10 * borrow
            lhs, value = f"{top}-{ys[i]}", top - ys[i]
        if i == slip_at:
            value = value + slip if value + slip >= 0 else value + 1
        steps.append(f"{lhs}={value}")
        digits.append(value % 10)
        carry = value // 10 if op == "+" else borrow
    result = int("".join(map(str, digits[::-1]))) + (carry * 10 ** n if op == "+" else 0)
    return steps, result


def worked_answer(a: int, op: str, b: int, slip_at: int | None = None, slip: int = 1) -> str:
    """The response text of a op b (module docstring); slip_at: the column (from the right) that slips by `slip`."""
    x, y, neg = (b, a, True) if op == "-" and a < b else (a, b, False)
    steps, result = _columns(x, y, op, slip_at, slip)
    head = f" {x}-{y}:" if neg else ""
    return f"{head} {', '.join(steps)}, ={'-' if neg and result else ''}{result}"


def generate_arith(n: int, seed: int = 0, noise_fraction: float = 0.5, digits: int = 3) -> list[str]:
    """n training texts `prompt + worked answer`, a share noise_fraction of them with one slip."""
    if not 0.0 <= noise_fraction <= 1.0:
        raise ValueError(f"generate_arith: noise_fraction must be in [0, 1], got {noise_fraction}")
    if digits < 2:
        raise ValueError(f"generate_arith: digits must be >= 2 (multi-digit operands), got {digits}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, op, b = _problem(rng, digits, "train")
        slip_at = rng.randrange(len(str(max(a, b)))) if rng.random() < noise_fraction else None
        out.append(f"{a}{op}{b}=" + worked_answer(a, op, b, slip_at, rng.choice((-1, 1))))
    return out


def arith_prompts(split: str, n: int, digits: int = 3, seed: int = 0) -> list[str]:
    """n prompts `a+b=` / `a-b=` of one split (train never contains a validation problem)."""
    if split not in ("train", "val"):
        raise ValueError(f"arith_prompts: split must be 'train' or 'val', got {split!r}")
    rng = random.Random(f"{split}-{seed}")
    return [f"{a}{op}{b}=" for a, op, b in (_problem(rng, digits, split) for _ in range(n))]


def arith_answer(prompt: str) -> str:
    """The exact result of an arithmetic prompt `a+b=` or `a-b=`."""
    m = PROMPT.match(prompt)
    if m is None:
        raise KeyError(f"not an arithmetic prompt of experiment=arith (`a+b=` or `a-b=`): {prompt[:80]!r}")
    a, op, b = int(m[1]), m[2], int(m[3])
    return str(a + b if op == "+" else a - b)


class ArithAnswers(Mapping):
    """prompt -> its exact answer, computed from the prompt: the reference of reward=answer for dataset=arith."""

    def __getitem__(self, prompt: str) -> str:
        return arith_answer(prompt)

    def __contains__(self, prompt) -> bool:
        return isinstance(prompt, str) and PROMPT.match(prompt) is not None

    def __iter__(self):
        raise TypeError("ArithAnswers computes answers; it has no list of prompts")

    def __len__(self) -> int:
        raise TypeError("ArithAnswers computes answers; it has no list of prompts")
