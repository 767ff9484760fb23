"""The two scoring paths side by side on a grid of head sizes (docs/scale.md, "Choosing the scoring path by its
cost"): is model.scoring_path=auto's choice within 5% of the faster path in every cell?

    python scripts/bench_scoring_paths.py                         # the grid: V x H x rows, both paths
    python scripts/bench_scoring_paths.py --rounds 5 --max-gib 12 # more rounds; cells up to 12 GiB of logits path
    python scripts/bench_scoring_paths.py --vocab 2048 --hidden 64 --rows 512   # one cell

A cell is what the two paths do differently in a step: the LM heads and the reductions over the vocabulary, for
`rows` response positions (m x L of a micro-batch) of hidden size H and vocabulary V, rb's loss and its backward.
The transformer body is the same on both paths, and is left out.
- **logits**: the policy's [rows, V] logits with gradient and the reference's without (F.linear), then what
  LMPolicy's logits path runs: target_batch (log-probs and rb's exact kappa, the reference's logits donated),
  the entropy, rb's surrogate and backward to h and the head's weight.
- **hidden**: the reference's log-probs and normaliser (head_logprob), head_scores (log-probs, kappa, entropy a
  tile at a time), rb's surrogate and backward.
Weights are random at a trained model's logit scale (std 3), pi_ref's head a perturbation of pi's (KL about 0.1
nat per position); float32 on the CPU. Each (cell, path) runs in a process of its own (a fresh allocator), one
warm-up then --rounds timed repetitions; the paths alternate which goes first, cell by cell and round by round.
Peak: the resident set's high-water mark during one repetition above the set before it (/proc/self/clear_refs),
glibc's mmap threshold fixed at 1 MiB so that freed blocks leave the resident set.
Printed per cell: each path's median time and peak, hidden/logits, auto's choice at --budget (LMPolicy's rule,
klbench.models.logits_budget.logits_by_cost: the logits path where H >= 192 and rows x V x 4 bytes fit), and whether
the choice is within 5% of the faster path's time, and of the faster path the budget allows. Cells whose logits
path would hold more than --max-gib are not run (said so).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GRID_V, GRID_H, GRID_ROWS = (2048, 32768, 151936), (64, 896), (512, 4096)


def one(V: int, H: int, N: int, path: str, rounds: int, threads: int) -> dict:
    """In a process of its own: the median wall and CPU time and the peak of one (cell, path)."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    from klbench.estimators import KLBatch, gradient_estimator
    from klbench.estimators.head_scores import LMHead, head_logprob, head_scores
    from klbench.estimators.sampling import Sampling, target_batch
    from klbench.estimators.vocab_exact import exact_token_entropy
    g = torch.Generator().manual_seed(0)
    w = (3 * torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_()  # [V, H]: logits of std about 3
    w_ref = (w.detach() + 0.3 * torch.randn(V, H, generator=g) / H ** 0.5)  # [V, H]
    h = torch.randn(N, H, generator=g).requires_grad_()  # [N, H] the policy's final hidden states
    h_ref = h.detach() + 0.1 * torch.randn(N, H, generator=g)  # [N, H] the reference's
    tok = torch.randint(0, V, (N,), generator=g)  # [N]
    mask = torch.ones(1, N, dtype=torch.bool)  # [1, N]: one sequence of N positions
    rb = gradient_estimator("rb")

    def step():
        w.grad = h.grad = None
        if path == "logits":
            logits = torch.nn.functional.linear(h, w)[None]  # [1, N, V]
            with torch.no_grad():
                ref_logits = torch.nn.functional.linear(h_ref, w_ref)[None]  # [1, N, V]
            b = target_batch(logits, ref_logits, tok[None], mask, Sampling(), "sampler", with_token_kl=True,
                             donate_ref=True)
            exact_token_entropy(b.logits.detach(), mask, b.chunk_rows)  # what a logged step reads
            batch = KLBatch(b.logp, b.ref_logp, mask, token_kl=b.token_kl)
        else:
            ref_head = LMHead(w_ref)
            ref_logp, norm = head_logprob(h_ref, ref_head, tok)
            s = head_scores(h, LMHead(w), tok, h_ref, ref_head, with_token_kl=True, ref_norm=norm)
            batch = KLBatch(s.logp[None], ref_logp[None], mask, token_kl=s.kappa[None])
        rb(batch).mean().backward()

    step()  # warm-up
    times, cpu = [], []
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark back to the resident set now
        f.write("5")
    before = _status("VmRSS")
    step()
    return {"wall": statistics.median(times), "cpu": statistics.median(cpu), "peak": _status("VmHWM") - before}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from klbench.models.logits_budget import logits_by_cost, size_bytes  # noqa: E402  pure Python, no torch


def parse_size(text: str) -> int:
    n = size_bytes(text)
    if n is None:
        sys.exit(f"bench_scoring_paths: --budget {text!r} is not a positive size")
    return n


def main() -> None:
    if sys.argv[1:2] == ["_one"]:
        V, H, N, path, rounds, threads = sys.argv[2:8]
        print(json.dumps(one(int(V), int(H), int(N), path, int(rounds), int(threads))))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=list(GRID_V))
    p.add_argument("--hidden", type=int, nargs="+", default=list(GRID_H))
    p.add_argument("--rows", type=int, nargs="+", default=list(GRID_ROWS))
    p.add_argument("--rounds", type=int, default=3, help="timed repetitions per (cell, path) (default 3)")
    p.add_argument("--budget", default="256MiB", help="model.logits_budget to judge (default 256MiB)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default 0: torch's own)")
    p.add_argument("--judge", choices=("wall", "cpu"), default="wall",
                   help="the time the 5%% test reads: wall (default; an idle machine) or cpu (one thread on a "
                        "loaded machine, where the wall time is mostly waiting)")
    p.add_argument("--max-gib", type=float, default=6.0,
                   help="skip cells whose logits path holds more (about 3 float32 [rows, V]; default 6)")
    a = p.parse_args()
    budget = parse_size(a.budget)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2 ** 20), "HF_HUB_OFFLINE": "1"}
    print(f"{os.cpu_count()} cores, torch threads: {a.threads or 'torch default'}; load average "
          f"{os.getloadavg()[0]:.2f}; budget {a.budget}; times: {a.judge}", flush=True)
    print(f"| V | H | rows | logits: {a.judge} time, peak | hidden: {a.judge} time, peak | hidden/logits | "
          "auto picks | within 5% of the faster | of the faster within the budget |\n|---|---|---|---|---|---|---|---|---|")
    k = 0
    for V in a.vocab:
        for H in a.hidden:
            for N in a.rows:
                one_logits = N * V * 4
                if 3 * one_logits > a.max_gib * 2 ** 30:
                    print(f"| {V:,} | {H} | {N} | not run here: the logits path holds about "
                          f"{3 * one_logits / 2**30:.1f} GiB (> --max-gib {a.max_gib}) | | | "
                          f"{'logits' if logits_by_cost(H, one_logits, budget) else 'hidden'} | | |", flush=True)
                    continue
                res = {}
                order = ("logits", "hidden") if k % 2 == 0 else ("hidden", "logits")
                k += 1
                for path in order:
                    r = subprocess.run([sys.executable, __file__, "_one", str(V), str(H), str(N), path,
                                        str(a.rounds), str(a.threads)], env=env, capture_output=True, text=True)
                    if r.returncode:
                        sys.exit(f"bench_scoring_paths: {V} {H} {N} {path} failed: {r.stderr.strip()[-800:]}")
                    res[path] = json.loads(r.stdout.strip().splitlines()[-1])
                lt, ht = res["logits"][a.judge], res["hidden"][a.judge]
                pick = "logits" if logits_by_cost(H, one_logits, budget) else "hidden"
                allowed = min(lt, ht) if one_logits <= budget else ht  # logits over the budget: not a choice
                ok = res[pick][a.judge] <= 1.05 * min(lt, ht)
                ok_budget = res[pick][a.judge] <= 1.05 * allowed
                print(f"| {V:,} | {H} | {N} | {lt:.3f} s, {res['logits']['peak'] / 2**20:.0f} MiB | "
                      f"{ht:.3f} s, {res['hidden']['peak'] / 2**20:.0f} MiB | {ht / lt:.2f} | {pick} | "
                      f"{'yes' if ok else 'NO'} | {'yes' if ok_budget else 'NO'} |", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
