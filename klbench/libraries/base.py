"""What every library adapter provides: a Setting (a per-sequence loss built on the library's own code),
the version check, source locations, and a recorder of clamps that changed values during a call."""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import os
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from klbench.estimators import KLBatch

LossFn = Callable[[KLBatch], torch.Tensor]


class LibraryMissing(RuntimeError):
    """The library is absent, of another version, or cannot be imported here; str() is the one-line reason."""


def package_file(dist: str, *parts: str) -> str:
    """The path of a file inside an installed package, found without importing the package (whose
    __init__ may pull in what klbench does not install: ray, deepspeed, a whole runtime)."""
    spec = importlib.util.find_spec(dist)
    if spec is None or not spec.submodule_search_locations:
        raise LibraryMissing(f"{dist}: package files not found")
    return os.path.join(list(spec.submodule_search_locations)[0], *parts)


@dataclass
class Setting:
    name: str  # e.g. "trl.grpo.sequence_is"
    loss: LossFn  # KLBatch -> [B] per-sequence loss; its gradient is what the library's optimiser sees
    source: str  # "path/in/package.py:line" of the library code that runs
    aggregation: str  # how the per-sequence loss is formed from the library's per-token output
    note: str = ""
    # "rl": a KL penalty against pi_ref; "distill": on-policy distillation, pi = student, pi_ref = teacher, so
    # the candidates read kl_pi_ref = KL(student || teacher), kl_ref_pi = KL(teacher || student)
    task: str = "rl"
    # the sampling axis (klbench.libraries.audit.SAMPLINGS): the same loss with the library's own scoring, called as
    # scored(raw_batch, sampling) on klbench.exact.tabular.RawBatch (untempered logits and the sampled tokens; the
    # library divides whichever logits it divides by sampling.temperature); None where the adapter cannot call it
    scored: Callable | None = None
    # which logits the library divides by the temperature (policy / reference / old), with its file:line; where
    # `scored` is None, why it cannot be called
    divides_by_t: str = ""


@dataclass
class Library:
    name: str  # distribution name on PyPI
    version: str  # the pinned, supported version
    settings: dict[str, Setting] = field(default_factory=dict)

    @property
    def pip_line(self) -> str:
        return f"pip install --no-deps {self.name}=={self.version}  (or: bash scripts/install_libraries.sh)"


def require(dist: str, supported: str) -> str:
    """The installed version of `dist`, or LibraryMissing naming what was found, what is supported, the pip line."""
    pip = f"pip install --no-deps {dist}=={supported}  (or: bash scripts/install_libraries.sh)"
    try:
        found = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise LibraryMissing(f"{dist}: not installed; supported {supported}; {pip}") from None
    # scripts/audit_versions.py runs the same adapters on other releases, each in its own venv
    if found != supported and os.environ.get("KLBENCH_AUDIT_ANY_VERSION") != "1":
        raise LibraryMissing(f"{dist}: found {found}, supported {supported}; {pip}")
    return found


def source_of(obj, package_root: str | None = None) -> str:
    """'pkg/relative/file.py:line' where a function, method or class of an installed library is defined."""
    obj = inspect.unwrap(obj)
    path = inspect.getsourcefile(obj)
    line = inspect.getsourcelines(obj)[1]
    return f"{_relative(path)}:{line}"


def line_of(obj, text: str) -> str:
    """'pkg/file.py:line' of the first line of an installed function's (or class's) source that contains `text`:
    where a library does a thing, read from the installed package. LibraryMissing if the text is not there."""
    obj = inspect.unwrap(obj)
    lines, start = inspect.getsourcelines(obj)
    for i, line in enumerate(lines):
        if text in line:
            return f"{_relative(inspect.getsourcefile(obj))}:{start + i}"
    raise LibraryMissing(f"{getattr(obj, '__qualname__', obj)}: {text!r} not found in its source")


def line_in(dist: str, path: str, text: str) -> str:
    """line_of for a file that cannot be imported here: 'dist/path:line' of its first line containing `text`."""
    with open(package_file(dist, *path.split("/"))) as f:
        for i, line in enumerate(f, 1):
            if text in line:
                return f"{dist}/{path}:{i}"
    raise LibraryMissing(f"{dist}/{path}: {text!r} not found")


def _relative(path: str) -> str:
    parts = path.split(os.sep)
    if "site-packages" in parts:  # keep the package-relative path: the same on every machine
        parts = parts[len(parts) - parts[::-1].index("site-packages"):]
    return "/".join(parts)


class ClampRecorder:
    """Patches torch.clamp and Tensor.clamp while active and records, as 'file:line', each call made from a
    library file that changed at least one value. Clamps in klbench's own code are not recorded."""

    def __init__(self) -> None:
        self.fired: set[str] = set()

    @contextlib.contextmanager
    def active(self):
        orig_fn, orig_method = torch.clamp, torch.Tensor.clamp
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # klbench/

        def record(inp, out):
            caller = inspect.currentframe().f_back.f_back
            fname = caller.f_code.co_filename
            # an integer clamp (TRL's labels.clamp(min=0) on -100 padding labels) moves no gradient
            if fname.startswith(here) or not isinstance(inp, torch.Tensor) or not inp.is_floating_point():
                return
            with torch.no_grad():
                changed = bool((out.detach() != inp.detach()).any())
            if changed:
                self.fired.add(f"{_relative(fname)}:{caller.f_lineno}")

        def clamp_fn(inp, *a, **k):
            out = orig_fn(inp, *a, **k)
            record(inp, out)
            return out

        def clamp_method(self_, *a, **k):
            out = orig_method(self_, *a, **k)
            record(self_, out)
            return out

        torch.clamp, torch.Tensor.clamp = clamp_fn, clamp_method
        try:
            yield self
        finally:
            torch.clamp, torch.Tensor.clamp = orig_fn, orig_method


def token_sum(per_token: torch.Tensor, batch: KLBatch) -> torch.Tensor:
    """[B] masked sum over tokens of a per-token library output [B, T] (padding never reaches the sum)."""
    return torch.where(batch.mask, per_token, torch.zeros((), dtype=per_token.dtype)).sum(-1)


def old_or_current(batch: KLBatch) -> torch.Tensor:
    """[B, T] the behaviour policy's log-probs (the current ones, detached, when on-policy), padding zeroed."""
    old = batch.logp.detach() if batch.old_logp is None else batch.old_logp
    return torch.where(batch.mask, old, torch.zeros((), dtype=old.dtype))


def reward_to_go_surrogate(kl: torch.Tensor, batch: KLBatch) -> torch.Tensor:
    """[B] klbench's policy-gradient surrogate for a token-level KL cost in the reward: REINFORCE with
    return-to-go (gamma = lambda = 1, no critic, no PPO clip), sum_t w_t * sg(sum_{s>=t} kl_s), with the
    per-token ratio w_t = exp(logp_t - old_t) (1 in value on-policy). kl: [B, T] the library's values."""
    zero = torch.zeros((), dtype=batch.logp.dtype)
    kl = torch.where(batch.mask, kl.to(batch.logp.dtype), zero).detach()
    to_go = kl.flip(-1).cumsum(-1).flip(-1)  # [B, T]
    return torch.where(batch.mask, torch.exp(batch.log_w) * to_go, zero).sum(-1)


def rescored(loss: LossFn, score: Callable) -> Callable:
    """Setting.scored for a loss that takes log-probs (not logits): `score(logits [B, T, V], tokens [B, T],
    temperature) -> [B, T]` is the library's own scoring (its division by the temperature included), applied to
    the policy's and (detached) the reference's raw logits of a klbench.exact.tabular.RawBatch; the batch handed
    to `loss` holds those log-probs and no logits (a loss that needs them fails instead of reading raw ones)."""
    def scored(batch, sampling) -> torch.Tensor:
        t = sampling.temperature
        logp = score(batch.logits, batch.tokens, t).to(batch.logp.dtype)  # [B, T]
        with torch.no_grad():
            ref = score(batch.ref_logits.detach(), batch.tokens, t).to(batch.logp.dtype)  # [B, T]
        return loss(replace(batch, logp=logp, ref_logp=ref, logits=None, ref_logits=None, token_kl=None))
    return scored
