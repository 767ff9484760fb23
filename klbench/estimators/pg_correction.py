"""Policy-gradient corrections for a rollout engine that is not the trainer (task.pg_correction, docs/mismatch.md
"PG corrections"): the libraries' importance weights, in pure torch.

    from klbench.estimators.pg_correction import PGCorrection, corrected_reward_loss
    corr = PGCorrection("token_truncate", cap=3.0)                    # TRL's vllm_importance_sampling_mode
    w, stats = corr.weights(scorer_logp, sampler_logp, mask)          # [B, T] detached; stats for logging
    loss = corrected_reward_loss(adv, logp, sampler_logp, mask, corr)  # -aggregate(w * A * log pi)

scorer_logp is the trainer's recomputation of the rollout policy's log-probs of the sampled tokens (TRL's
old_per_token_logps, verl's old_log_probs; with one update per batch, logp.detach()); sampler_logp the engine's own
(TRL's sampling_per_token_logps, verl's rollout_log_probs, klbench's Rollout.sampled_logp). The weight multiplies
the PG term's per-token loss, as TRL multiplies `per_token_loss * inputs["importance_sampling_ratio"]`
(trl/trainer/grpo_trainer.py:3147). It is detached: a correction weights samples, it is not a term to differentiate.

What each mode's expected gradient is, exactly (tests/test_pg_correction.py, on the mismatch axis of
klbench/exact/mismatch.py): `none` = uncorrected_pg; `sequence_*` = pg (grad E_pi[R]) while no weight reaches the
cap or floor; `token_*` = token_is_pg (prefixes and continuations stay pi_s's) while no weight does; beyond,
"none of the above", equal to the TRL setting's cell. No weight exists for tokens the engine never draws (top-k,
top-p on the engine): a correction cannot restore them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from klbench.estimators.advantages import aggregate
from klbench.estimators.pg_correction_options import PG_CORRECTIONS, check_bounds


@dataclass(frozen=True)
class PGCorrection:
    mode: str = "none"  # PG_CORRECTIONS
    cap: float = 3.0  # the largest weight kept (TRL's vllm_importance_sampling_clip_max)
    floor: float | None = None  # the smallest (TRL's clip_min; verl's IcePop lower bound 0.5); None: no bound

    def __post_init__(self) -> None:
        if self.mode not in PG_CORRECTIONS:
            raise ValueError(f"pg_correction mode {self.mode!r} is unknown; valid: {', '.join(PG_CORRECTIONS)}")
        check_bounds(self.cap, self.floor, "pg_correction.")

    @classmethod
    def from_options(cls, options) -> "PGCorrection":
        """From the validated task.pg_correction block (PGCorrectionFields, or a mapping of mode, cap, floor)."""
        get = options.get if isinstance(options, dict) else lambda k: getattr(options, k)
        return cls(get("mode"), float(get("cap")), None if get("floor") is None else float(get("floor")))

    @property
    def is_none(self) -> bool:
        return self.mode == "none"

    def weights(self, scorer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The detached weights [B, T] (0 on padding; a sequence mode's weight repeated on its row's tokens) and their
        statistics: `pg_weight_mean` (mean raw weight r over real tokens, before bounds), `pg_weight_bounded` (the
        fraction of real tokens whose weight the bounds changed: clamped or zeroed). scorer_logp, sampler_logp: [B, T]
        log-probs of the sampled tokens; mask [B, T] bool."""
        if scorer_logp.shape != sampler_logp.shape or scorer_logp.shape != mask.shape:
            raise ValueError(f"pg_correction: scorer log-probs {tuple(scorer_logp.shape)}, sampler log-probs "
                             f"{tuple(sampler_logp.shape)} and mask {tuple(mask.shape)} must have one shape [B, T]")
        if not bool(torch.isfinite(sampler_logp[mask]).all()):
            raise ValueError("pg_correction: the sampler's log-probs are non-finite on real tokens (a token the engine "
                             "gave probability 0 cannot have been drawn by it): no importance weight exists there")
        dtype = scorer_logp.dtype
        zero = torch.zeros((), dtype=dtype, device=scorer_logp.device)
        diff = torch.where(mask, scorer_logp.detach() - sampler_logp.detach().to(dtype), zero)  # [B, T] log r_t
        if self.mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True).expand_as(diff)  # [B, T] log prod_t r_t on every token of the row
        raw = torch.where(mask, torch.exp(diff), zero)  # [B, T]
        lo = 0.0 if self.floor is None else self.floor
        if self.mode == "none":
            w = torch.where(mask, torch.ones((), dtype=dtype, device=raw.device), zero)
        elif self.mode.endswith("truncate"):
            w = torch.where(mask, raw.clamp(min=lo, max=self.cap), zero)
        else:  # mask: zero outside [floor, cap]
            w = torch.where(mask & (raw >= lo) & (raw <= self.cap), raw, zero)
        n = mask.sum().clamp(min=1)
        stats = {"pg_weight_mean": raw[mask].sum() / n,
                 "pg_weight_bounded": ((w != raw) & mask).sum().to(dtype) / n if not self.is_none else zero}
        return w, stats


def corrected_per_sequence(adv: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                           correction: PGCorrection, scorer_logp: torch.Tensor | None = None) -> torch.Tensor:
    """[B] the corrected REINFORCE loss of each sequence, -sum_t w_t A_i log pi(y_t) (minimised). adv [B] or [B, T]
    detached; logp [B, T] differentiable; scorer_logp defaults to logp.detach() (one update per batch)."""
    w, _ = correction.weights(logp.detach() if scorer_logp is None else scorer_logp, sampler_logp, mask)
    a = adv.detach().to(logp.dtype)
    a = a.unsqueeze(-1) if a.dim() == 1 else a  # [B, 1] or [B, T]
    return -torch.where(mask, w * a * logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)


def corrected_reward_loss(adv: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                          correction: PGCorrection, kind: str = "seq_sum", max_len: int | None = None,
                          scorer_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reward term of klbench's RL task (klbench.estimators.advantages.reward_loss) with the correction's weights:
    -aggregate(w_t A_i log pi(y_t)) under task.loss_agg `kind`, and the weights' statistics. At mode none it is
    reward_loss exactly. adv [B] detached; logp, sampler_logp [B, T]; mask [B, T] bool."""
    w, stats = correction.weights(logp.detach() if scorer_logp is None else scorer_logp, sampler_logp, mask)
    per_token = w * adv.detach().to(logp.dtype).unsqueeze(-1) * logp  # [B, T]
    return -aggregate(per_token, mask, kind, max_len), stats
