"""Estimator quality on any policy/reference pair: bias and variance of every value and gradient estimator,
measured by sampling, with bootstrap confidence intervals. Pure torch: no Lightning, no Hydra. The
statistics themselves are klbench.probe.stats; tables, files and plots of a result are klbench.probe.report.

    from klbench.probe import report
    from klbench.probe.config import ProbeOptions
    from klbench.probe.measure import run_probe
    result = run_probe(policy, prompts, ProbeOptions(samples=32, replicates=128))
    print(report.summary(result))

`policy` is anything with `rollout(prompts, n)`, `score(rollout) -> KLBatch` and `trainable()` (klbench's
LMPolicy and TabularPolicy). The probe draws R independent replicates from its own seeded stream (the
caller's RNG state is restored afterwards, so a probe inside training never shifts it). One replicate
samples `samples` (M_max) responses for each prompt; every value estimator is evaluated on them, and
every gradient estimator on the first `grad_samples` of each prompt (one per-batch gradient, as one
training step would compute it).

Values: per-prompt mean, bias against a reference (the exact KL on the tabular model, else `rb` on
`ref_batches x ref_samples` separate samples), and the std of the M-sample estimate for M = 1, 2, 4, ...,
M_max (a prompt's std, averaged over prompts), each as a ratio to `mc`'s.

Gradients: Welford running moments of the flattened gradient over the trainable parameters (O(parameters)
memory; `project_dim` runs them in a fixed CountSketch of that size instead), giving the trace of the
covariance of the per-batch gradient, the norm of its mean, its cosine and relative error to two reference
gradients (`kl_pi_ref`: exact on tabular, else `rb` on the reference samples; `kl_ref_pi`: exact on tabular,
else -E_{y ~ pi_ref}[grad log pi(y)] on samples drawn from pi_ref), the signal-to-noise ratio (||E g||^2 / tr Cov), and the
trace as a ratio to `seq`'s. Squared norms are debiased (||mean||^2 - trace/R, and the reference's own
noise), so an estimator whose mean is zero gets an estimate, and a CI, around zero.

Confidence intervals: percentile bootstrap over the R replicates, the same resampled replicates for every
estimator (paired: a ratio's CI reflects that both estimators saw the same samples). For the gradients,
the bootstrap keeps per-replicate scalars exactly (||g_r||^2, g_r . reference) and a fixed CountSketch
(`boot_dim`) of each g_r for the cross term ||mean*||^2 - ||mean||^2; below `boot_dim` parameters the
sketch is the identity (exact). The references are held fixed in the bootstrap; their noise is reported.
"""
from __future__ import annotations

import dataclasses
import math
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from klbench.estimators import GRADIENT_ESTIMATORS, VALUE_ESTIMATORS, KLBatch, gradient_estimator, value_estimator
from klbench.estimators.sampling import KL_TARGETS, Sampling, check_target
from klbench.estimators.options import REPORTED_VALUES
from klbench.probe.config import ProbeOptions
from klbench.probe.stats import CountSketch, Welford, bootstrap_weights, fill, ratio

# value estimators probed, label -> (registered name, options); registered names not covered join with defaults
VALUE_VARIANTS: dict[str, tuple[str, dict]] = REPORTED_VALUES
# fitted on the batch they are given: their M-sample estimate is computed on M samples, not averaged
BATCH_FITTED = {"cv_opt"}
# gradient variants beyond each registered estimator with its defaults: naive_cv at sequence level is the one
# whose expectation is exactly lam * grad kl_ref_pi (the token level follows the prefix-fixed partial KL)
EXTRA_GRADIENT_VARIANTS: dict[str, tuple[str, dict]] = {"naive_cv_seq": ("naive_cv", {"level": "sequence"})}
REFERENCES = ("kl_pi_ref", "kl_ref_pi")
VAR_BASELINE, STD_BASELINE = "seq", "mc"  # ratios are to these


def value_variants(labels: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    variants = dict(VALUE_VARIANTS)
    used = {name for name, _ in variants.values()}
    variants.update({name: (name, {}) for name in VALUE_ESTIMATORS if name not in used})
    return _select(variants, labels, "value")


def gradient_variants(labels: list[str] | None = None) -> dict[str, tuple[str, dict]]:
    variants = {name: (name, {}) for name in GRADIENT_ESTIMATORS}
    variants.update(EXTRA_GRADIENT_VARIANTS)
    return _select(variants, labels, "gradient")


def _select(variants: dict, labels: list[str] | None, kind: str) -> dict:
    if labels is None:
        return variants
    unknown = [lab for lab in labels if lab not in variants]
    if unknown:
        raise ValueError(f"unknown {kind} estimator(s) {unknown} for the probe; valid: {', '.join(variants)}")
    return {lab: variants[lab] for lab in labels}


@dataclass
class _GradientTrack:
    """Per gradient estimator: exact running moments plus what the bootstrap needs, per replicate."""

    welford: Welford
    sq: list = field(default_factory=list)  # ||g_r||^2
    dots: dict = field(default_factory=dict)  # reference -> [g_r . reference mean]
    sketch: torch.Tensor | None = None  # [R, boot_dim] float32 sketches (or the vectors themselves), row r = g_r


@dataclass
class Reference:
    """A reference gradient: its mean [D] and the trace of its own noise (variance of that mean; 0 if exact)."""

    mean: torch.Tensor
    noise: float
    how: str

    @property
    def sq_debiased(self) -> float:
        return float(self.mean @ self.mean) - self.noise


@dataclass
class ProbeResult:
    values: list[dict]  # one row per value estimator and M
    gradients: list[dict]  # one row per gradient estimator
    meta: dict[str, Any]
    rows_at: Callable[[float], tuple[list, list]] | None = field(default=None, repr=False, compare=False)

    def at_level(self, level: float) -> "ProbeResult":
        """The same measurement with CIs at another level (the bootstrap samples are kept, not redrawn)."""
        values, gradients = self.rows_at(level)
        return ProbeResult(values, gradients, {**self.meta, "ci_level": level}, self.rows_at)

    def value_rows(self, M: int | None = None) -> list[dict]:
        """Rows at M (default: each estimator's smallest M, its per-sample row where it has one)."""
        if M is not None:
            return [r for r in self.values if r["M"] == M]
        seen, out = set(), []
        for r in self.values:
            if r["estimator"] not in seen:
                seen.add(r["estimator"])
                out.append(r)
        return out


# ---- sampling helpers ----

def _sub_rollout(ro, rows: torch.Tensor):
    """The rows `rows` of a Rollout (the first grad_samples of each prompt): every per-row field is cut (the
    sampler's own log-probs too, which target=model scores as the behaviour policy), the rest kept."""
    n, r = len(ro.group), rows.tolist()

    def pick(v):
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n:
            return v[rows]
        return [v[i] for i in r] if isinstance(v, list) and len(v) == n else v
    return dataclasses.replace(ro, **{f.name: pick(getattr(ro, f.name)) for f in dataclasses.fields(ro)})


def sampling_of(policy) -> tuple[Sampling, str]:
    """The policy's sampling and KL target (klbench.estimators.sampling); plain and `sampler` where it has none."""
    return getattr(policy, "sampling", None) or Sampling(), getattr(policy, "kl_target", "sampler")


def exact_reference(policy) -> dict | None:
    """Where the policy can enumerate its truth (tabular): the exact KL both ways and the exact gradients of
    kl_pi_ref and kl_ref_pi; else None."""
    grads = policy.exact_gradients()
    if grads is None:
        return None
    exact = policy.exact_metrics()
    return {"kl": exact["seq_kl"], "kl_ref_pi": exact["kl_ref_pi"], "grads": {k: grads[k].flatten() for k in REFERENCES}}


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor], retain: bool) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64)
                      for g, p in zip(grads, params)])  # [D]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


# ---- the probe ----

def run_probe(policy, prompts: list[str], cfg: ProbeOptions, progress: bool = True,
              log: Callable[[str], None] | None = None) -> ProbeResult:
    """Measure every value and gradient estimator on `policy` (pi) against its reference (pi_ref).

    Draws from its own stream seeded with cfg.seed; the caller's torch RNG state (CPU and the policy's
    CUDA device) is the same afterwards. Never touches parameters' .grad.
    """
    if not prompts:
        raise ValueError("the probe needs at least one prompt")
    device = policy.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
        torch.manual_seed(cfg.seed)
        return _run(policy, list(prompts), cfg, progress, log or (lambda s: None))


def _run(policy, prompts: list[str], cfg: ProbeOptions, progress: bool, log) -> ProbeResult:
    t_start = time.perf_counter()
    if policy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(policy.device)
    params = policy.trainable()
    device = policy.device
    D = sum(p.numel() for p in params)
    project = CountSketch(D, cfg.project_dim, cfg.seed + 1, device) if cfg.project_dim else None
    dim = cfg.project_dim or D
    boot_sketch = CountSketch(dim, cfg.boot_dim, cfg.seed + 2, device) if dim > cfg.boot_dim else None
    values = {lab: value_estimator(name, **o) for lab, (name, o) in value_variants(cfg.value_estimators).items()}
    grads = {lab: gradient_estimator(name, **o)
             for lab, (name, o) in gradient_variants(cfg.gradient_estimators).items()}
    P, Mx, Mg, R = len(prompts), cfg.samples, cfg.grad_samples, cfg.replicates
    sizes = cfg.sizes
    skipped: dict[str, str] = {}
    sampling, target = sampling_of(policy)

    def vec(g: torch.Tensor) -> torch.Tensor:
        return project(g) if project is not None else g

    # ---- references: exact on tabular, else separate samples (their own part of the stream) ----
    exact = exact_reference(policy)
    t_ref = time.perf_counter()
    if exact is not None:
        refs = {k: Reference(vec(v.to(device, torch.float64)), 0.0, "exact") for k, v in exact["grads"].items()}
        kl_ref = torch.full((P,), exact["kl"], dtype=torch.float64)
        kl_ref_se, value_ref_how = 0.0, "exact KL"
    else:
        refs, kl_ref, kl_ref_se = _lm_references(policy, prompts, cfg, params, vec, dim, progress)
        value_ref_how = f"rb on {cfg.ref_batches} x {cfg.ref_samples} samples per prompt"
    t_ref = time.perf_counter() - t_ref

    # ---- replicates ----
    # storage for every replicate, allocated once: small tensors kept per replicate between the big temporary
    # ones would pin the allocator's heap and grow the process by megabytes per replicate
    per_sample = {lab: torch.full((R, P, Mx), float("nan"), dtype=torch.float64)
                  for lab in values if lab not in BATCH_FITTED}  # lab -> [R, P, Mx]
    fitted = {lab: {M: torch.full((R, P, Mx // M), float("nan"), dtype=torch.float64) for M in sizes if M >= 2}
              for lab in values if lab in BATCH_FITTED}  # lab -> M -> [R, P, C]
    k = boot_sketch.k if boot_sketch is not None else dim
    tracks = {lab: _GradientTrack(Welford(dim, device), sketch=torch.zeros(R, k)) for lab in grads}
    grad_rows = torch.tensor([p * Mx + j for p in range(P) for j in range(Mg)], device=device)
    iterator = range(R)
    if progress:
        from tqdm import tqdm
        iterator = tqdm(iterator, desc="probe replicates", leave=False)
    for r in iterator:
        ro = policy.rollout(prompts, Mx)  # [P * Mx] rows, the Mx samples of prompt p at p*Mx ..
        with torch.no_grad():
            batch = policy.score(ro)
            for lab, est in values.items():
                if lab in skipped:
                    continue
                try:  # an estimator that needs inputs this probe does not give, or refuses off-policy samples
                    if lab in BATCH_FITTED:
                        for M, store in fitted[lab].items():
                            store[r] = _fitted_chunks(est, batch, P, Mx, M)
                    else:
                        per_sample[lab][r] = est(batch).double().reshape(P, Mx).cpu()
                except ValueError as e:
                    skipped[lab] = str(e)
        del batch
        # top-k estimators read the whole distributions: a language model then keeps its logits for them
        # (None: the scoring path model.scoring_path picks)
        gbatch = policy.score(_sub_rollout(ro, grad_rows), logits=True if any(g.reads_logits for g in grads.values())
                              else None)
        live = [lab for lab in grads if lab not in skipped]
        for i, lab in enumerate(live):
            try:
                loss = grads[lab](gbatch).mean()
                g = vec(_flat_grad(loss, params, retain=i < len(live) - 1))
            except ValueError as e:
                skipped[lab] = str(e)
                continue
            t = tracks[lab]
            t.welford.update(g)
            t.sq.append(float(g @ g))
            for name, ref in refs.items():
                t.dots.setdefault(name, []).append(float(g @ ref.mean))
            t.sketch[r] = (boot_sketch(g) if boot_sketch is not None else g).float().cpu()
        del gbatch

    W = bootstrap_weights(R, cfg.bootstrap, cfg.seed + 3)  # [B + 1, R], row 0 = the sample
    vstats = _value_stats_all(per_sample, fitted, skipped, sizes, Mx, kl_ref, W)
    gstats = {lab: _gradient_stats(t, refs, W, R) for lab, t in tracks.items() if lab not in skipped}

    def rows_at(level: float) -> tuple[list, list]:
        return _value_rows(vstats, level), _gradient_rows(gstats, level)

    value_rows, grad_rows_out = rows_at(cfg.ci_level)
    meta = {"prompts": P, "samples": Mx, "grad_samples": Mg, "replicates": R, "bootstrap": cfg.bootstrap,
            "ci_level": cfg.ci_level, "seed": cfg.seed, "n_params": D,
            "gradient_space": f"CountSketch {cfg.project_dim}" if project is not None else "exact",
            "bootstrap_sketch": boot_sketch.k if boot_sketch is not None else "exact",
            "value_reference": value_ref_how, "kl_reference": float(kl_ref.mean()), "kl_reference_se": kl_ref_se,
            "references": {k: {"how": r.how, "norm": float(r.mean.norm()), "noise_trace": r.noise} for k, r in refs.items()},
            "skipped": skipped, "time_s": time.perf_counter() - t_start, "ref_time_s": t_ref,
            "sampling": sampling.describe(), "kl_target": target, "target_kl": KL_TARGETS[target],
            "target_warning": check_target(sampling, target),
            "peak_rss_mb": _peak_rss_mb()}
    if exact is not None:
        meta["kl_ref_pi_exact"] = exact["kl_ref_pi"]
    if device.type == "cuda":
        meta["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return ProbeResult(value_rows, grad_rows_out, meta, rows_at)


def _lm_references(policy, prompts, cfg: ProbeOptions, params, vec, dim, progress):
    """rb on pi's samples: the value reference per prompt and the kl_pi_ref gradient; on pi_ref's samples,
    -grad log pi(y): the kl_ref_pi gradient. Each batch: every prompt, ref_samples samples.

    Under a sampling the references are those of the policy's KL target: policy.score builds the target's batch
    (at target=model rb weights by the prefixes' importance ratios). The kl_ref_pi reference needs samples
    from the target's reference, which policy.reference() draws only where it is pi_ref sampled as the policy
    (a temperature alone, target sampler or tempered): elsewhere it is not measured (NaN, said in its `how`)."""
    P, n = len(prompts), cfg.ref_samples
    rb_value, rb_grad = value_estimator("rb"), gradient_estimator("rb")
    sampling, target = sampling_of(policy)
    reverse = sampling.is_plain or (target in ("sampler", "tempered") and not sampling.truncates)
    w_pi, w_ref = Welford(dim, policy.device), Welford(dim, policy.device)
    kl = []  # K x [P]
    ref_sampler = policy.reference()  # samples from pi_ref, scored afterwards under pi by policy.score
    iterator = range(cfg.ref_batches)
    if progress:
        from tqdm import tqdm
        iterator = tqdm(iterator, desc="probe references", leave=False)
    for _ in iterator:
        batch = policy.score(policy.rollout(prompts, n))
        kl.append(rb_value(batch).double().reshape(P, n).mean(-1).cpu())
        w_pi.update(vec(_flat_grad(rb_grad(batch).mean(), params, retain=False)))
        del batch
        if reverse:
            rbatch = policy.score(ref_sampler.rollout(prompts, n))
            # KL(pi_ref || pi) = E_{y ~ pi_ref}[log pi_ref(y) - log pi(y)]: its gradient is -E_{y ~ pi_ref}[grad log pi(y)]
            w_ref.update(vec(_flat_grad(-rbatch.masked_logp.sum(-1).mean(), params, retain=False)))
            del rbatch
    K = cfg.ref_batches
    kl = torch.stack(kl)  # [K, P]
    kl_se = float(kl.mean(-1).std() / math.sqrt(K)) if K > 1 else float("nan")
    biased = target != "sampler" and check_target(sampling, target)  # the sampler's own warning is no bias
    # noise of the mean of K batch gradients: tr Cov / K (unknown with K = 1: taken as 0, said in the meta)
    refs = {name: Reference(w.mean.clone(), (w.trace_cov / K) if K > 1 else 0.0,
                            f"{how} on {K} x {P} x {n} samples" + (" (biased: samples from pi_s)" if biased else ""))
            for name, w, how in (("kl_pi_ref", w_pi, "rb"), ("kl_ref_pi", w_ref, "-grad log pi, y ~ pi_ref"))}
    if not reverse:  # a zero reference with no resolved norm: cosine and relative error NaN
        refs["kl_ref_pi"] = Reference(torch.zeros(dim, dtype=torch.float64, device=policy.device), 0.0,
                                      f"not measured: {sampling.describe()} with task.kl_target={target} has no "
                                      "sampler of the target's reference")
    return refs, kl.mean(0), kl_se


def _fitted_chunks(est, batch: KLBatch, P: int, Mx: int, M: int) -> torch.Tensor:
    """[P, Mx // M] estimates of a batch-fitted estimator, each fitted on M samples of one prompt."""
    C = Mx // M
    out = torch.empty(P, C, dtype=torch.float64)
    for p in range(P):
        for c in range(C):
            rows = slice(p * Mx + c * M, p * Mx + (c + 1) * M)
            old = None if batch.old_logp is None else batch.old_logp[rows]  # a batch-fitted estimator refuses it
            sub = KLBatch(batch.logp[rows], batch.ref_logp[rows], batch.mask[rows], old_logp=old)
            out[p, c] = float(est(sub).double().mean())
    return out


def _value_stats_all(per_sample, fitted, skipped, sizes, Mx, kl_ref, W) -> dict:
    """lab -> M -> the [B + 2] statistics of the M-sample estimate (see _value_stats)."""
    chunks: dict[str, dict[int, torch.Tensor]] = {}  # lab -> M -> [R, P, C]
    for lab, x in per_sample.items():  # x [R, P, Mx]
        if lab in skipped:
            continue
        chunks[lab] = {M: x[..., : (Mx // M) * M].reshape(*x.shape[:2], Mx // M, M).mean(-1) for M in sizes}
    for lab, by_m in fitted.items():
        if by_m and lab not in skipped:
            chunks[lab] = by_m
    return {lab: {M: _value_stats(x, kl_ref, W) for M, x in by_m.items()} for lab, by_m in chunks.items()}


def _value_rows(stats: dict, level: float) -> list[dict]:
    """One row per (estimator, M): mean, s.e., bias, std of the M-sample estimate, its ratio to mc's."""
    rows = []
    for lab, by_m in stats.items():
        for M, s in by_m.items():
            row = {"estimator": lab, "M": M}
            for key in ("mean", "bias", "std"):
                fill(row, key, s[key], level)
            row["mean_se"] = float(s["mean"][1:-1].std())
            base = stats.get(STD_BASELINE, {}).get(M)
            if base is not None:
                fill(row, "std_ratio_mc", ratio(s["std"], base["std"]), level)
            else:
                row["std_ratio_mc"] = row["std_ratio_mc_lo"] = row["std_ratio_mc_hi"] = float("nan")
            rows.append(row)
    return rows


def _value_stats(x: torch.Tensor, kl_ref: torch.Tensor, W: torch.Tensor) -> dict[str, torch.Tensor]:
    """x [R, P, C] estimates; W [B+1, R] replicate weights. Per prompt: mean and (unbiased) std over the R*C
    estimates; then averaged over prompts. Returns [B+2] tensors: the sample, B resamples, and the
    bootstrap-world truth (plug-in moments of the sample)."""
    R, P, C = x.shape
    n = R * C
    s1 = W @ x.sum(-1)  # [B+1, P]
    s2 = W @ (x ** 2).sum(-1)  # [B+1, P]
    mean = s1 / n
    plug = (s2 / n - mean ** 2).clamp(min=0)  # [B+1, P] plug-in variance
    var = plug * n / (n - 1) if n > 1 else torch.full_like(mean, float("nan"))
    mean, var = torch.cat([mean, mean[:1]]), torch.cat([var, plug[:1]])  # truth row: the sample's plug-ins
    return {"mean": mean.mean(-1), "bias": (mean - kl_ref.to(mean)).mean(-1), "std": var.sqrt().mean(-1)}


def _gradient_rows(stats: dict[str, dict[str, torch.Tensor]], level: float) -> list[dict]:
    rows = []
    for lab, s in stats.items():
        row = {"estimator": lab}
        for key, v in s.items():
            fill(row, key, v, level)
        if VAR_BASELINE in stats:
            fill(row, "var_ratio_seq", ratio(s["trace_cov"], stats[VAR_BASELINE]["trace_cov"]), level)
        else:
            row["var_ratio_seq"] = row["var_ratio_seq_lo"] = row["var_ratio_seq_hi"] = float("nan")
        row["mean_norm"] = math.sqrt(max(row["mean_norm_sq"], 0.0))
        rows.append(row)
    return rows


def _gradient_stats(t: _GradientTrack, refs: dict[str, Reference], W: torch.Tensor, R: int) -> dict[str, torch.Tensor]:
    """[B+2] tensors of the per-batch gradient's statistics: the sample (exact, from Welford), B resamples,
    and the bootstrap-world truth (the resamples' population is the sample: mean g-bar, plug-in covariance,
    no noise to remove)."""
    sq = torch.tensor(t.sq, dtype=torch.float64)  # [R]
    Z = t.sketch.double()  # [R, k]
    zbar = W @ Z / R  # [B+1, k] sketch of each resample's mean
    gbar_sq = float(t.welford.mean @ t.welford.mean)
    mean_sq = gbar_sq + (zbar ** 2).sum(-1) - (zbar[0] ** 2).sum()  # [B+1]
    trace = ((W @ sq) - R * mean_sq) / (R - 1)  # [B+1]
    trace[0] = t.welford.trace_cov  # the same number, from the numerically stable recursion
    mean_sq_deb = mean_sq - trace / R  # unbiased for ||E g||^2
    # the truth row: ||E g||^2 = ||g-bar||^2 exactly, tr Cov = the plug-in (R-1)/R x the sample's
    mean_sq_deb = torch.cat([mean_sq_deb, torch.tensor([gbar_sq], dtype=torch.float64)])
    trace = torch.cat([trace, trace[:1] * (R - 1) / R])
    out = {"trace_cov": trace, "mean_norm_sq": mean_sq_deb,
           # power signal-to-noise ratio of the per-batch gradient, ||E g||^2 / tr Cov: unclamped (noise can make
           # the estimate negative), so that its CI stays honest around 0
           "snr": torch.where(trace > 0, mean_sq_deb / trace.clamp(min=1e-300), torch.full_like(trace, float("nan")))}
    for name, ref in refs.items():
        dot = W @ torch.tensor(t.dots[name], dtype=torch.float64) / R  # [B+1] mean . reference
        dot[0] = float(t.welford.mean @ ref.mean)
        dot = torch.cat([dot, dot[:1]])
        # a sampled reference whose squared norm does not clear twice its own noise is not resolved (at pi = pi_ref
        # the sampled grad kl_ref_pi is pure noise): no cosine or relative error against it
        ref_sq = ref.sq_debiased if ref.sq_debiased > ref.noise else 0.0
        denom = mean_sq_deb * ref_sq
        out[f"cos_{name}"] = torch.where(denom > 0, dot / denom.clamp(min=1e-300).sqrt(),
                                         torch.full_like(dot, float("nan")))
        # ||mean - ref||^2, less the noise of both means, over ||ref||^2
        err = (mean_sq_deb - 2 * dot + ref_sq).clamp(min=0)
        out[f"rel_err_{name}"] = (err / ref_sq).sqrt() if ref_sq > 0 else torch.full_like(dot, float("nan"))
    return out
