"""klbench's `rb` inside TRL's GRPOTrainer against TRL's own k3, one training step's KL-dependent work, interleaved.

    python scripts/bench_trl_kl_step.py --shape tiny --pairs 5
    python scripts/bench_trl_kl_step.py --shape 0.5b --pairs 3     # Qwen2.5-0.5B's shape, random weights, fp32

Three variants score the same fixed micro-batch (prompts x completions of random tokens, non-zero advantages), each
timed as one step's work that depends on the KL term, in rotating order within each round:
- `trl_k3`: TRL 1.16.0's own KL (trl.GRPOTrainer, beta 0.05): the reference's log-probs as TRL computes them when it
  scores a generation batch (`_get_per_token_logps_and_entropies` on the reference, no gradient), then TRL's loss
  with its k3 term, then backward;
- `klbench_rb`: klbench.integrations.trl.GRPOTrainer(kl_estimator="rb"): TRL's loss with the policy's head run once
  by head_scores (klbench/integrations/trl_head.py), the reference's states inside it, then backward;
- `klbench_rb_2heads`: the same with the one-head path off: TRL's fused head, then head_scores beside it (what the
  integration did before, and still does where TRL's head would round in bf16).
Sampling, rewards and the optimiser step are the same on every side and are left out. Printed: the machine's load,
the median seconds of each variant, the ratio to trl_k3, and where the time goes (--profile: torch.profiler's top
operators of one step of each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

SHAPES = {  # (config class, options): tiny is the tiny random Llama; 0.5b is Qwen2.5-0.5B's shape
    "tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=2000, max_position_embeddings=512,
                                 tie_word_embeddings=False)),
    "0.5b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                                 tie_word_embeddings=True, use_sliding_window=False)),
}


def tokenizer(folder: str):
    """A word-level tokenizer of 500 ids with pad and eos (the model's vocabulary may be larger: TRL never samples)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(497)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def build(shape: str, folder: str) -> None:
    import torch
    import transformers
    name, options = SHAPES[shape]
    tok = tokenizer(folder)
    torch.manual_seed(0)
    config = getattr(transformers, name)(**options, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                         bos_token_id=tok.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def trainers(folder: str, work: str, generations: int):
    """(TRL's GRPOTrainer, klbench's) on one policy object and one reference object (memory: a 0.5B model is 2 GB)."""
    from datasets import Dataset
    from trl import GRPOConfig
    from trl import GRPOTrainer as TRLGRPO

    from klbench.integrations.trl import GRPOTrainer

    def args():
        return GRPOConfig(output_dir=work, beta=0.05, num_generations=generations,
                          per_device_train_batch_size=generations, max_completion_length=8, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                          gradient_checkpointing=False)

    data = Dataset.from_dict({"prompt": ["w1 w2"] * generations})
    reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731 (never called: no generation here)
    theirs = TRLGRPO(model=folder, reward_funcs=reward, args=args(), train_dataset=data)
    ours = GRPOTrainer(model=theirs.model, reward_funcs=reward, args=args(), train_dataset=data, kl_estimator="rb")
    ours.ref_model = theirs.ref_model  # the same weights: one copy
    for t in (theirs, ours):
        t.current_gradient_accumulation_steps = 1
        t.model.train()
    return theirs, ours


def batch(n: int, prompt_len: int, completion_len: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (n, prompt_len), generator=g)
    completion = torch.randint(3, vocab, (n, completion_len), generator=g)
    mask = torch.ones(n, completion_len, dtype=torch.long)
    return dict(prompt_ids=prompt, prompt_mask=torch.ones_like(prompt), completion_ids=completion, completion_mask=mask,
                advantages=torch.randn(n, generator=g), num_items_in_batch=mask.sum().float(),
                klbench_group=torch.arange(n) // n)


def step(variant: str, theirs, ours, inputs: dict) -> dict[str, float]:
    """One step's KL-dependent work of `variant`; the seconds of its phases."""
    import torch

    from klbench.integrations import trl_head
    t = {}
    t0 = time.perf_counter()
    trainer = theirs if variant == "trl_k3" else ours
    inputs = dict(inputs)
    if variant == "trl_k3":  # the reference's log-probs, as TRL scores a generation batch (grpo_trainer.py:2712)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            inputs["ref_per_token_logps"] = theirs._get_per_token_logps_and_entropies(
                theirs.ref_model, ids, attention, inputs["completion_ids"].shape[1])[0]
    t["reference pass"] = time.perf_counter() - t0
    refusal = trl_head.refusal
    if variant == "klbench_rb_2heads":
        trl_head.refusal = lambda bare, args: "off for the comparison"
    try:
        t1 = time.perf_counter()
        loss = trainer.compute_loss(trainer.model, inputs)
        t["loss forward"] = time.perf_counter() - t1
    finally:
        trl_head.refusal = refusal
    t2 = time.perf_counter()
    loss.backward()
    t["backward"] = time.perf_counter() - t2
    trainer.model.zero_grad(set_to_none=True)
    t["total"] = time.perf_counter() - t0
    return t


def profile(variant: str, theirs, ours, inputs: dict, rows: int = 8) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step(variant, theirs, ours, inputs)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--pairs", type=int, default=3, help="rounds of the three variants, in rotating order")
    p.add_argument("--generations", type=int, default=4, help="sequences in the micro-batch (one prompt's group)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top operators of one step of each")
    a = p.parse_args()
    for name, v in (("--pairs", a.pairs), ("--generations", a.generations), ("--prompt-len", a.prompt_len),
                    ("--completion-len", a.completion_len)):
        if v < 1:
            sys.exit(f"bench_trl_kl_step.py: {name}={v}: must be >= 1")
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = tempfile.mkdtemp(prefix="bench_trl_kl_step_")
    folder = os.path.join(work, "model")
    build(a.shape, folder)
    theirs, ours = trainers(folder, os.path.join(work, "out"), a.generations)
    inputs = batch(a.generations, a.prompt_len, a.completion_len, 500)
    variants = ["trl_k3", "klbench_rb", "klbench_rb_2heads"]
    for v in variants:  # a warm-up step of each: allocator, first-call costs
        step(v, theirs, ours, inputs)
    times: dict[str, list[dict]] = {v: [] for v in variants}
    loads = [os.getloadavg()[0]]
    for r in range(a.pairs):
        order = variants[r % 3:] + variants[:r % 3]
        for v in order:
            times[v].append(step(v, theirs, ours, inputs))
            print(f"round {r + 1}: {v} {times[v][-1]['total']:.3f} s", file=sys.stderr, flush=True)
        loads.append(os.getloadavg()[0])
    params = sum(p.numel() for p in theirs.model.parameters())
    print(f"shape {a.shape} ({params / 1e6:.1f}M parameters), micro-batch {a.generations} x ({a.prompt_len} prompt + "
          f"{a.completion_len} completion) tokens, fp32 CPU, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} cores, "
          f"load average {min(loads):.1f}-{max(loads):.1f} during the rounds, {a.pairs} rounds")
    base = statistics.median(t["total"] for t in times["trl_k3"])
    print(f"{'variant':<20}{'median s':>10}{'/ trl_k3':>10}   phases (median s)")
    for v in variants:
        med = statistics.median(t["total"] for t in times[v])
        phases = ", ".join(f"{k} {statistics.median(t[k] for t in times[v]):.3f}"
                           for k in ("reference pass", "loss forward", "backward"))
        print(f"{v:<20}{med:>10.3f}{med / base:>10.3f}   {phases}")
    print("per round, / trl_k3:", "; ".join(
        ", ".join(f"{v} {times[v][r]['total'] / times['trl_k3'][r]['total']:.3f}" for v in variants[1:])
        for r in range(a.pairs)))
    if a.profile:
        for v in variants:
            print(f"\n== {v}: torch.profiler, one step, top operators by self CPU time")
            print(profile(v, theirs, ours, inputs))


if __name__ == "__main__":
    main()
