"""A training step at a large vocabulary: peak memory and time of rb against loo, whole batch against
task.micro_batch_size, with the value estimators and the entropy logged or not.

    python scripts/bench_large_vocab.py [--vocab 151936 --tokens 512 --prompts 2 --samples 2 --steps 3]
    python scripts/bench_large_vocab.py --code /path/to/other/checkout --only loo,rb   # another commit's klbench
    python scripts/bench_large_vocab.py --interleave 8     # rb/loo step time, side by side in one process,
                                                           # and each step's matrix-product FLOPs

Each line also prints the policy's forwards per sequence per step (the rollout's decode steps aside).

The model is a random Qwen2-architecture folder (a tiny body, hidden 64, 2 layers) with Qwen's vocabulary size,
so that the [B, T, V] logits, not the layers, decide the memory, as they do for a real Qwen at long responses.
Each configuration runs in a fresh process through klbench's own RLTask.training_step and backward, on one fixed
rollout of --tokens response tokens per sequence (EOS is made unreachable, so every response has that length).
Memory: the process's peak resident set during the steps above what it held before them (VmHWM, reset through
/proc/self/clear_refs after the rollout), with glibc's mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), so
that freed blocks leave the resident set at once and it follows what the step holds (each large allocation then
faults its pages in: step times run longer; `--malloc-default` times the steps as a run has them). Time: the median step (scoring, loss, logging, backward) after one
warm-up step; the rollout is timed once and is the same for every configuration. Ratios are taken against
`loo` on the whole batch, in one run: run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from klbench.config.compose import compose
from klbench.models.policies import build_policy
from klbench.tasks import build_task

work, steps, prompts, samples, log, *overrides = sys.argv[1:]
steps, prompts, samples = int(steps), int(prompts), int(samples)
cfg = compose(overrides, outputs=work + "/outputs", run_dir=work + "/run")
policy = build_policy(cfg.model, cfg.task.max_new_tokens)
with torch.no_grad():  # pi != pi_ref (the steps take no optimizer step): every estimator's gradient is non-zero
    g = torch.Generator().manual_seed(1)
    for p in policy.trainable():
        p.add_(0.02 * torch.randn(p.shape, generator=g))
task = build_task(cfg, policy, None)
logged = {}
task.metrics_read = log == "log"      # no trainer here: the train/ metrics are computed, then kept in a dict
task.log_now = lambda m: logged.update(m) if task.metrics_read else None
texts = [f"prompt {i}: the film was" for i in range(prompts)]
torch.manual_seed(0)
t0 = time.perf_counter()
ro = policy.rollout(texts, samples)
rollout_s = time.perf_counter() - t0
policy.rollout = lambda p, n: ro       # every step scores the same rollout


def hwm_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024


def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024


before = rss_mib()
open("/proc/self/clear_refs", "w").write("5")   # VmHWM := VmRSS: the peak of the steps alone from here
times = []
forwards = []  # the policy's forwards per sequence per step (LMPolicy.rows_forwarded counts scored sequences)
for i in range(steps + 1):
    t = time.perf_counter()
    rows = policy.rows_forwarded
    loss = task.training_step(texts, 0)
    loss.backward()
    for p in policy.trainable():
        p.grad = None
    times.append(time.perf_counter() - t)
    forwards.append((policy.rows_forwarded - rows) / len(ro.texts))
print("RESULT " + json.dumps({"step_s": statistics.median(times[1:]), "peak_mib": hwm_mib() - before,
                              "forwards": max(forwards),
                              "base_mib": before, "rollout_s": rollout_s,
                              "tokens": float(ro.mask.sum(-1).float().mean()),
                              "logged": sorted(k for k in logged if k.startswith("train/"))}))
"""


INTERLEAVED = r"""
import json, statistics, sys, time
import torch
from klbench.config.compose import compose
from klbench.models.policies import build_policy
from klbench.tasks import build_task

work, rounds, prompts, samples, estimators, *overrides = sys.argv[1:]
rounds, prompts, samples, estimators = int(rounds), int(prompts), int(samples), estimators.split(",")
cfgs = {e: compose([*overrides, f"estimator={e}"], outputs=f"{work}/outputs-{e}", run_dir=f"{work}/run-{e}")
        for e in estimators}
policy = build_policy(cfgs[estimators[0]].model, cfgs[estimators[0]].task.max_new_tokens)
with torch.no_grad():  # pi != pi_ref (the steps take no optimizer step): every estimator's gradient is non-zero
    g = torch.Generator().manual_seed(1)
    for p in policy.trainable():
        p.add_(0.02 * torch.randn(p.shape, generator=g))
tasks = {e: build_task(c, policy, None) for e, c in cfgs.items()}
for t in tasks.values():
    t.metrics_read = True
    t.log_now = lambda m: None
texts = [f"prompt {i}: the film was" for i in range(prompts)]
torch.manual_seed(0)
ro = policy.rollout(texts, samples)
policy.rollout = lambda p, n: ro       # every step scores the same rollout
times = {e: [] for e in estimators}
for r in range(rounds + 1):            # round 0 warms up
    for e in (estimators if r % 2 else estimators[::-1]):  # alternating order: drift hits both alike
        t = time.perf_counter()
        tasks[e].training_step(texts, 0).backward()
        for p in policy.trainable():
            p.grad = None
        if r:
            times[e].append(time.perf_counter() - t)
# the matrix products of one step each (torch's FLOP counter: mm, addmm, bmm): a count no machine's load moves
from torch.utils.flop_counter import FlopCounterMode
flops = {}
for e in estimators:
    with FlopCounterMode(display=False) as fc:
        tasks[e].training_step(texts, 0).backward()
    for p in policy.trainable():
        p.grad = None
    flops[e] = fc.get_total_flops()
print("RESULT " + json.dumps({"times": times, "flops": flops}))
"""


def filler_tokenizer(vocab: int):
    """Byte-level BPE without merges, as transformers rebuilds a Qwen2 tokenizer: the 256 byte symbols (prompts
    are made of them) and fillers up to the vocabulary size, so every id a random model samples decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab_ids = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *sorted(alphabet)])}
    vocab_ids.update({f"w{i}": i for i in range(len(vocab_ids), vocab)})
    tok = Tokenizer(models.BPE(vocab_ids, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def build(path: str, vocab: int, context: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    fast = filler_tokenizer(vocab)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked next-token distributions, as a trained model's
        model.lm_head.weight[2].fill_(0.0)
        # EOS: logit 0 against peaked others, so about never sampled: responses run to --tokens
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(path)
    fast.save_pretrained(path)


CONFIGS = [  # (label, estimator, micro_batch_size or None, log the train/ metrics)
    ("loo", "loo", None, True),
    ("rb", "rb", None, True),
    ("loo-no-logging", "loo", None, False),
    ("loo-micro-1", "loo", 1, True),
    ("rb-micro-1", "rb", 1, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", help="comma-separated labels of the configurations to run (default: all)")
    ap.add_argument("--code", help="a checkout whose klbench the configurations run (PYTHONPATH; default: this one)")
    ap.add_argument("--interleave", type=int, metavar="ROUNDS",
                    help="step times only: loo and rb in one process, alternating, ROUNDS rounds after a warm-up; "
                         "their ratio is then taken side by side (the machine's drift hits both alike)")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc's mmap threshold alone: step times as a run has them (the resident set then keeps "
                         "freed blocks, and the peak figures say little)")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-vocab-")
    model = os.path.join(root, "model")
    build(model, a.vocab, a.tokens + 64)
    # a separate pi_ref folder would double the load; the policy's own starting point is pi_ref, moved by a fixed
    # noise in each process (the steps take no optimizer step: at pi = pi_ref loo's gradient would be exactly zero,
    # and the hidden-state path skips a backward whose upstream gradient is zero)
    common = ["model=hf", f"model.name_or_path={model}", "reward=none", "task.reward_coef=0",
              f"task.max_new_tokens={a.tokens}", f"task.prompts_per_step={a.prompts}", f"task.n_samples={a.samples}",
              "task.log_every=1", "dataset=embedded"]
    results = {}
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not a.malloc_default:  # every freed block leaves the resident set: it then follows what the step holds
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if a.code:
        env["PYTHONPATH"] = os.path.abspath(a.code)
    if a.interleave:
        return interleaved(a, root, common, env)
    only = a.only.split(",") if a.only else [c[0] for c in CONFIGS]
    for label, est, micro, log in [c for c in CONFIGS if c[0] in only]:
        extra = [f"estimator={est}"] + ([f"task.micro_batch_size={micro}"] if micro else [])
        work = tempfile.mkdtemp(dir=root)
        p = subprocess.run([sys.executable, "-c", CHILD, work, str(a.steps), str(a.prompts), str(a.samples),
                            "log" if log else "quiet", *common, *extra], capture_output=True, text=True,
                           env=env, cwd=work)  # not the checkout: `python -c` puts the cwd ahead of PYTHONPATH
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            sys.exit(f"{label}: failed\n{p.stderr[-3000:]}")
        results[label] = r = json.loads(line[0][7:])
        print(f"{label:>16}: step {r['step_s']:6.2f} s  peak +{r['peak_mib']:7.0f} MiB  "
              f"{r.get('forwards', float('nan')):.0f} policy forward(s) per sequence (rollout "
              f"{r['rollout_s']:.1f} s, {r['tokens']:.0f} tokens/response, logged: "
              f"{', '.join(k[6:] for k in r['logged']) or '-'})", flush=True)
    B = a.prompts * a.samples
    one = B * a.tokens * a.vocab * 4 / 2 ** 20
    print(f"\nQwen2-shaped, V={a.vocab}, B={B} x T={a.tokens}: one float32 [B, T, V] = {one:.0f} MiB")
    base = results.get("loo")
    for label, r in results.items():
        ratios = f"time {r['step_s'] / base['step_s']:.2f}x loo, peak {r['peak_mib'] / base['peak_mib']:.2f}x loo " \
            if base else ""
        print(f"{label:>16}: {ratios}({r['peak_mib'] / one:.2f} [B, T, V]; resident before the steps "
              f"{r['base_mib']:.0f} MiB)")
    for est, ref in (("rb", "loo"), ("rb-micro-1", "loo-micro-1")):
        if est in results and ref in results:
            print(f"{est} / {ref}: peak {results[est]['peak_mib'] / results[ref]['peak_mib']:.2f}x, "
                  f"time {results[est]['step_s'] / results[ref]['step_s']:.2f}x")


def interleaved(a, root: str, common: list[str], env: dict) -> None:
    env = {k: v for k, v in env.items() if k != "MALLOC_MMAP_THRESHOLD_"}  # times as a run has them
    p = subprocess.run([sys.executable, "-c", INTERLEAVED, tempfile.mkdtemp(dir=root), str(a.interleave),
                        str(a.prompts), str(a.samples), "loo,rb", *common], capture_output=True, text=True, env=env,
                       cwd=root)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        sys.exit(f"interleaved: failed\n{p.stderr[-3000:]}")
    out = json.loads(line[0][7:])
    times, flops = out["times"], out["flops"]
    ratios = [r / l for l, r in zip(times["loo"], times["rb"])]
    print(f"V={a.vocab}, B={a.prompts * a.samples} x T={a.tokens}, {a.interleave} alternating rounds, every value "
          f"estimator and the entropy logged")
    for e, ts in times.items():
        print(f"{e:>4}: median step {statistics.median(ts):.2f} s  ({', '.join(f'{t:.2f}' for t in ts)})")
    print(f"rb / loo, round by round: median {statistics.median(ratios):.3f}x "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"matrix products per step (FLOPs): loo {flops['loo'] / 1e9:.1f} G, rb {flops['rb'] / 1e9:.1f} G: "
          f"rb / loo {flops['rb'] / flops['loo']:.3f}x")


if __name__ == "__main__":
    main()
