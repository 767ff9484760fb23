"""reward=answer: a verifiable reward. The final answer is extracted from a response and compared with the
prompt's reference answer (dataset.answer_field).

    extract_answer(text, "last_number" | "gsm8k" | "boxed" | "regex", pattern) -> str | None
    same_answer("1,234.0", "1234") -> True
    AnswerReward(answers, extract, pattern, format_reward)(rollout) -> [B]   1 + format_reward x has_answer for a match

Extraction (None when the response holds no answer; it then scores 0 and is counted, never an error):
    last_number  the last number in the text (signs, thousands separators, decimals: -1,234.5)
    gsm8k        the number after the last `####` (GSM8K's answer line)
    boxed        the content of the last \\boxed{...} (braces balanced)
    regex        the first capture group (or the whole match) of the last match of a user regex
Normalisation: surrounding space, `$`, a trailing `.` are dropped, a unicode minus is `-`, a leading `+` goes,
commas between digit groups go; two answers that both read as numbers are equal when their decimal values are
(`1,234.0` == `1234`, `-0` == `0`); otherwise the normalised strings are compared.

Importing this module imports no torch (the config schema reads EXTRACTS before torch is imported).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

EXTRACTS = ("last_number", "gsm8k", "boxed", "regex")
NUMBER = r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+\u2212]?\.\d+"
_NUMBER = re.compile(NUMBER)
_GSM8K = re.compile(r"####\s*(" + NUMBER + ")")


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None if there is none or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str, extract: str = "last_number", pattern: str | re.Pattern | None = None) -> str | None:
    """The final answer of `text` as the rule `extract` reads it (module docstring), or None."""
    if extract == "last_number":
        found = _NUMBER.findall(text)
        return found[-1] if found else None
    if extract == "gsm8k":
        found = _GSM8K.findall(text)
        return found[-1] if found else None
    if extract == "boxed":
        return _boxed(text)
    if extract == "regex":
        if pattern is None:
            raise ValueError("reward.extract=regex needs reward.pattern, a regular expression")
        matches = list(re.finditer(pattern, text))
        if not matches:
            return None
        m = matches[-1]
        return m.group(1) if m.re.groups else m.group(0)
    raise ValueError(f"reward.extract must be one of {', '.join(EXTRACTS)}; got {extract!r}")


def normalise(answer: str) -> str | Decimal:
    """A Decimal where the answer reads as a number, else the cleaned string (module docstring)."""
    s = answer.strip().replace("\u2212", "-").replace("$", "").strip().rstrip(".").strip()
    num = re.sub(r"(?<=\d),(?=\d{3}(?:\D|$))", "", s).lstrip("+")
    try:
        value = Decimal(num)
    except InvalidOperation:
        return s
    return value if value.is_finite() else s


def same_answer(a: str, b: str) -> bool:
    """Whether two answers are equal after normalisation: decimal values where both are numbers."""
    x, y = normalise(a), normalise(b)
    if isinstance(x, Decimal) and isinstance(y, Decimal):
        return x == y
    return str(x) == str(y)


class AnswerReward:
    """1 for a response whose extracted answer matches its prompt's reference answer, else 0; plus
    format_reward for every response that has an extractable answer at all (0: no format reward).

    answers: prompt text -> reference answer (klbench.data.prompts.load_answers). `judge(ro)` gives the [B]
    correctness and no-answer indicators the RL task logs as accuracy and no_answer.
    """

    def __init__(self, answers: dict[str, str], extract: str = "last_number", pattern: str | None = None,
                 format_reward: float = 0.0):
        if extract not in EXTRACTS:
            raise ValueError(f"reward.extract must be one of {', '.join(EXTRACTS)}; got {extract!r}")
        if (extract == "regex") != (pattern is not None):
            raise ValueError(f"reward.pattern is for reward.extract=regex only (and it needs one); got "
                             f"extract={extract!r}, pattern={pattern!r}")
        self.pattern = re.compile(pattern) if pattern is not None else None
        self.answers, self.extract, self.format_reward = answers, extract, float(format_reward)

    def judge(self, ro) -> dict:
        """{"accuracy": [B] 1.0 where the answer matches, "no_answer": [B] 1.0 where none was extracted}."""
        import torch
        correct, missing = [], []
        for prompt, text in zip(ro.prompts, ro.texts):
            if prompt not in self.answers:
                raise KeyError(f"reward=answer has no reference answer for the prompt {prompt[:80]!r}: the prompts "
                               "must come from the dataset whose dataset.answer_field was read")
            got = extract_answer(text, self.extract, self.pattern)
            missing.append(got is None)
            correct.append(got is not None and same_answer(got, self.answers[prompt]))
        return {"accuracy": torch.tensor(correct, dtype=torch.float32),
                "no_answer": torch.tensor(missing, dtype=torch.float32)}

    def __call__(self, ro):
        j = self.judge(ro)
        return j["accuracy"] + self.format_reward * (1 - j["no_answer"])  # [B]
