"""klbench against TRL's RLOOTrainer on the same RL job, whole process, in alternating pairs (docs/running.md, "Speed").

    python scripts/bench_trl_peer.py [--pairs 3] [--steps 50] [--work outputs/.bench] [--trl-python PATH]
    python scripts/bench_trl_peer.py --pairs 1 --steps 5          # a quick check that both sides run
    python scripts/bench_trl_peer.py --floor                      # and klbench's floor and bare job beside each pair
    python scripts/bench_trl_peer.py --arch llama                 # the same job on a RoPE/RMSNorm/GQA model

The job (issue 22), the same on both sides:
- a tiny GPT-2 (2 layers, 4 heads, 128 wide, byte-level BPE vocabulary 2,000), built offline once with klbench's
  embedded pipeline (klbench/models/embedded: the BPE trained on generated reviews and VADER's lexicon,
  `--pretrain-steps` of next-token pretraining on reviews, save_pretrained); both sides load that folder;
  `--arch llama`: a Llama of the same size instead (RoPE, RMSNorm, SwiGLU MLP 512 wide, 4 query and 2 KV heads,
  tied embeddings), the same tokenizer and pretraining; klbench scores it through transformers' forward;
- 64 review openings (klbench's embedded train prompts) in a jsonl file; VADER compound score of the response;
  klbench validates on its embedded held-out prompts (another jsonl file), which TRL does not use;
- 8 prompts x 4 samples x 32 new tokens per step, temperature 1, no top-k/top-p; fp32, CPU;
- beta 0.05 with k1 in the reward and the leave-one-out baseline: TRL's RLOO puts the summed log-ratio in the
  reward, klbench runs estimator=loo; AdamW lr 1e-4, constant, no weight decay, gradient norm clipped at 1;
  `--steps` steps; no logger (klbench logger=none, TRL report_to=none).
Where the two differ by design: TRL turns gradient checkpointing on by default and klbench never does, so it is
turned off here (TRL only gets faster); klbench validates at step 0 and at the last step (32 held-out prompts x 2
fresh samples each time), TRL does not evaluate: that is klbench's own work, counted in its time.

Each pair runs both, in alternating order (klbench first in odd pairs); each side is timed as a whole process
(start to exit), its peak RSS read from the kernel (os.wait4). Printed: the machine, the load average around each
pair, the median wall-time ratio klbench/TRL, the peak RSS of each and the reward at the last step: klbench's
val/reward (its summary table), TRL's logged batch reward (the last step's and the mean of the last ten).

TRL runs in its own venv, made once under --work (trl-venv: torch 2.13.0, then trl 1.16.0 and vaderSentiment from
the package index). If that cannot be made here (no index), the script stops and says so: make the venv elsewhere
and pass its python with --trl-python. The same file is the TRL job (`_trl-job`, run by that venv's python): it
imports klbench nowhere on that path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
# the tiny GPT-2 of the job, as a klbench embedded spec (klbench/models/embedded/spec.py)
MODEL_SPEC = {"name": "peer-gpt2", "vocab_size": 2000, "n_embd": 128, "n_layer": 2, "n_head": 4}
N_PROMPTS, PROMPTS_PER_STEP, SAMPLES, NEW_TOKENS, BETA, LR = 64, 8, 4, 32, 0.05, 1e-4


# ---- the TRL side (runs under the TRL venv's python: no klbench import on this path) ----

def trl_job(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench_trl_peer.py _trl-job")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    a = p.parse_args(argv)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def vader(completions, **_):
        return [analyzer.polarity_scores(c)["compound"] for c in completions]

    with open(a.prompts) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    args = RLOOConfig(
        output_dir=a.out, seed=a.seed, max_steps=a.steps, report_to="none", logging_steps=1, save_strategy="no",
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, max_completion_length=NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0,
        beta=BETA, num_iterations=1, normalize_advantages=False, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, disable_dropout=True, dataloader_num_workers=0)
    trainer = RLOOTrainer(model=a.model, reward_funcs=vader, args=args,
                          train_dataset=Dataset.from_list([{"prompt": q} for q in prompts]),
                          processing_class=AutoTokenizer.from_pretrained(a.model))
    trainer.train()
    rewards = {int(h["step"]): h["reward"] for h in trainer.state.log_history if "reward" in h}
    with open(os.path.join(a.out, "rewards.json"), "w") as f:
        json.dump({"reward_by_step": rewards}, f)


# ---- the bench (runs under klbench's venv) ----

def ensure_trl_python(work: Path, given: str | None) -> Path:
    """--trl-python if given (checked), else <work>/trl-venv/bin/python, made on first use."""
    check = f"import trl, vaderSentiment, torch; assert trl.__version__ == '{TRL_VERSION}', trl.__version__"
    if given:
        py = Path(os.path.abspath(given))  # not resolve(): a venv's python is a link out of the venv
        r = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"bench_trl_peer: --trl-python {py} cannot import trl {TRL_VERSION} and vaderSentiment: "
                     f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return py
    venv = work / "trl-venv"
    py = venv / "bin" / "python"
    if (venv / ".ready").is_file():
        return py
    shutil.rmtree(venv, ignore_errors=True)  # a venv whose making was interrupted
    print(f"bench_trl_peer: making the TRL venv once, in {venv} (torch {TORCH_VERSION}, trl {TRL_VERSION})", flush=True)
    for cmd in ([sys.executable, "-m", "venv", str(venv)],
                [str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],  # first: trl must not pick another
                [str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "vaderSentiment"],
                [str(py), "-c", check]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-3:]
            sys.exit(f"bench_trl_peer: could not make the TRL venv ({' '.join(cmd[2:5])} failed: {' | '.join(tail)}). "
                     "Make a venv with torch, trl==1.16.0 and vaderSentiment where the package index is reachable "
                     "and pass its python with --trl-python PATH")
    (venv / ".ready").touch()
    return py


def lexicon_words() -> list[str]:
    """VADER's lexicon entries: the review corpus alone saturates byte-level BPE at about 1,360 tokens (every
    word it has becomes one token), so the tokenizer also learns from the lexicon the reward reads."""
    import vaderSentiment

    with open(Path(vaderSentiment.__file__).with_name("vader_lexicon.txt"), encoding="utf-8") as f:
        return [line.split("\t", 1)[0] for line in f if line.strip()]


def llama_like(spec: dict, tok):
    """A fresh Llama of MODEL_SPEC's size: GQA (2 KV heads), RoPE, RMSNorm, SwiGLU, tied embeddings as GPT-2's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec["vocab_size"], hidden_size=spec["n_embd"], intermediate_size=4 * spec["n_embd"],
                         num_hidden_layers=spec["n_layer"], num_attention_heads=spec["n_head"], num_key_value_heads=2,
                         max_position_embeddings=spec["n_positions"], tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        return LlamaForCausalLM(config)


def build_model(work: Path, pretrain_steps: int, arch: str) -> str:
    """The job's tiny GPT-2 (or Llama) as a save_pretrained folder under <work>, built once: a 2,000-token BPE on
    klbench's tokenizer corpus plus VADER's lexicon, then klbench's embedded pretraining on generated reviews."""
    from klbench.models.embedded.build import train_tokenizer
    from klbench.models.embedded.cache import build_cached
    from klbench.models.embedded.corpus import generate_reviews
    from klbench.models.embedded.spec import DEFAULT_TOKENIZER_SPEC, complete_spec, spec_hash

    spec = complete_spec({**MODEL_SPEC, "steps": pretrain_steps})
    final = work / f"model-{spec['name']}-{spec_hash(spec)}" if arch == "gpt2" else \
        work / f"model-peer-{arch}-{spec_hash(spec)}"

    def build(tmp: str) -> None:
        from klbench.models.embedded.pretrain import pretrain  # Lightning: only when a build runs

        ts = DEFAULT_TOKENIZER_SPEC
        reviews = generate_reviews(ts["corpus_size"], seed=ts["corpus_seed"], positive_fraction=ts["positive_fraction"])
        tok = train_tokenizer(reviews + lexicon_words(), spec["vocab_size"])
        if len(tok) != spec["vocab_size"]:
            raise ValueError(f"the BPE reached {len(tok)} tokens, not {spec['vocab_size']}: too little text")
        metrics = pretrain(spec, tmp, progress=False, tokenizer=tok,
                           model=llama_like(spec, tok) if arch == "llama" else None)
        (Path(tmp) / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2))

    if build_cached(str(final), build, what=f"the peer benchmark's {arch} ({pretrain_steps} pretraining steps)"):
        # a child's peak RSS (ru_maxrss) starts from this process's at fork, which the build just raised:
        # start afresh, with the model in place, so that each side's figure is its own
        os.execv(sys.executable, [sys.executable, *sys.argv])
    return str(final)


def write_prompts(work: Path) -> tuple[Path, Path]:
    """The job's prompts, and the held-out ones klbench validates on (klbench's embedded train and val splits)."""
    from klbench.models.embedded import embedded_prompts

    train = embedded_prompts("train")
    if len(train) < N_PROMPTS:
        sys.exit(f"bench_trl_peer: klbench has {len(train)} embedded train prompts, the job needs {N_PROMPTS}")
    files = work / "prompts.jsonl", work / "val_prompts.jsonl"
    for path, prompts in zip(files, (train[:N_PROMPTS], embedded_prompts("val"))):
        path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in prompts))
    return files


def timed(cmd: list[str], log: Path, env: dict) -> tuple[float, float, str]:
    """(wall s, peak RSS MiB, stdout) of one whole process; stops the bench if it fails."""
    with open(log, "w") as f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = log.read_text()
    if proc.returncode:
        sys.exit(f"bench_trl_peer: {' '.join(cmd[:3])} ... failed (exit {proc.returncode}); its output, {log}, ends:\n"
                 + "\n".join(out.splitlines()[-25:]))
    return wall, usage.ru_maxrss / 1024, out  # ru_maxrss: KiB on Linux


def run_klbench(model: str, prompts: tuple[Path, Path], steps: int, seed: int, work: Path, tag: str) -> dict:
    klbench = Path(sys.executable).with_name("klbench")
    cmd = [str(klbench), "model=hf", f"model.name_or_path={model}", "dataset=jsonl",
           f"dataset.train_path={prompts[0]}", f"dataset.val_path={prompts[1]}", "reward=vader",
           "estimator=loo", f"estimator.beta={BETA}", "kl_ctl=fixed", "hardware=cpu", "logger=none",
           f"task.prompts_per_step={PROMPTS_PER_STEP}", f"task.n_samples={SAMPLES}",
           f"task.max_new_tokens={NEW_TOKENS}", f"task.lr={LR}", "task.weight_decay=0.0", "task.grad_clip=1.0",
           f"task.max_steps={steps}", f"task.val_every={steps}", f"seed={seed}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KLBENCH_OUTPUTS": str(work / "klbench-outputs")}
    wall, rss, out = timed(cmd, work / f"{tag}.log", env)
    m = re.search(r"^val/reward\s+(\S+)\s+(\S+)", out, re.M)
    if not m:
        sys.exit(f"bench_trl_peer: no val/reward row in klbench's summary ({work / f'{tag}.log'})")
    return {"wall": wall, "rss": rss, "reward_before": float(m[1]), "reward_end": float(m[2])}


def run_floor(model: str, steps: int, work: Path, tag: str) -> tuple[float, float]:
    """The floor of klbench's side and the bare job (scripts/bench_rollout.py --floor-only), run now, beside the
    pair: (floor s, bare job s)."""
    cmd = [sys.executable, str(Path(__file__).with_name("bench_rollout.py")), "--floor-only", "--model", model,
           "--steps", str(steps)]
    _, _, out = timed(cmd, work / f"{tag}.log", {**os.environ, "HF_HUB_OFFLINE": "1"})
    found = [re.search(rf"^{key}_seconds (\S+)", out, re.M) for key in ("floor", "bare")]
    if not all(found):
        sys.exit(f"bench_trl_peer: no floor_seconds or bare_seconds line in {work / f'{tag}.log'}")
    return float(found[0][1]), float(found[1][1])


def run_trl(py: Path, model: str, prompts: Path, steps: int, seed: int, work: Path, tag: str) -> dict:
    out_dir = work / tag
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [str(py), str(Path(__file__).resolve()), "_trl-job", "--model", model, "--prompts", str(prompts),
           "--out", str(out_dir), "--steps", str(steps), "--seed", str(seed)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    wall, rss, _ = timed(cmd, work / f"{tag}.log", env)
    by_step = {int(k): v for k, v in json.loads((out_dir / "rewards.json").read_text())["reward_by_step"].items()}
    last = sorted(by_step)[-10:]
    return {"wall": wall, "rss": rss, "reward_first": by_step[min(by_step)], "reward_end": by_step[max(by_step)],
            "reward_last10": statistics.fmean(by_step[s] for s in last)}


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical cores, python {sys.version.split()[0]}"


def load() -> str:
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main() -> None:
    if sys.argv[1:2] == ["_trl-job"]:
        return trl_job(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="alternating (klbench, TRL) pairs (default 3)")
    p.add_argument("--steps", type=int, default=50, help="optimisation steps per run (default 50)")
    p.add_argument("--work", default="outputs/.bench", help="the TRL venv, the prompts, the runs' logs")
    p.add_argument("--trl-python", help="a python with trl==1.16.0 and vaderSentiment (default: make one)")
    p.add_argument("--floor", action="store_true",
                   help="after each pair, the floor of klbench's side too (scripts/bench_rollout.py --floor-only)")
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="the job's model: GPT-2 (default) or a Llama of the same size (RoPE, RMSNorm, GQA)")
    p.add_argument("--pretrain-steps", type=int, default=800,
                   help="next-token pretraining of the tiny GPT-2 before RL (klbench's embedded default: 800)")
    a = p.parse_args()
    if a.pairs < 1 or a.steps < 1:
        sys.exit("bench_trl_peer: --pairs and --steps must be >= 1")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_HUB_OFFLINE"] = "1"
    py = ensure_trl_python(work, a.trl_python)
    model, prompts = build_model(work, a.pretrain_steps, a.arch), write_prompts(work)
    print(f"machine: {machine()}\nmodel: {model}\nprompts: {prompts[0]} ({N_PROMPTS}; klbench validates on "
          f"{prompts[1].name})\n"
          f"job: {a.arch}, {PROMPTS_PER_STEP} prompts x {SAMPLES} samples x {NEW_TOKENS} tokens, {a.steps} steps, "
          "fp32, CPU",
          flush=True)
    load_start, rows, floors = load(), [], []
    for i in range(1, a.pairs + 1):
        before = load()
        sides = {}
        for side in (("klbench", "trl") if i % 2 else ("trl", "klbench")):
            tag = f"pair{i}-{side}"
            sides[side] = (run_klbench(model, prompts, a.steps, i, work, tag) if side == "klbench" else
                           run_trl(py, model, prompts[0], a.steps, i, work, tag))
        k, t = sides["klbench"], sides["trl"]
        rows.append((k, t))
        floor = ""
        if a.floor:
            floors.append(run_floor(model, a.steps, work, f"pair{i}-floor"))
            (f, bare), kw = floors[-1], k["wall"]
            floor = (f"; klbench's floor {f:.1f} s (floor/TRL {f / t['wall']:.2f}, klbench/floor {kw / f:.2f}), "
                     f"the bare job {bare:.1f} s (bare/floor {bare / f:.2f}, bare/TRL {bare / t['wall']:.2f}, "
                     f"klbench/bare {kw / bare:.2f})")
        print(f"pair {i}: klbench {k['wall']:.1f} s ({k['rss']:.0f} MiB), TRL {t['wall']:.1f} s ({t['rss']:.0f} MiB), "
              f"klbench/TRL {k['wall'] / t['wall']:.2f}{floor}; reward at step {a.steps}: klbench "
              f"{k['reward_end']:+.3f}, TRL {t['reward_end']:+.3f}; load average {before} -> {load()}", flush=True)
    ratios = [k["wall"] / t["wall"] for k, t in rows]
    mean = statistics.fmean
    print(f"\nmedian wall-time ratio klbench/TRL: {statistics.median(ratios):.2f} "
          f"(pairs: {', '.join(f'{r:.2f}' for r in ratios)})")
    if floors:
        def medians(name: str, ratios: list[float], what: str) -> None:
            print(f"median {name}: {statistics.median(ratios):.2f} (pairs: {', '.join(f'{r:.2f}' for r in ratios)})"
                  f"{what}")

        medians("floor/TRL", [f / t["wall"] for (f, _), (_, t) in zip(floors, rows)],
                ": klbench's side with no Python but the reward's and no validation (scripts/bench_rollout.py)")
        medians("klbench/floor", [k["wall"] / f for (f, _), (k, _) in zip(floors, rows)], "")
        medians("bare/floor", [b / f for (f, b), _ in zip(floors, rows)],
                ": the same job as a plain script, its validations included, no framework")
        medians("bare/TRL", [b / t["wall"] for (_, b), (_, t) in zip(floors, rows)], "")
        medians("klbench/bare", [k["wall"] / b for (_, b), (k, _) in zip(floors, rows)],
                ": what Hydra, Lightning, klbench's config and its summary add")
    print(f"median wall: klbench {statistics.median(k['wall'] for k, _ in rows):.1f} s, "
          f"TRL {statistics.median(t['wall'] for _, t in rows):.1f} s")
    print(f"peak RSS (max over pairs): klbench {max(k['rss'] for k, _ in rows):.0f} MiB, "
          f"TRL {max(t['rss'] for _, t in rows):.0f} MiB")
    print(f"reward, mean over pairs: klbench val/reward (32 held-out prompts x 2 fresh samples) "
          f"{mean(k['reward_before'] for k, _ in rows):+.3f} at step 0 -> "
          f"{mean(k['reward_end'] for k, _ in rows):+.3f} "
          f"at step {a.steps}; TRL batch reward (8 prompts x 4) {mean(t['reward_first'] for _, t in rows):+.3f} "
          f"at step 1 -> {mean(t['reward_end'] for _, t in rows):+.3f} at step {a.steps} "
          f"(mean of its last {min(10, a.steps)} steps {mean(t['reward_last10'] for _, t in rows):+.3f})")
    print(f"load average (1, 5, 15 min): {load_start} at the start, {load()} at the end; logs in {work}")


if __name__ == "__main__":
    main()
