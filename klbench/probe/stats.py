"""The probe's statistics, free of any policy: running moments, a random sketch that keeps inner products,
bootstrap resampling weights and bias-corrected percentile intervals. Pure torch.
"""
from __future__ import annotations

import math

import torch


class Welford:
    """Running mean and sum of squared deviations of vectors [D] in float64: O(D) memory, numerically stable."""

    def __init__(self, dim: int, device: torch.device | str = "cpu"):
        self.n = 0
        self.mean = torch.zeros(dim, dtype=torch.float64, device=device)  # [D]
        self.m2 = torch.zeros(dim, dtype=torch.float64, device=device)  # [D] per-coordinate sum of squared deviations

    def update(self, x: torch.Tensor) -> None:
        x = x.to(self.mean)
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def trace_cov(self) -> float:
        """Unbiased trace of the covariance of one sample."""
        return float(self.m2.sum()) / (self.n - 1) if self.n > 1 else float("nan")


class CountSketch:
    """A fixed random linear map R^D -> R^k (each coordinate to one bucket with a random sign) with
    E[<Sx, Sy>] = <x, y> over the draw of the map: inner products and traces survive in expectation."""

    def __init__(self, dim: int, k: int, seed: int, device: torch.device | str = "cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.k = k
        self.bucket = torch.randint(0, k, (dim,), generator=gen).to(device)  # [D]
        self.sign = (torch.randint(0, 2, (dim,), generator=gen) * 2 - 1).to(device, torch.float64)  # [D]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.k, dtype=torch.float64, device=x.device).index_add_(0, self.bucket, x * self.sign)


def bootstrap_weights(R: int, B: int, seed: int) -> torch.Tensor:
    """[B + 1, R] float64 multiplicities of each replicate: row 0 is the sample itself (all ones), rows 1..B
    resample the R replicates with replacement."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, R, (B, R), generator=gen)
    w = torch.zeros(B, R, dtype=torch.float64).scatter_add_(1, idx, torch.ones(B, R, dtype=torch.float64))
    return torch.cat([torch.ones(1, R, dtype=torch.float64), w])


def ci(samples: torch.Tensor, level: float, point: float | None = None, truth: float | None = None
       ) -> tuple[float, float]:
    """Bias-corrected percentile interval from bootstrap samples [B] of a statistic whose estimate is `point`.

    `truth` is the statistic's value in the bootstrap world (computed on the empirical distribution itself,
    e.g. the plug-in ||mean||^2 for the debiased squared norm): b = mean(samples) - truth estimates the
    estimator's bias, and the interval is the percentile interval moved to sit around point - b. Without
    that shift a debiased squared norm's interval sits trace/R too high (a zero-mean gradient's interval
    would exclude zero) and a debiased cosine's O(1/R) bias above 1 is not undone. Non-finite samples (a
    cosine whose norm estimate is <= 0) are left out; nan when fewer than half are finite."""
    s = samples[torch.isfinite(samples)]
    if s.numel() < max(2, samples.numel() // 2):
        return float("nan"), float("nan")
    a = (1 - level) / 2
    q = torch.quantile(s, torch.tensor([a, 1 - a], dtype=s.dtype))
    shift = 0.0
    if point is not None and math.isfinite(point):
        m = float(s.mean())
        bias = m - truth if truth is not None and math.isfinite(truth) else 0.0
        shift = m - point + bias
    return float(q[0]) - shift, float(q[1]) - shift


def fill(row: dict, key: str, v: torch.Tensor, level: float) -> None:
    """row[key], row[key_lo], row[key_hi] from [B + 2] (point, B bootstrap samples, bootstrap-world truth)."""
    row[key] = float(v[0])
    row[key + "_lo"], row[key + "_hi"] = ci(v[1:-1], level, float(v[0]), float(v[-1]))


def ratio(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b elementwise; nan where b <= 0 (a ratio to nothing is not a number, not infinity)."""
    return torch.where(b > 0, a / b.clamp(min=1e-300), torch.full_like(a, float("nan")))
