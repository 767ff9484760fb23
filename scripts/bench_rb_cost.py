"""What the exact per-position KL (`rb`) costs at LM shapes, side by side with `mc`, a naive unchunked `rb`,
and one forward+backward of a small GPT-2 at the same B x T x V (docs/estimators.md, "Cost of rb").

    python scripts/bench_rb_cost.py [--quick] [--threads N] [--B 8 --T 256 --V 50257]

Every variant runs in its own fresh (spawned) process, so that its peak memory can be read from the
kernel's high-water mark of resident memory (ru_maxrss): peak = ru_maxrss after the timed steps minus
ru_maxrss once the inputs exist. That is real resident memory (allocator caching and temporaries
included, Python/torch import excluded); on CPU torch has no allocator statistics of its own.

The KL variants share their inputs: logits and ref_logits [B, T, V], and the sampled tokens' log-probs
[B, T] as leaf tensors (the trainer computes those for its policy loss anyway, so they are not a KL cost).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import resource
import statistics
import time

import torch

from klbench.estimators import KLBatch, exact_token_kl_naive, gradient_estimator, value_estimator
from klbench.estimators.vocab_exact import default_chunk_rows

FULL = dict(B=8, T=256, V=50257, repeats=3)
QUICK = dict(B=2, T=64, V=8192, repeats=1)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# (variant, logits dtype); gpt2 is the yardstick the rb overhead is compared to
PLAN = [("gpt2", "float32")] + [(v, d) for d in DTYPES for v in ("mc", "rb", "naive")]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _kl_inputs(cfg: dict, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    B, T, V = cfg["B"], cfg["T"], cfg["V"]
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)  # ragged responses, padding after EOS
    return dict(
        logits=torch.randn(B, T, V, generator=gen, dtype=dtype).requires_grad_(),  # [B, T, V]
        ref_logits=torch.randn(B, T, V, generator=gen, dtype=dtype),  # [B, T, V]
        logp=(-torch.rand(B, T, generator=gen) * 10).requires_grad_(),  # [B, T] float32
        ref_logp=-torch.rand(B, T, generator=gen) * 10,  # [B, T]
        mask=torch.arange(T).unsqueeze(0) < lengths.unsqueeze(-1),  # [B, T]
    )


def _kl_step(variant: str, x: dict, chunk_rows: int) -> None:
    """One training step's KL work: the value (for logging) and the gradient (backward)."""
    if variant == "mc":
        batch = KLBatch(x["logp"], x["ref_logp"], x["mask"])
        value_estimator("mc")(batch)
        gradient_estimator("seq")(batch).mean().backward()
        return
    # naive: the same estimators, fed the unchunked per-position KL instead of computing the chunked one
    token_kl = (exact_token_kl_naive(x["logits"], x["ref_logits"], x["mask"]).to(x["logp"].dtype)
                if variant == "naive" else None)
    batch = KLBatch(x["logp"], x["ref_logp"], x["mask"], x["logits"], x["ref_logits"], chunk_rows=chunk_rows,
                    token_kl=token_kl)
    value_estimator("rb")(batch)
    gradient_estimator("rb")(batch).mean().backward()


def _gpt2(cfg: dict):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()  # config chatter, not results
    torch.manual_seed(0)
    V = cfg["V"]
    conf = GPT2Config(vocab_size=V, n_positions=cfg["T"], n_embd=128, n_layer=2, n_head=4,
                      bos_token_id=V - 1, eos_token_id=V - 1)
    model = GPT2LMHeadModel(conf).train()
    ids = torch.randint(cfg["V"], (cfg["B"], cfg["T"]))  # [B, T]
    return model, ids


def _worker(variant: str, dtype_name: str, cfg: dict, conn) -> None:
    torch.set_num_threads(cfg["threads"])
    if variant == "gpt2":
        model, ids = _gpt2(cfg)

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
    else:
        x = _kl_inputs(cfg, DTYPES[dtype_name])

        def step():
            x["logits"].grad = x["logp"].grad = None  # each step allocates its own gradients
            _kl_step(variant, x, cfg["chunk_rows"])
    base = _rss_mb()
    times = []
    for _ in range(cfg["repeats"] + 1):  # the first step is a warm-up and is not timed
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    conn.send(dict(time=statistics.median(times[1:]), peak=_rss_mb() - base, inputs=base))
    conn.close()


def _run(variant: str, dtype_name: str, cfg: dict) -> dict:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(variant, dtype_name, cfg, send))
    proc.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = None
    proc.join()
    if out is None or proc.exitcode != 0:
        raise RuntimeError(f"benchmark variant {variant}/{dtype_name} failed (exit code {proc.exitcode})")
    return out


def hardware(threads: int) -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} with {threads} threads, "
            f"Python {platform.python_version()}; load average at start {load}")


def table(results: dict) -> str:
    rows = ["| variant | logits | time (ms) | time / naive | peak extra memory (MB) | memory / naive |",
            "|---|---|---|---|---|---|"]
    for (variant, d), r in results.items():
        naive = results.get(("naive", d)) if variant != "gpt2" else None
        t_ratio = f"{r['time'] / naive['time']:.2f}" if naive else "-"
        m_ratio = f"{r['peak'] / naive['peak']:.2f}" if naive else "-"
        name = "gpt2 fwd+bwd" if variant == "gpt2" else variant
        rows.append(f"| {name} | {d} | {1e3 * r['time']:.1f} | {t_ratio} | {r['peak']:.0f} | {m_ratio} |")
    gpt2 = results[("gpt2", "float32")]["time"]
    lines = ["\n".join(rows), ""]
    for d in DTYPES:
        rb, mc, naive = (results[(v, d)] for v in ("rb", "mc", "naive"))
        overhead = rb["time"] - mc["time"]
        lines.append(f"{d}: rb overhead over mc {1e3 * overhead:.0f} ms = {overhead / gpt2:.2f} x the GPT-2 step; "
                     f"rb memory {rb['peak'] / naive['peak']:.2f} x naive (target <= 0.5: "
                     f"{'PASS' if rb['peak'] <= 0.5 * naive['peak'] else 'FAIL'}); "
                     f"rb time {rb['time'] / naive['time']:.2f} x naive (target <= 1.0: "
                     f"{'PASS' if rb['time'] <= naive['time'] else 'FAIL'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, help=f"batch size (default {FULL['B']}, --quick {QUICK['B']})")
    p.add_argument("--T", type=int, help=f"response length (default {FULL['T']}, --quick {QUICK['T']})")
    p.add_argument("--V", type=int, help=f"vocabulary size (default {FULL['V']}, --quick {QUICK['V']})")
    p.add_argument("--chunk-rows", type=int, help="rows of [rows, V] float32 the chunked rb materialises at once "
                                                   "(default: klbench's own choice for V on CPU)")
    p.add_argument("--repeats", type=int, help=f"timed steps per variant, median reported (default "
                                                f"{FULL['repeats']}, --quick {QUICK['repeats']}), after one warm-up")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="small shapes and one repeat: a smoke test in seconds")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    cfg.update(chunk_rows=args.chunk_rows or default_chunk_rows(cfg["V"], torch.device("cpu")), threads=args.threads)
    if min(cfg.values()) < 1:
        p.error(f"all sizes must be >= 1, got {cfg}")

    # libgomp's default spin-wait turns every barrier into a stall when other processes share the cores
    # (docs/estimators.md, "Cost of rb"); children inherit this
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    print(f"hardware: {hardware(cfg['threads'])}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    print(f"shapes: B={cfg['B']} T={cfg['T']} V={cfg['V']}, chunk_rows={cfg['chunk_rows']}, "
          f"repeats={cfg['repeats']} (median after one warm-up), one fresh process per variant", flush=True)
    results = {}
    for i, (variant, d) in enumerate(PLAN, 1):
        print(f"[{i}/{len(PLAN)}] {variant} {d} ...", end=" ", flush=True)
        results[(variant, d)] = r = _run(variant, d, cfg)
        print(f"{1e3 * r['time']:.1f} ms, peak +{r['peak']:.0f} MB over {r['inputs']:.0f} MB with inputs", flush=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
