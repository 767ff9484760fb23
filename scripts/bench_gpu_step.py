"""One RL step of a Qwen2-0.5B-shaped random model in bf16 on a GPU, klbench against TRL's GRPOTrainer (issue 31,
item 5): the step split into rollout, scoring, backward and optimizer, with the peak memory of each.

    python scripts/bench_gpu_step.py [--estimators loo,rb] [--warmup 1 --steps 2] [--micro 64] [--json out.json]
    python scripts/bench_gpu_step.py --tiny     # V = 4,096, 2 layers, 4 prompts x 2 x 16 tokens, CPU: both sides run

The job, the same on both sides: a random Qwen2 of Qwen2-0.5B's shape (V = 151,936, hidden 896, 24 layers, 14 query
and 2 KV heads, MLP 4,864, tied embeddings) saved in bf16, with a tokenizer that has an entry for every id (decoding
any sampled id is safe); logits of std 4 (about 5 nats of entropy) and an EOS that is never sampled, so every
response is full length. Weights in float32 under bf16 autocast (klbench's hardware=bf16; TRL's bf16=True with its
default float32 weights); `--weights bfloat16` loads bf16 weights on both sides. 64 prompts x 8 samples x 256 new
tokens at temperature 1; GRPO's advantage (eps 1e-4) and DAPO's token-mean loss (TRL's defaults); beta 0.05; AdamW
lr 1e-5, clipped at norm 1; no logger, gradient checkpointing or vLLM; the reward is the share of even ids in the
response (computed on ids: free on both sides). 512 sequences do not fit one backward (~200 GB of activations), so
both sides take --micro (64) at a time: klbench's task.micro_batch_size (each micro-batch scored from hidden states
and backpropagated at once, one policy forward per sequence: klbench/tasks/step.py), TRL's
per_device_train_batch_size with gradient accumulation (it still generates the 512 at once).
Phases, between torch.cuda.synchronize() calls, with the peak torch.cuda.max_memory_allocated within each. klbench:
rollout = LMPolicy.rollout; scoring = the rest of RLTask.training_step (the reference pass, the policy's forward,
reward, estimator, loss) less its backward passes; backward = those passes, one per micro-batch (and `carrier`,
the returned loss's backward, which only hands their sum to .grad); optimizer = clip, AdamW, zero_grad; the policy's
forwards per sequence per step are printed. TRL, from its own profiling timers: rollout = its generate();
scoring = _prepare_inputs less generate (the reference's log-probs, rewards) plus compute_loss (the policy's forward,
the loss); backward = accelerator.backward; optimizer = clip and step. step: the whole step (TRL: on_step_begin to
on_step_end). Each side runs in a process of its own; figures are medians of --steps steps after --warmup.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA, LR, SEED = 0.05, 1e-5, 0
QWEN2_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, prompts=64, samples=8, tokens=256, micro=64)
TINY = dict(vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, prompts=4, samples=2, tokens=16, micro=4)  # V small: CPU bf16 is slow
PHASES = ("rollout", "scoring", "backward", "optimizer", "step")


def prompts(n: int) -> list[str]:
    return [f"prompt {i}: the film was" for i in range(n)]


class Phases:
    """Seconds and peak CUDA memory of named phases, step by step. Phases nest (a step holds its parts): the peak
    since the last reset belongs to every phase open at that moment."""

    def __init__(self, cuda: bool):
        self.cuda, self.open, self.steps = cuda, {}, []

    def _fold(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for rec in self.open.values():
                rec[1] = max(rec[1], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def begin(self, name: str) -> None:
        self._fold()
        self.open[name] = [time.perf_counter(), 0]

    def end(self, name: str) -> None:
        self._fold()
        t0, peak = self.open.pop(name)
        rec = self.steps[-1].setdefault(name, [0.0, 0])  # run several times in a step (micro-batches): summed
        rec[0], rec[1] = rec[0] + time.perf_counter() - t0, max(rec[1], peak)

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.begin(name)
        yield
        self.end(name)

    def summary(self, warmup: int) -> dict:
        """{phase: {"s": median seconds, "peak_gib": max peak}} over the steps after the warm-up."""
        timed = self.steps[warmup:]
        return {n: {"s": statistics.median(s.get(n, [0.0])[0] for s in timed),
                    "peak_gib": max(s.get(n, [0, 0])[1] for s in timed) / 2 ** 30 if self.cuda else None}
                for n in dict.fromkeys(n for s in timed for n in s)}


def device_info(cuda: bool) -> dict:
    import transformers
    return {"device": torch.cuda.get_device_name(0) if cuda else "CPU", "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__}


def even_share(resp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] the share of even ids among a response's tokens, from [B, L] ids and mask: the job's cheap reward."""
    return ((resp % 2 == 0) & mask).sum(1) / mask.sum(1).clamp(min=1)


def build(path: str, shape: dict, cuda: bool) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench_large_vocab import filler_tokenizer  # scripts/ is on sys.path: this script's own folder
    fast = filler_tokenizer(shape["vocab_size"])
    body = {k: shape[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads")}
    # Qwen2's init std 0.02 at hidden 896, wider for a narrower body: there the tied input embedding would
    # outweigh what the random layers add, and each token's top next token would be itself (a constant response)
    cfg = Qwen2Config(**body, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                      initializer_range=0.02 * (896 / shape["hidden_size"]) ** 0.5, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    torch.manual_seed(SEED)
    with torch.device("cuda" if cuda else "cpu"):  # initialised where it is fast
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        # the logits h . e_i have std 0.02 sqrt(hidden) at init, near uniform over V: the final norm scales them to
        # std 4 (about 5 nats of entropy at V = 151,936), so that samples and rewards differ within a group
        model.model.norm.weight.fill_(4.0 / (cfg.initializer_range * cfg.hidden_size ** 0.5))
        # tied, so EOS's logit is 0: p(EOS) ~ 1 / (V e^8) = 2e-9 a token at V = 151,936, and responses run full length
        model.model.embed_tokens.weight[cfg.eos_token_id].zero_()
    model.to(torch.bfloat16).save_pretrained(path)
    fast.save_pretrained(path)


def klbench_side(a, shape: dict, cuda: bool) -> dict:
    from klbench.config.compose import compose
    from klbench.models.policies import build_policy
    from klbench.tasks import build_task
    dev = torch.device("cuda" if cuda else "cpu")
    est = a.side.split(":")[1]
    over = ["model=hf", f"model.name_or_path={a.model}", f"model.dtype={a.weights}", f"estimator={est}",
            f"estimator.beta={BETA}", "reward=none", f"task.max_new_tokens={shape['tokens']}",
            f"task.prompts_per_step={shape['prompts']}", f"task.n_samples={shape['samples']}", "task.advantage=grpo",
            "task.adv_eps=1e-4", "task.loss_agg=token_mean", f"task.lr={LR}", "task.weight_decay=0.0",
            "task.grad_clip=1.0", f"seed={SEED}"]
    if a.micro < shape["prompts"] * shape["samples"]:
        over.append(f"task.micro_batch_size={a.micro}")
    cfg = compose(over, outputs=tempfile.mkdtemp(prefix="klbench-", dir="."))  # in the work folder
    policy = build_policy(cfg.model, cfg.task.max_new_tokens)
    task = build_task(cfg, policy, lambda ro: even_share(ro.tokens[:, ro.prompt_len:], ro.mask))
    task.to(dev)
    task.metrics_read = False  # as logger=none: the train/ metrics are not computed
    opt = task.configure_optimizers()  # AdamW, as a run's
    params = policy.trainable()
    texts, ph, out = prompts(shape["prompts"]), Phases(cuda), {}
    torch.manual_seed(SEED)
    backward = torch.Tensor.backward

    def timed_backward(t, *args, **kwargs):  # each micro-batch's backward inside training_step (tasks/step.py)
        with ph("backward"):
            return backward(t, *args, **kwargs)
    rows = policy.rows_forwarded
    for step in range(a.warmup + a.steps):
        ph.steps.append({})
        with ph("step"):
            # autocast as precision=bf16-mixed runs training_step (the rollout is inside it in a run); backward not
            with ph("rollout"), torch.autocast(dev.type, dtype=torch.bfloat16):
                ro = policy.rollout(texts, shape["samples"])  # tokens [B, P + L], mask [B, L]
            policy.rollout = lambda p, n: ro  # training_step's own rollout call returns this one
            torch.Tensor.backward = timed_backward
            try:
                # both models' forward, reward, advantage, estimator, loss, and each micro-batch's backward
                with ph("training_step"), torch.autocast(dev.type, dtype=torch.bfloat16):
                    loss = task.training_step(texts, step)
            finally:
                torch.Tensor.backward = backward
            del policy.rollout
            with ph("carrier"):  # what Lightning's backward then does: the parts' summed gradient into .grad
                loss.backward()
            with ph("optimizer"):
                torch.nn.utils.clip_grad_norm_(params, cfg.task.grad_clip)  # Lightning's gradient_clip_val
                opt.step()
                opt.zero_grad(set_to_none=True)
        rec = ph.steps[-1]  # scoring: training_step less the backward passes it ran
        rec["scoring"] = [rec["training_step"][0] - rec.get("backward", [0.0])[0], rec["training_step"][1]]
        out["forwards_per_sequence"] = (policy.rows_forwarded - rows) / len(ro.texts)
        rows = policy.rows_forwarded
        out |= {"response_len": float(ro.mask.sum(1).float().mean()), "loss": float(loss.detach()),
                "reward": float(task.rewards(ro).mean())}
        print(f"klbench {est} step {step}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in ph.steps[-1].items()),
              flush=True)
    return {"phases": ph.summary(a.warmup), **out, "estimator": est, "klbench_overrides": over,
            **device_info(cuda)}


def trl_side(a, shape: dict, cuda: bool) -> dict:
    import shutil
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling
    from trl.kernels import chunked_logprob
    triton = chunked_logprob._TRITON_AVAILABLE and bool(shutil.which("cc") or shutil.which("gcc"))
    chunked_logprob._TRITON_AVAILABLE = triton  # TRL's fused LM head in Triton, which needs a C compiler to build
    ph = Phases(cuda)
    # TRL's own timers (generate, _prepare_inputs, compute_loss, ...), synchronised and kept here
    profiling.ProfilingContext.__enter__ = lambda self: ph.begin(self.name.split(".", 1)[1]) or self
    profiling.ProfilingContext.__exit__ = lambda self, *exc: ph.end(self.name.split(".", 1)[1])

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            ph.steps.append({})
            ph.begin("step")

        def on_optimizer_step(self, *args, **kwargs):
            ph.end("optimizer")  # begun in _clip_grad_norm, below

        def on_step_end(self, *args, **kwargs):
            ph.end("step")

    def even_share_ids(completion_ids, **_):  # klbench's reward, on TRL's lists of ids (131k ids: ~10 ms)
        return [sum(i % 2 == 0 for i in c) / max(len(c), 1) for c in completion_ids]

    B = shape["prompts"] * shape["samples"]
    micro = min(a.micro, B)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-", dir="."), seed=SEED, max_steps=a.warmup + a.steps, report_to="none",
        logging_steps=1, save_strategy="no", disable_tqdm=True, use_cpu=not cuda, bf16=True, fp16=False,
        model_init_kwargs={"dtype": a.weights}, gradient_checkpointing=False, disable_dropout=True, use_vllm=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=B // micro, num_generations=shape["samples"],
        max_completion_length=shape["tokens"], temperature=1.0, top_k=0, top_p=1.0, beta=BETA, num_iterations=1,
        loss_type="dapo", scale_rewards="group", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=a.model, reward_funcs=even_share_ids, args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts(shape["prompts"])]),
                          processing_class=AutoTokenizer.from_pretrained(a.model), callbacks=[StepTimer()])
    clip, backward = trainer._clip_grad_norm, trainer.accelerator.backward

    def timed_clip(model):  # the optimizer phase: clipping, then the step (on_optimizer_step ends it)
        ph.begin("optimizer")
        return clip(model)

    def timed_backward(loss, **kwargs):
        with ph("backward"):
            backward(loss, **kwargs)

    trainer._clip_grad_norm, trainer.accelerator.backward = timed_clip, timed_backward
    trainer.train()
    raw = ph.summary(a.warmup)
    s = {n: r["s"] for n, r in raw.items()}
    logp = ("_get_per_token_logps_and_entropies", "compute_loss")  # the reference's forward, the policy's and loss
    scoring = {"s": s["_prepare_inputs"] - s["transformers.generate"] + s["compute_loss"],
               "peak_gib": max(raw[n]["peak_gib"] for n in logp) if cuda else None}
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"phases": {"rollout": raw["transformers.generate"], "scoring": scoring, "backward": raw["backward"],
                       "optimizer": raw["optimizer"], "step": raw["step"]},
            "trl_timers": raw, "reward": logs[-1]["reward"], "response_len": logs[-1]["completions/mean_length"],
            "trl_step_time": [h.get("step_time") for h in logs], "trl": trl.__version__, "trl_triton": triton,
            **device_info(cuda)}


def table(results: dict) -> str:
    """Seconds (peak GiB) of each phase of each side, and each klbench side's time over TRL's."""
    sides, trl = list(results), results.get("trl")
    over = [s for s in sides if trl and s != "trl"]
    lines = [f"{'phase':<10}" + "".join(f"{s:>24}" for s in sides) + "".join(f"{s + '/trl':>18}" for s in over)]
    for p in PHASES:
        cell = {s: results[s]["phases"][p] for s in sides}
        text = {s: f"{c['s']:.3f} s" + ("" if c["peak_gib"] is None else f", {c['peak_gib']:.2f} GiB")
                for s, c in cell.items()}
        lines.append(f"{p:<10}" + "".join(f"{text[s]:>24}" for s in sides)
                     + "".join(f"{cell[s]['s'] / max(cell['trl']['s'], 1e-9):>17.2f}x" for s in over))
    return "\n".join(lines)


def run_child(side: str, a, env: dict, cwd: str) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model", a.model, "--weights", a.weights,
           "--warmup", str(a.warmup), "--steps", str(a.steps), "--micro", str(a.micro)] + (["--tiny"] if a.tiny else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    result = None
    for line in proc.stdout:  # streamed: a long or stuck side shows where it is
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
        else:
            print(f"  [{side}] {line}", end="", flush=True)
    if proc.wait() or result is None:
        print(f"{side}: FAILED (exit {proc.returncode})", flush=True)
        return None
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="V = 4,096, 2 layers, 4 prompts x 2 x 16 tokens, on CPU")
    p.add_argument("--estimators", default="loo,rb", help="klbench's sides (default loo,rb)")
    p.add_argument("--no-trl", action="store_true", help="klbench's sides only")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up (default 2)")
    p.add_argument("--micro", type=int, help="sequences per forward/backward (default 64; --tiny 4)")
    p.add_argument("--weights", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="write the results here (rewritten after each side)")
    p.add_argument("--side", help=argparse.SUPPRESS)  # a child: build, klbench:<estimator> or trl
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args()
    shape = TINY if a.tiny else QWEN2_05B
    a.micro = a.micro or shape["micro"]
    cuda = not a.tiny
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_gpu_step: no CUDA device visible (--tiny runs on CPU)")
    if a.side:  # a child process
        if a.side == "build":
            r = build(a.model, shape, cuda) or {}
        else:
            r = trl_side(a, shape, cuda) if a.side == "trl" else klbench_side(a, shape, cuda)
        print("RESULT " + json.dumps(r), flush=True)
        return
    work = tempfile.mkdtemp(prefix="bench-gpu-step-")
    a.model = os.path.join(work, "model")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        x for x in (REPO, os.environ.get("PYTHONPATH")) if x)}  # klbench from this checkout, installed or not
    commit = subprocess.run(["git", "-C", REPO, "describe", "--always", "--dirty"], capture_output=True, text=True)
    job = {k: shape[k] for k in ("prompts", "samples", "tokens")} | {"micro": a.micro, "weights": a.weights,
                                                                    "commit": commit.stdout.strip()}
    print(f"job: {job}", flush=True)
    t0 = time.perf_counter()
    if run_child("build", a, env, work) is None:
        sys.exit("bench_gpu_step: building the model failed")
    print(f"model built in {time.perf_counter() - t0:.0f} s: {a.model}", flush=True)
    ests = [e for e in a.estimators.split(",") if e]
    order = [f"klbench:{e}" for e in ests[:1]] + ([] if a.no_trl else ["trl"]) + [f"klbench:{e}" for e in ests[1:]]
    results = {}
    for side in order:  # the first estimator, TRL, then the rest: what matters most first
        r = run_child(side, a, env, work)
        if r is None:
            continue
        results[side.replace(":", "-")] = r
        print(json.dumps({"side": side, **r}), flush=True)  # one JSON line per side
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"job": job, "results": results}, f, indent=1)
    if results:
        first = next(iter(results.values()))
        print(f"\n{first['device']}, torch {first['torch']} (CUDA {first['cuda']}), transformers "
              f"{first['transformers']}, trl {results.get('trl', {}).get('trl', '-')}; klbench {job['commit']}")
        print(f"{job['prompts']} prompts x {job['samples']} samples x {job['tokens']} tokens, micro-batch {a.micro}, "
              f"{a.weights} weights under bf16 autocast; median of {a.steps} steps after {a.warmup} warm-up\n")
        print(table(results))


if __name__ == "__main__":
    main()
