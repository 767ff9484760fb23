"""Bytes per rank under hardware=fsdp against one process, on a random Llama-architecture folder.

    python scripts/bench_fsdp_memory.py [--hidden 512 --layers 8 --vocab 32000 --ranks 2]

Runs one RL step (rb, 4 prompts x 3 samples x 8 tokens) through tests/fsdp_worker.py on 1 process and on `ranks`
CPU ranks (gloo), and prints what each rank holds of parameters (policy and reference), gradients and AdamW's
state, counted from the tensors (a DTensor by its local shard), and each process's peak resident set, which also
holds the whole models as loaded (every rank loads both folders before sharding) and the gathered rollout.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("bench_lora_memory", ROOT / "scripts" / "bench_lora_memory.py")
    lora = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lora)
    root = tempfile.mkdtemp(prefix="bench-fsdp-")
    model = os.path.join(root, "model")
    lora.build(model, a.hidden, a.layers, a.vocab)
    import torch
    overrides = ["model=hf", f"model.name_or_path={model}", "task.prompts_per_step=4", "task.n_samples=3",
                 "task.max_new_tokens=8", "estimator=rb", "estimator.beta=0.5"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    rows = {}
    for world in (1, a.ranks):
        out = os.path.join(root, f"w{world}.pt")
        worker = str(ROOT / "tests" / "fsdp_worker.py")
        subprocess.run([sys.executable, worker, str(world), " ".join([out, *overrides])], check=True, env=env, cwd=root,
                       stdout=subprocess.DEVNULL)
        rows[world] = torch.load(out)["memory"]
    mib = 2 ** 20
    print(f"hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}; policy and reference, float32, AdamW")
    print(f"{'':<16}{'params MiB':>12}{'grads MiB':>11}{'AdamW MiB':>11}{'sum MiB':>10}{'peak RSS MiB':>14}")
    for world, mems in rows.items():
        for rank, m in enumerate(mems):
            s = m["params"] + m["grads"] + m["optimizer"]
            print(f"{f'{world} rank(s), #{rank}':<16}{m['params'] / mib:>12.1f}{m['grads'] / mib:>11.1f}"
                  f"{m['optimizer'] / mib:>11.1f}{s / mib:>10.1f}{m['peak_rss'] / mib:>14.0f}")


if __name__ == "__main__":
    main()
