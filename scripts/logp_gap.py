"""The sampler/scorer log-prob gap (issue 29 item 6) on the tiny architectures of tests/tiny_lms.py.

The rollout engine keeps the log-prob of each token it draws (Samples.logp: the decode step's logits, one
position at a time over the KV cache); the scoring pass recomputes them in one forward over prompt + response.
In float32 the two agree to rounding; in bfloat16 the two computations round differently (different matmul
shapes, and with SDPA different kernels for one query against many keys than for a whole causal block).
This prints, per architecture, dtype (`autocast`: float32 weights under bf16 autocast, as hardware=bf16 runs)
and attention implementation, the largest and the mean absolute gap in
nats per response token.

    python scripts/logp_gap.py [--archs gpt2,llama,qwen2] [--rows 16] [--new 48] [--seeds 3] [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from tiny_lms import ARCHITECTURES, save_chat_tokenizer, save_tiny_arch  # noqa: E402

from klbench.config.errors import ConfigError  # noqa: E402
from klbench.models.hf import load_causal_lm  # noqa: E402
from klbench.models.policies import LMPolicy  # noqa: E402

PROMPTS = ["The movie", "I did not like it at all, the plot was thin", "A fine film", "Nothing happens"]


def gap(path: str, dtype: str, attn: str, rows: int, new: int, seeds: int, device: str) -> tuple[float, float]:
    """(max, mean) |sampler log-prob - scorer log-prob| over the response tokens of `seeds` rollouts."""
    autocast = dtype == "autocast"  # hardware=bf16: float32 weights, both passes under bf16 autocast
    model, tok = load_causal_lm(path, "float32" if autocast else dtype, attn_implementation=attn)
    policy = LMPolicy(model.to(device), model.to(device), tok, max_new_tokens=new)
    diffs = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            ro = policy.rollout(PROMPTS, rows // len(PROMPTS))
            with torch.no_grad():
                score = policy.score(ro).logp  # [B, L] float32 log-softmax of the scoring pass's logits
        diffs.append((ro.sampled_logp - score).abs()[ro.mask])
    d = torch.cat(diffs)
    return float(d.max()), float(d.mean())


def save_tiny_gpt2(path: str, tok) -> str:
    """klbench's GPT-2 (the embedded models' architecture, and the fused decode and scoring passes) at the other
    models' size, its final layer norm sharpened as save_tiny_arch sharpens their heads."""
    from klbench.models.embedded.build import build_gpt2
    model = build_gpt2(len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=128, seed=0, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.transformer.ln_f.weight.mul_(40.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(["gpt2", *ARCHITECTURES]))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="logp-gap-")
    tok = save_chat_tokenizer(os.path.join(root, "tokenizer"))
    print(f"| architecture | dtype | attention | max gap (nats) | mean gap (nats) |")
    print("|---|---|---|---|---|")
    for arch in args.archs.split(","):
        path = (save_tiny_gpt2(os.path.join(root, arch), tok) if arch == "gpt2" else
                save_tiny_arch(arch, os.path.join(root, arch), tokenizer=tok))
        for dtype in ("float32", "bfloat16", "autocast"):
            for attn in ("sdpa", "eager"):
                try:
                    mx, mean = gap(path, dtype, attn, args.rows, args.new, args.seeds, args.device)
                except ConfigError as e:  # an architecture without SDPA (Gemma2 in transformers 5.24)
                    print(f"| {arch} | {dtype} | {attn} | not supported: {str(e).split(': ', 1)[1]} | |", flush=True)
                    continue
                print(f"| {arch} | {dtype} | {attn} | {mx:.2e} | {mean:.2e} |", flush=True)


if __name__ == "__main__":
    main()
