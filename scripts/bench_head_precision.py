"""How precise must the LM head's product be for kappa (the exact per-token KL(pi || pi_ref)) and log-probs to be
trusted? head_scores' kappa and log pi(y) against float64 on real-size heads, per product precision:

    python scripts/bench_head_precision.py                      # the grid of docs/scale.md, "The head's precision"
    python scripts/bench_head_precision.py --shapes 896x151936 --rows 64

Heads: H x V of Qwen2-0.5B (896 x 151,936), Llama-3.2-1B (2048 x 128,256), Llama-2-7B (4096 x 32,000); random
weights shaped like a trained head (a Zipf unigram prior, each row's distribution peaked on a few tokens, entropy
printed), the reference near pi (per-token KL ~1e-2) or far (~1). Precisions: `bf16` the product in bf16 (inputs
and output rounded: bf16 autocast, model.head_dtype=autocast), `fp32` the product in float32 (the default), each for
float32 weights (bf16-mixed) and for bf16 weights (bf16-true, where the truth is float64 of the bf16 weights).
"visible" compares the bias of a batch's mean sequence KL with its standard error (batch 512 x 256 tokens, as the
GPU check's 64 x 8 x 256): a bias over 1 SE is one the estimators' own variance does not hide.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from klbench.estimators.head_scores import LMHead, head_scores

SHAPES = {"qwen2-0.5b": (896, 151936), "llama-3.2-1b": (2048, 128256), "llama-2-7b": (4096, 32000)}
BATCH, TOKENS = 512, 256  # sequences x response tokens of the batch whose mean KL the bias is set against


def trained_head(H: int, V: int, rows: int, g: torch.Generator):
    """(h [rows, H], W [V, H]) float64: logits with a Zipf prior and each row peaked on a few tokens."""
    W = torch.randn(V, H, generator=g, dtype=torch.float64) / math.sqrt(H) * 2.0  # [V, H], logit std ~2
    W[:, 0] = -1.1 * torch.log(torch.arange(1, V + 1, dtype=torch.float64))[torch.randperm(V, generator=g)]
    h = torch.randn(rows, H, generator=g, dtype=torch.float64)  # [rows, H]
    h[:, 0] = 1.0
    top = torch.randint(0, V, (rows, 3), generator=g)  # a few likely tokens per row, 8-14 nats above the rest
    for k in range(3):
        wt = W[top[:, k], 1:]  # [rows, H - 1]
        h[:, 1:] += wt * ((14.0 - 3 * k) / wt.pow(2).sum(-1, keepdim=True))
    return h, W


def scores(h, W, h_ref, W_ref, y, dtype, autocast: bool):
    ctx = torch.autocast("cpu", torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx, torch.no_grad():
        s = head_scores(h, LMHead(W, dtype=dtype), y, h_ref, LMHead(W_ref, dtype=dtype), with_token_kl=True,
                        with_entropy=True)
    return s


def run(shape: str, H: int, V: int, rows: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    h, W = trained_head(H, V, rows, g)
    out = []
    for gap, eps in (("near", 0.02), ("far", 0.25)):
        W_ref = W + eps * torch.randn(V, H, generator=g, dtype=torch.float64) / math.sqrt(H) * 2.0
        h_ref = h + eps * torch.randn(rows, H, generator=g, dtype=torch.float64)
        for weights in ("float32", "bf16"):  # bf16-mixed keeps float32 weights; bf16-true holds bf16 ones
            cast = torch.float32 if weights == "float32" else torch.bfloat16
            x, w, xr, wr = (t.to(cast) for t in (h, W, h_ref, W_ref))
            y = _sample(x.double(), w.double(), g)  # tokens drawn from pi, as a rollout would
            truth = scores(*(t.double() for t in (x, w, xr, wr)), y, torch.float64, False)
            k_true = truth.kappa
            for prec, dtype, ac in (("bf16", None, True), ("fp32", torch.float32, True)):
                t0 = time.perf_counter()
                s = scores(x, w, xr, wr, y, dtype, ac)
                err = s.kappa.double() - k_true  # [rows]
                se = math.sqrt(TOKENS) * float(k_true.std()) / math.sqrt(BATCH)  # SE of the batch's mean seq KL
                bias = TOKENS * float(err.mean())
                out.append(dict(shape=shape, pair=gap, weights=weights, product=prec,
                                kappa_mean=float(k_true.mean()), entropy=float(truth.entropy.mean()),
                                kappa_err_mean=float(err.mean()), kappa_err_max=float(err.abs().max()),
                                rel_bias=float(err.mean() / k_true.mean()),
                                logp_err_max=float((s.logp.double() - truth.logp).abs().max()),
                                visible=abs(bias) / se, secs=time.perf_counter() - t0))
    return out


def _sample(h, W, g) -> torch.Tensor:
    """[rows] one token per row from softmax(h W^T), a vocabulary chunk at a time (Gumbel-max)."""
    best = torch.full((h.shape[0],), -math.inf, dtype=h.dtype)
    arg = torch.zeros(h.shape[0], dtype=torch.long)
    for v0 in range(0, W.shape[0], 16384):
        z = h @ W[v0:v0 + 16384].T  # [rows, chunk]
        z = z - torch.log(-torch.log(torch.rand(z.shape, generator=g, dtype=z.dtype)))
        m, i = z.max(-1)
        take = m > best
        best, arg = torch.where(take, m, best), torch.where(take, i + v0, arg)
    return arg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="names of SHAPES or HxV")
    ap.add_argument("--rows", type=int, default=128, help="positions scored per head (default 128)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; kappa and log pi(y) against float64")
    print("| head (H x V) | pair | weights | product | mean kappa (nats) | entropy | mean err | max abs err | "
          "rel. bias | max log-prob err | bias / SE |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in a.shapes:
        H, V = SHAPES[name] if name in SHAPES else map(int, name.split("x"))
        for r in run(name, H, V, a.rows, a.seed):
            print(f"| {r['shape']} ({H} x {V:,}) | {r['pair']} | {r['weights']} | {r['product']} | "
                  f"{r['kappa_mean']:.3g} | {r['entropy']:.2f} | {r['kappa_err_mean']:+.2e} | "
                  f"{r['kappa_err_max']:.2e} | {r['rel_bias']:+.1%} | {r['logp_err_max']:.2e} | {r['visible']:.2g} |",
                  flush=True)


if __name__ == "__main__":
    main()
