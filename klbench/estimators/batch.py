"""KLBatch: the one input every estimator reads, validated once at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from klbench.estimators.vocab_exact import default_chunk_rows, exact_token_kl


@dataclass
class KLBatch:
    """Sampled responses scored by the policy pi and the frozen reference pi_ref.

    logp:       [B, T] log pi(y_t | y_<t) of the sampled tokens, differentiable
    ref_logp:   [B, T] log pi_ref(y_t | y_<t); must not require grad (pi_ref is frozen)
    mask:       [B, T] bool, True on real response tokens (EOS included, padding after it False)
    logits:     [B, T, V] optional next-token logits of pi at the same positions (rb needs them)
    ref_logits: [B, T, V] optional next-token logits of pi_ref
    group:      [B] optional int prompt ids; samples of one prompt share an id (loo needs them)
    chunk_rows: rows of [rows, V] float32 that the exact per-position KL materialises at once
                (None: chosen from V and the device by `default_chunk_rows`)
    old_logp:   [B, T] optional log pi_old(y_t | y_<t) under the behaviour policy that sampled y (several
                optimiser steps per rollout); must not require grad. None, or equal to logp on every real
                token, means on-policy. Only estimators that declare off-policy support accept it otherwise.
    token_kl:   [B, T] optional exact per-position KL(pi || pi_ref), already computed elsewhere
                (scripts/bench_rb_cost.py feeds the unchunked implementation this way); None: computed from
                the logits on first use
    """

    logp: torch.Tensor
    ref_logp: torch.Tensor
    mask: torch.Tensor
    logits: torch.Tensor | None = None
    ref_logits: torch.Tensor | None = None
    group: torch.Tensor | None = None
    chunk_rows: int | None = None
    old_logp: torch.Tensor | None = None
    token_kl: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("logp", "ref_logp", "mask"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise ValueError(f"KLBatch.{name} must be a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.logp.dim() != 2:
            raise ValueError(f"KLBatch.logp must be [B, T], got shape {tuple(self.logp.shape)}")
        shape = self.logp.shape
        for name in ("ref_logp", "mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"KLBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)} like logp"
                )
        if self.mask.dtype != torch.bool:
            raise ValueError(f"KLBatch.mask must be bool, got {self.mask.dtype}")
        if not self.logp.is_floating_point():
            raise ValueError(f"KLBatch.logp must be floating point, got {self.logp.dtype}")
        if self.ref_logp.dtype != self.logp.dtype:
            raise ValueError(f"KLBatch.ref_logp has dtype {self.ref_logp.dtype}, logp has {self.logp.dtype}")
        if self.ref_logp.requires_grad:
            raise ValueError("KLBatch.ref_logp requires grad, but pi_ref is frozen: compute it under torch.no_grad()")
        for name in ("logp", "ref_logp"):
            if not torch.isfinite(getattr(self, name)[self.mask]).all():
                raise ValueError(f"KLBatch.{name} has non-finite values on masked-in tokens")
        if self.old_logp is not None:
            self._check_old_logp()
        if (self.logits is None) != (self.ref_logits is None):
            raise ValueError("KLBatch.logits and KLBatch.ref_logits must be given together")
        if self.logits is not None:
            self._check_logits()
        if self.group is not None:
            if self.group.shape != shape[:1] or self.group.is_floating_point() or self.group.dtype == torch.bool:
                raise ValueError(f"KLBatch.group must be an int tensor of shape [{shape[0]}], got "
                                 f"{self.group.dtype} {tuple(self.group.shape)}")
        if self.chunk_rows is None and self.logits is not None:
            # resolved here so that whoever reads batch.chunk_rows sees the number actually used
            self.chunk_rows = default_chunk_rows(self.logits.shape[-1], self.logits.device)
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise ValueError(f"KLBatch.chunk_rows must be >= 1, got {self.chunk_rows}")
        tk = self.token_kl
        if tk is not None and (not isinstance(tk, torch.Tensor) or tk.shape != shape or tk.dtype != self.logp.dtype):
            got = f"{tk.dtype} {tuple(tk.shape)}" if isinstance(tk, torch.Tensor) else type(tk).__name__
            raise ValueError(f"KLBatch.token_kl must be a {self.logp.dtype} tensor of shape {tuple(shape)} like logp, "
                             f"got {got}")

    def _check_old_logp(self) -> None:
        old = self.old_logp
        if not isinstance(old, torch.Tensor) or old.shape != self.logp.shape or old.dtype != self.logp.dtype:
            got = f"{old.dtype} {tuple(old.shape)}" if isinstance(old, torch.Tensor) else type(old).__name__
            raise ValueError(f"KLBatch.old_logp must be a {self.logp.dtype} tensor of shape {tuple(self.logp.shape)} "
                             f"like logp, got {got}")
        if old.requires_grad:
            raise ValueError("KLBatch.old_logp requires grad, but pi_old is the fixed behaviour policy: detach it")
        if not torch.isfinite(old[self.mask]).all():
            raise ValueError("KLBatch.old_logp has non-finite values on masked-in tokens")

    def _check_logits(self) -> None:
        B, T = self.logp.shape
        for name in ("logits", "ref_logits"):
            t = getattr(self, name)
            if t.dim() != 3 or t.shape[:2] != (B, T):
                raise ValueError(f"KLBatch.{name} must be [B, T, V] = [{B}, {T}, V], got {tuple(t.shape)}")
            if not t.is_floating_point():
                raise ValueError(f"KLBatch.{name} must be floating point, got {t.dtype}")
        if self.logits.shape != self.ref_logits.shape:
            raise ValueError(f"KLBatch.logits {tuple(self.logits.shape)} and ref_logits "
                             f"{tuple(self.ref_logits.shape)} differ: policy and reference vocabularies must match")
        if self.ref_logits.requires_grad:
            raise ValueError("KLBatch.ref_logits requires grad, but pi_ref is frozen: compute it under torch.no_grad()")

    # ---- derived quantities, masked so that padding never reaches arithmetic ----

    @property
    def rho(self) -> torch.Tensor:
        """[B, T] token log-ratio l_t - log pi_ref(y_t|y_<t), zero off the mask, differentiable."""
        zero = torch.zeros((), dtype=self.logp.dtype, device=self.logp.device)
        return torch.where(self.mask, self.logp, zero) - torch.where(self.mask, self.ref_logp, zero)

    @property
    def masked_logp(self) -> torch.Tensor:
        """[B, T] l_t with zeros off the mask (so -inf padding cannot turn a gradient into NaN)."""
        return torch.where(self.mask, self.logp, torch.zeros((), dtype=self.logp.dtype, device=self.logp.device))

    @property
    def is_off_policy(self) -> bool:
        """True when old_logp is given and differs from logp on some real token (exact comparison)."""
        if self.old_logp is None:
            return False
        return bool((self.logp.detach() != self.old_logp)[self.mask].any())

    @property
    def log_w(self) -> torch.Tensor:
        """[B, T] per-token log importance ratio l_t - log pi_old(y_t|y_<t), zero off the mask, differentiable.

        Zero everywhere when old_logp is None (on-policy: pi_old = pi in value).
        """
        zero = torch.zeros((), dtype=self.logp.dtype, device=self.logp.device)
        old = self.logp.detach() if self.old_logp is None else self.old_logp
        return torch.where(self.mask, self.logp, zero) - torch.where(self.mask, old, zero)

    @property
    def kappa(self) -> torch.Tensor:
        """[B, T] exact per-position KL(pi(.|y_<t) || pi_ref(.|y_<t)), differentiable in logits, 0 off the mask.

        Computed once per batch in row chunks and kept in `token_kl`, so value and gradient estimators share it.
        """
        if self.token_kl is None:
            if self.logits is None:
                raise ValueError("rb needs the full next-token distributions: build KLBatch with logits= and "
                                 "ref_logits=")
            self.token_kl = exact_token_kl(self.logits, self.ref_logits, self.mask, self.chunk_rows).to(self.logp.dtype)
        return self.token_kl
