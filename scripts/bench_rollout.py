"""The rollout engine and a step's scoring, side by side in one process (docs/embedded.md, "Rollouts";
docs/running.md, "Speed").

    python scripts/bench_rollout.py [--model PATH] [--rounds 15] [--threads N] [--steps 50] [--floor-only]
    python scripts/bench_rollout.py --floor-only --steps 50     # the floor and the bare job only
    python scripts/bench_rollout.py --random qwen2-0.5b --rollout-only --rows 4 --new-tokens 64 --rounds 5

On the issue-22 peer job's shapes (8 prompts x 4 samples x 32 new tokens; the tiny GPT-2 that
scripts/bench_trl_peer.py builds under outputs/.bench, or any causal LM folder with --model), interleaved
round by round so that a change in the machine's load hits every variant alike:
- a rollout through generate() and through klbench's loop (kv_cache_sample); EOS is an id outside the
  vocabulary, so every rollout runs all 32 steps. The two must draw the same tokens under one seed: the script
  stops if they do not;
- the sampling noise for one step: Tensor.exponential_() against exp_noise (the same bits);
- a training step's scoring, estimate and backward with estimator=loo and estimator=rb;
- the floor of the peer job's 50 steps: what a training step's aten ops alone take (rollout with the
  tokenizer's EOS, scoring, estimate=loo, backward, AdamW; torch's profiler, self time of every aten:: op,
  nothing of the Python between them, less all the wall time the profiler adds to a step) and the job's
  reward (VADER, on the step's responses), times 50, plus a process that only imports torch, torch._dynamo
  (torch.optim's step imports it) and transformers and loads the model (the cyclic garbage collector off, and
  the objects frozen before exit, as klbench.cli does for a single job). No implementation of this job that
  draws generate()'s samples with these kernels runs faster; scripts/bench_trl_peer.py gives TRL's time;
- the bare job (with --floor-only): the same job as a plain script in a process of its own, timed start to exit:
  the floor's step from Python, VADER, the job's gradient clipping and its two validations, no framework. What
  klbench's whole process takes beyond it is Hydra's, Lightning's and klbench's own.
--random SHAPE builds a random-weight model of a real model's shape (RANDOM_SHAPES: Qwen2-0.5B, GPT-2 small,
GPT-2 large) with from_config, saves it under /tmp/klbench-bench with a small BPE tokenizer and loads it through
klbench's loader: the rollout at a real size, offline. --rollout-only times the rollouts alone (--rows prompts,
one sample each, --new-tokens steps).
Prints the machine, the threads, the load average, each variant's median and its ratio to the first.
"""
from __future__ import annotations

import gc
import sys

if "--bare-job" in sys.argv:  # the bare job keeps the collector out of its imports, as klbench.cli does
    gc.disable()

import argparse
import glob
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, SAMPLES, NEW_TOKENS = 8, 4, 32
# the shapes of real models, for --random (random weights: a rollout's cost does not depend on them)
RANDOM_SHAPES = {
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768),
    "gpt2-small": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "gpt2-large": dict(model_type="gpt2", n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved_times(variants: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant in each round, one call of each per round after one untimed warm-up round."""
    times = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, fn in variants.items():
            t = timed(fn)
            if r:
                times[name].append(t)
    return times


def interleaved(variants: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each variant (interleaved_times)."""
    return {name: statistics.median(ts) for name, ts in interleaved_times(variants, rounds).items()}


def report(title: str, medians: dict[str, float], unit: float = 1e3, label: str = "ms") -> None:
    base = next(iter(medians.values()))
    print(title)
    for name, m in medians.items():
        print(f"  {name:44s} {m * unit:9.3f} {label}  {m / base:5.2f}x")


def random_model(shape: str) -> str:
    """A save_pretrained folder of RANDOM_SHAPES[shape] with random weights (seed 0) and a 2,000-token BPE on
    generated reviews, under /tmp/klbench-bench, built once. Returns its path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from klbench.models.embedded.build import train_tokenizer
    from klbench.models.embedded.corpus import generate_reviews

    path = Path("/tmp/klbench-bench") / shape
    if (path / "config.json").exists():
        return str(path)
    spec = dict(RANDOM_SHAPES[shape])
    tok = train_tokenizer(generate_reviews(300, seed=0), 2000)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    print(f"built {shape}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {path}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a causal LM folder (default: the peer job's GPT-2 under outputs/.bench)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per variant (default 15)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--steps", type=int, default=50, help="training steps the floor is for (default 50)")
    p.add_argument("--floor-only", action="store_true",
                   help="only the floor and the bare job, ending with lines `floor_seconds S` and `bare_seconds S` "
                        "(scripts/bench_trl_peer.py --floor)")
    p.add_argument("--random", choices=sorted(RANDOM_SHAPES),
                   help="a random-weight model of this shape, built under /tmp/klbench-bench (instead of --model)")
    p.add_argument("--rollout-only", action="store_true", help="time the rollouts only")
    p.add_argument("--rows", type=int, help="with --rollout-only: this many prompts, one sample each")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"tokens per rollout (default {NEW_TOKENS})")
    p.add_argument("--bare-job", action="store_true", help=argparse.SUPPRESS)  # the bare job's own process
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.new_tokens < 1 or (a.rows is not None and a.rows < 1):
        sys.exit("bench_rollout: --rounds, --steps, --rows and --new-tokens must be >= 1")
    if a.random and a.model:
        sys.exit("bench_rollout: --random builds its own model: pass --model or --random, not both")
    if a.rows is not None and not a.rollout_only:
        sys.exit("bench_rollout: --rows sizes the rollouts of --rollout-only; the other parts keep the peer job's")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peer = next(iter(sorted(glob.glob(str(ROOT / "outputs/.bench/model-peer-gpt2-*")))), None)
    model_dir = random_model(a.random) if a.random else a.model or peer
    if model_dir is None:
        sys.exit("bench_rollout: no --model and no peer model under outputs/.bench: run "
                 "`python scripts/bench_trl_peer.py --pairs 1 --steps 1` once to build it, or pass --model")
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.bare_job:
        return bare_job(model_dir, a.steps)

    from klbench.estimators import gradient_estimator
    from klbench.models.embedded import embedded_prompts
    from klbench.models.hf import load_causal_lm
    from klbench.models.policies import LMPolicy
    from klbench.models.rollout import exp_noise

    model, tok = load_causal_lm(model_dir)
    prompts, samples, new = (a.rows or PROMPTS, 1 if a.rows else SAMPLES, a.new_tokens)
    enc = tok(embedded_prompts("train")[:prompts], return_tensors="pt", padding=True)
    ids = enc.input_ids.repeat_interleave(samples, 0)  # [B, P]
    attn = enc.attention_mask.repeat_interleave(samples, 0)  # [B, P]
    B, V = ids.shape[0], model.config.vocab_size
    print(f"model: {model_dir} ({type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"parameters, vocab {V})")
    print(f"machine: {os.cpu_count()} logical cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    print(f"job: {prompts} prompts x {samples} samples x {new} new tokens, float32, {a.rounds} rounds\n")
    if a.rollout_only:
        return rollouts(model, tok, ids, attn, new, a.rounds)
    ref, _ = load_causal_lm(model_dir)
    if a.floor_only:
        return floor(LMPolicy(model, ref, tok, new), model_dir, a.rounds, a.steps)

    rollouts(model, tok, ids, attn, new, a.rounds)

    buf = torch.empty(B, V)
    noise = {"Tensor.exponential_()": lambda: buf.exponential_(),
             "exp_noise (float64 uniform_, -log1p(-u))": lambda: exp_noise((B, V), torch.device("cpu"))}
    report(f"\nsampling noise for one step, [{B}, {V}]", interleaved(noise, a.rounds * 20), 1e6, "us")

    policy = LMPolicy(model, ref, tok, new)
    torch.manual_seed(0)
    ro = policy.rollout(embedded_prompts("train")[:PROMPTS], SAMPLES)

    def step(name):
        est = gradient_estimator(name)

        def run():
            model.zero_grad(set_to_none=True)
            batch = policy.score(ro)
            (est.estimate(batch).values.mean() - batch.masked_logp.sum(-1).mean()).backward()
        return run

    report("\na training step's scoring (policy and reference), estimate and backward",
           interleaved({"estimator=loo": step("loo"), "estimator=rb": step("rb")}, a.rounds))
    floor(policy, model_dir, a.rounds, a.steps)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def rollouts(model, tok, ids, attn, new: int, rounds: int) -> None:
    """generate() and klbench's loop, interleaved: the same tokens under one seed (else the script stops), then
    each one's median and each round's time."""
    from klbench.models.rollout import generate_sample, kv_cache_sample

    V = model.config.vocab_size

    def draw(sampler, **kw):
        def run():
            torch.manual_seed(0)
            return sampler(model, ids, attn, new, eos_ids=V, pad_id=tok.pad_token_id, **kw).tokens  # V: no token
        return run

    variants = {"generate()": draw(generate_sample), "kv_cache_sample": draw(kv_cache_sample)}
    tokens = [fn() for fn in variants.values()]
    if not all(torch.equal(t, tokens[0]) for t in tokens):
        sys.exit("bench_rollout: the two samplers drew different tokens under one seed")
    times = interleaved_times(variants, rounds)
    report(f"rollout ({new} steps, the same tokens from both)",
           {name: statistics.median(ts) for name, ts in times.items()})
    for name, ts in times.items():
        print(f"  {name}: rounds {', '.join(f'{t:.2f}' for t in ts)} s")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


def training_step(policy, est, opt, prompts: list[str], clip: float | None = None):
    """One step of the peer job as the floor and the bare job take it: rollout, scoring, the estimator's loss,
    backward, (clipping,) AdamW. Returns the rollout (its texts are the reward's input)."""
    opt.zero_grad(set_to_none=True)
    ro = policy.rollout(prompts, SAMPLES)
    batch = policy.score(ro)
    (est.estimate(batch).values.mean() - batch.masked_logp.sum(-1).mean()).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(policy.trainable(), clip)
    opt.step()
    return ro


def bare_job(model_dir: str, steps: int) -> None:
    """The peer job as a plain script, for floor() to time as a whole process: klbench's policy and the floor's
    training step, the job's reward (VADER), its gradient clipping and its two validations (32 held-out prompts
    x 2 samples at step 0 and at the last step, scored for rb's val/seq_kl, in batches of 16 prompts as klbench's
    val loader gives them); no Hydra, no Lightning, no config, no logging. Prints `bare_validation_seconds S`."""
    from klbench.estimators import gradient_estimator, value_estimator
    from klbench.models.embedded import embedded_prompts
    from klbench.models.hf import load_causal_lm
    from klbench.models.policies import LMPolicy
    from klbench.rewards.reward import VaderReward

    model, tok = load_causal_lm(model_dir)
    ref, _ = load_causal_lm(model_dir)
    policy = LMPolicy(model, ref, tok, NEW_TOKENS)
    gc.freeze()
    gc.enable()
    est, rb, vader = gradient_estimator("loo"), value_estimator("rb"), VaderReward()
    opt = torch.optim.AdamW(policy.trainable(), lr=1e-4, weight_decay=0.0)
    train, held_out = embedded_prompts("train")[:64], embedded_prompts("val")[:32]
    val_s = 0.0

    def validate() -> float:
        t0 = time.perf_counter()
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(1234)
            for i in range(0, len(held_out), 16):
                ro = policy.rollout(held_out[i:i + 16], 2)
                vader.score_texts(ro.texts)
                rb(policy.score(ro, None, with_token_kl=True)).tolist()
        return time.perf_counter() - t0

    val_s += validate()
    for step in range(steps):
        first = step * PROMPTS % len(train)
        vader.score_texts(training_step(policy, est, opt, train[first:first + PROMPTS], clip=1.0).texts)
    val_s += validate()
    print(f"bare_validation_seconds {val_s:.3f}")
    gc.freeze()


def floor(policy, model_dir: str, rounds: int, steps: int = 50) -> None:
    """The peer job's lower bound: `steps` x a training step's aten-op time + importing and loading."""
    from torch.profiler import profile

    from klbench.estimators import gradient_estimator
    from klbench.models.embedded import embedded_prompts
    from klbench.rewards.reward import VaderReward

    est = gradient_estimator("loo")
    opt = torch.optim.AdamW(policy.trainable(), lr=1e-4, weight_decay=0.0)
    prompts = embedded_prompts("train")[:PROMPTS]

    texts = []

    def train_step():
        texts.append(training_step(policy, est, opt, prompts).texts)

    train_step()  # warm-up, and torch.optim's first step imports torch._dynamo
    wall_ms = statistics.median(timed(train_step) for _ in range(rounds)) * 1e3
    with profile() as prof:
        profiled_ms = statistics.median(timed(train_step) for _ in range(rounds)) * 1e3
    vader = VaderReward()
    reward_ms = statistics.median(timed(lambda: vader.score_texts(t)) for t in texts) * 1e3  # the job's own reward
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    calls = sum(e.count for e in ops) / rounds
    # the profiler's own cost, all of it counted against the ops: what it adds to a step's wall time
    op_ms = sum(e.self_cpu_time_total for e in ops) / rounds / 1e3 - max(0.0, profiled_ms - wall_ms)
    # with Python's cyclic collector kept out of it as klbench.cli keeps it (off while importing, the imports'
    # objects frozen before exit): without that the same process spends about 2 s in collections that free nothing
    code = ("import gc; gc.disable()\nimport torch, torch._dynamo, klbench.models\n"
            f"from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained({model_dir!r})\n"
            "gc.freeze()")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
        loads.append(time.perf_counter() - t0)
    load = statistics.median(loads)
    print(f"\nthe floor of the peer job's {steps} steps")
    print(f"  a training step, unprofiled (rollout, scoring, loo, backward, AdamW)   {wall_ms:9.1f} ms  "
          f"(median of {rounds})")
    print(f"  the same step under torch's profiler                                   {profiled_ms:9.1f} ms  "
          f"(median of {rounds})")
    print(f"  its aten ops alone ({calls:.0f} calls), less what the profiler added       {op_ms:9.1f} ms")
    print(f"  a process importing torch, torch._dynamo, transformers; loading the model {load:7.2f} s   "
          f"(median of 3)")
    print(f"  the job's reward, VADER on a step's {PROMPTS * SAMPLES} responses (Python)        {reward_ms:9.1f} ms")
    total = load + steps * (op_ms + reward_ms) / 1e3
    print(f"  floor: {load:.2f} s + {steps} x ({op_ms:.1f} + {reward_ms:.1f}) ms = {total:.1f} s: no Python but the "
          "reward's, no validation")
    print(f"floor_seconds {total:.3f}")
    # the same job from Python: what the floor leaves out (the Python between the ops, the second model, the
    # validations) and klbench does too; klbench's whole process adds only its framework on top
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--bare-job", "--model", model_dir, "--steps", str(steps)],
                         check=True, env=env, capture_output=True, text=True).stdout
    bare = time.perf_counter() - t0
    val = float(out.split("bare_validation_seconds ")[1].split()[0])
    print(f"\nthe bare job: the same {steps} steps as a plain script, whole process (Python between the ops, the "
          f"reference model,\n  gradient clipping, the two validations: {val:.2f} s): {bare:.1f} s, "
          f"{bare / total:.2f}x the floor")
    print(f"bare_seconds {bare:.3f}")


if __name__ == "__main__":
    main()
