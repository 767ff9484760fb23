"""Peak memory of an RL run with the full model trained (two copies: policy and pi_ref) against model.lora.r
(one copy: pi_ref is the base with the adapter off), on a random Llama-architecture folder.

    python scripts/bench_lora_memory.py [--hidden 512 --layers 8 --vocab 32000 --steps 2]

Each configuration runs in a fresh process (`klbench ... logger=none`), and the process's peak resident set
(ru_maxrss) is read; the printed ratio is LoRA / full. Memory, not time: the figure does not depend on load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, resource, sys
from klbench.config.compose import compose
from klbench.tasks.train import run_task
out = run_task(compose(sys.argv[2:], outputs=sys.argv[1] + "/outputs", run_dir=sys.argv[1] + "/run"))
print("RESULT " + json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "seq_kl": out["val/seq_kl"]}))
"""


def build(path: str, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = [f"w{i}" for i in range(vocab - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rank", type=int, default=8)
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-lora-")
    model = os.path.join(root, "model")
    build(model, a.hidden, a.layers, a.vocab)
    common = ["model=hf", f"model.name_or_path={model}", "reward=none", "task.reward_coef=0", "logger=none",
              f"task.max_steps={a.steps}", f"task.val_every={a.steps}", "task.prompts_per_step=8", "task.n_samples=4",
              "task.max_new_tokens=32", "task.val_prompts=8", "estimator=rb", "dataset=embedded"]
    results = {}
    for name, extra in (("full", []), (f"lora r={a.rank}", [f"model.lora.r={a.rank}"])):
        work = tempfile.mkdtemp(dir=root)
        p = subprocess.run([sys.executable, "-c", CHILD, work, *common, *extra], capture_output=True, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not line:
            sys.exit(f"{name}: failed\n{p.stderr[-3000:]}")
        results[name] = json.loads(line[0][7:])
        print(f"{name:>10}: peak {results[name]['peak_mib']:8.0f} MiB  (val/seq_kl {results[name]['seq_kl']:.4g})")
    full, lora = results["full"]["peak_mib"], results[f"lora r={a.rank}"]["peak_mib"]
    print(f"Llama hidden={a.hidden} layers={a.layers} vocab={a.vocab}: lora/full peak memory {lora / full:.2f}x "
          f"({full - lora:.0f} MiB saved)")


if __name__ == "__main__":
    main()
