"""hardware=fsdp (klbench/tasks/sharding.py, klbench/models/fsdp.py): FSDP2 on real CPU ranks (gloo) on tiny
Llama-architecture folders. 2 ranks give one process's loss and gradients on the same global batch; a rollout
through the sharded policy draws the unsharded policy's tokens; each rank holds half the bytes; a 2-rank run
trains through the CLI and resumes exactly; bad input is one line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from klbench.config.schema import ConfigError, validate
from ranks_cli import final_metrics, rank_args, rank_env
from test_config import compose_cfg

WORKER = Path(__file__).with_name("fsdp_worker.py")
COMMON = ["task.prompts_per_step=4", "task.n_samples=3", "task.max_new_tokens=8"]
# (name, overrides after model=hf model.name_or_path=<policy>; {teacher} is the second folder)
CASES = {
    "rb": ["model.ref_name_or_path={teacher}", "estimator=rb", "estimator.beta=0.5", "task.micro_batch_size=5"],
    "loo": ["model.ref_name_or_path={teacher}", "estimator=loo", "estimator.beta=0.5"],
    "distill_vopd": ["task=distill", "reward=none", "estimator=vopd", "estimator.beta=1.0", "model@teacher=hf",
                     "teacher.name_or_path={teacher}"],
    "lora_rb": ["model.lora.r=4", "estimator=rb", "estimator.beta=0.5"],  # the reference is the policy's base
    # a truncating sampler scores through the [B, T, V] logits: the models' own forwards, no head read outside
    "logits_path_rb": ["model.ref_name_or_path={teacher}", "task.top_k=20", "estimator=rb", "estimator.beta=0.5"],
}


def _worker(tmp_path, world: int, pair) -> dict[str, dict]:
    """{case: the worker's results} of one start of `world` ranks over every case."""
    jobs = []
    for name, extra in CASES.items():
        out = tmp_path / f"{name}-{world}.pt"
        overrides = ["model=hf", f"model.name_or_path={pair[0]}", *COMMON, *(x.format(teacher=pair[1]) for x in extra)]
        jobs.append(" ".join([str(out), *overrides]))
    proc = subprocess.run([sys.executable, str(WORKER), str(world), " :: ".join(jobs)], cwd=tmp_path,
                          env=rank_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: torch.load(tmp_path / f"{name}-{world}.pt") for name in CASES}


@pytest.fixture(scope="module")
def one_and_two(tiny_arch, tmp_path_factory):
    pair = tiny_arch("llama")
    tmp = tmp_path_factory.mktemp("fsdp")
    return _worker(tmp, 1, pair), _worker(tmp, 2, pair)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_one_process_loss_and_gradients(one_and_two, case):
    one, two = one_and_two[0][case], one_and_two[1][case]
    assert two["same_rollout"]  # the sharded policy's rollout (gathered once) draws the unsharded one's tokens
    assert one["rows"] == two["rows"] == 12
    assert abs(one["loss"] - two["loss"]) <= 1e-5 * max(1.0, abs(one["loss"]))
    assert set(one["grads"]) == set(two["grads"]) and one["grads"]
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in one["grads"].values())))
    assert norm > 1e-3  # a real gradient
    for logged in (one["grad_norm"], two["grad_norm"]):  # train/grad_norm: Lightning's, and from the shards
        assert abs(logged - norm) <= 1e-4 * norm
    for name, g in one["grads"].items():
        gap = float((g - two["grads"][name]).abs().max())
        assert gap <= 1e-6 * norm + 1e-6 * float(g.abs().max()), (name, gap, norm)


def test_each_rank_holds_half_the_bytes(one_and_two):
    for case in ("rb", "lora_rb"):
        (one,), two = one_and_two[0][case]["memory"], one_and_two[1][case]["memory"]
        keys = ("params", "grads", "optimizer")
        total = sum(one[k] for k in keys)
        for rank, mem in enumerate(two):
            print(f"{case}: rank {rank} of 2 holds {', '.join(f'{k} {mem[k]:,}' for k in keys)} bytes "
                  f"({sum(mem[k] for k in keys) / total:.3f} of one process's {total:,}): parameters (policy and "
                  "reference), gradients, AdamW state")
            for key in keys:
                assert abs(mem[key] - one[key] / 2) <= 0.02 * one[key] + 64, (case, key, mem, one)


# ---- through the CLI: Lightning's ModelParallelStrategy starts rank 1 itself ----

def _klbench(tmp_path, pair, *extra, wait: bool = True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = rank_args(tmp_path, pair, "fsdp", 4, *extra)
    if not wait:
        return subprocess.Popen(args, cwd=tmp_path, env=rank_env(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return subprocess.run(args, cwd=tmp_path, env=rank_env(tmp_path), capture_output=True, text=True, timeout=600)


def test_a_two_rank_run_trains_on_a_llama_folder(tmp_path, tiny_arch):
    pair = tiny_arch("llama")
    proc = _klbench(tmp_path, pair, "task.max_steps=4")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    final = final_metrics(proc)
    assert final["val/seq_kl"] > 0, proc.stdout[-2000:]  # naive_mc's noise moved the policy off pi_ref
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4 and len(ckpt["rng_ranks"]) == 2  # one file, each rank's RNG
    keys = list(ckpt["state_dict"])
    assert keys and not any(k.startswith("policy.ref.") for k in keys)  # whole policy weights, no reference
    assert all(not hasattr(v, "placements") for v in ckpt["state_dict"].values())


@pytest.mark.slow
def test_bf16_mixed_keeps_float32_shards(tmp_path, tiny_arch):
    # hardware.precision=bf16-mixed under fsdp: FSDP2's MixedPrecisionPolicy computes in bfloat16 and keeps float32
    # shards (what AdamW updates and the checkpoint holds)
    proc = _klbench(tmp_path, tiny_arch("llama"), "task.max_steps=2", "hardware.precision=bf16-mixed")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert {v.dtype for v in ckpt["state_dict"].values()} == {torch.float32}
    assert final_metrics(proc)["val/seq_kl"] > 0


@pytest.mark.slow
def test_the_embedded_default_trains_on_two_ranks(tmp_path):
    # the embedded GPT-2 (tied input and output embeddings, klbench's own decode step) shards as an HF folder does
    args = [str(Path(sys.executable).with_name("klbench")), "hardware=fsdp", "hardware.devices=2",
            "hardware.accelerator=cpu", "task.max_steps=4", "task.val_every=2", "logger=none",
            f"paths.outputs={tmp_path / 'outputs'}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(args, cwd=tmp_path, env=rank_env(tmp_path), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert final_metrics(proc)["val/seq_kl"] > 0


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_exactly(tmp_path, tiny_arch):
    pair = tiny_arch("llama")
    straight = _klbench(tmp_path / "a", pair, "task.max_steps=6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc = _klbench(tmp_path / "b", pair, "task.max_steps=6", wait=False)
    ckpt = tmp_path / "b" / "run" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # both ranks, mid-run
    proc.wait()
    step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    assert step < 6
    resumed = _klbench(tmp_path / "b", pair, "task.max_steps=6", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    a, b = final_metrics(straight), final_metrics(resumed)
    assert a and a == b, (a, b, step)
    # another number of ranks would continue other random streams: refused in one line
    other = _klbench(tmp_path / "b", pair, "hardware.devices=1", "task.max_steps=8", "ckpt_path=last",
                     "ckpt_allow_changes=[task.max_steps]")
    said = [line for line in (other.stdout + other.stderr).splitlines() if "was saved by 2 hardware=fsdp ranks" in line]
    assert other.returncode != 0 and said and "this run has 1" in said[0], other.stdout[-2000:] + other.stderr[-2000:]


# ---- bad input: one line ----

@pytest.mark.parametrize("overrides,says", [
    (["experiment=tabular"], "model=tabular is a table of logits"),
    (["model=hf", "model.name_or_path=x", "task.prompts_per_step=3"], "does not divide it"),
    (["model=hf", "model.name_or_path=x", "hardware.devices=auto"], "number of ranks"),
    (["model=hf", "model.name_or_path=x", "task.probe_every=10"], "task.probe_every=10 probes on one rank"),
])
def test_refusals_in_one_line(tmp_path, overrides, says):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(tmp_path, ["hardware=fsdp", *overrides]))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_more_ranks_than_the_machine_has(tmp_path):
    from klbench.tasks.train import check_config
    n = (os.cpu_count() or 1) + 1
    cfg = compose_cfg(tmp_path, ["hardware=fsdp", "hardware.accelerator=cpu", f"hardware.devices={n}", "model=hf",
                                 "model.name_or_path=x", f"task.prompts_per_step={n}"])
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"hardware.devices={n}" in str(e.value) and "\n" not in str(e.value)
