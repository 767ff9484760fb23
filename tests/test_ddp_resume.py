"""hardware=ddp resumes exactly: each rank continues its own share of the prompts (klbench.data.prompts.EpochShuffle
with rank and world) and its own random stream (every rank's RNG state in the checkpoint, each rank seeded apart:
klbench/tasks/sharding.py). A 2-process CPU run (tiny Llama folder) stopped at a validation and resumed ends with the
uninterrupted run's metrics."""
from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ranks_cli import final_metrics, rank_args, rank_env


def test_each_rank_continues_its_own_share_of_the_prompts():
    """Uninterrupted, EpochShuffle(rank, world) gives each rank what Lightning's DistributedSamplerWrapper gave it
    around the one-process order (so fresh ddp runs draw what they drew); started at step s, each rank continues."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from klbench.data.prompts import EpochShuffle
    n, bs, seed, world = 23, 2, 7, 2
    per_epoch = -(-n // world) // bs

    def batches(sampler, start, epochs):
        loader = DataLoader(list(range(n)), batch_size=bs, sampler=sampler, drop_last=True, collate_fn=list)
        out = []
        for e in range(start // per_epoch, epochs):
            sampler.set_epoch(e)
            out += list(itertools.islice(iter(loader), per_epoch))
        return out

    for rank in range(world):
        wrapped = DistributedSamplerWrapper(EpochShuffle(n, bs, seed), num_replicas=world, rank=rank, shuffle=False)
        straight = batches(wrapped, 0, 3)
        assert batches(EpochShuffle(n, bs, seed, 0, rank, world), 0, 3) == straight
        for start in (3, per_epoch + 2):  # mid-epoch, in the first epoch and the second
            assert batches(EpochShuffle(n, bs, seed, start, rank, world), start, 3) == straight[start:], (rank, start)


def test_a_checkpoint_without_each_ranks_rng_gives_its_own_to_every_rank():
    # one process's checkpoint (and a multi-rank one from before rng_ranks) resumes as it always did
    from klbench.tasks.sharding import rank_rng
    rng = {"torch": torch.get_rng_state(), "python": None}
    assert rank_rng({"rng": rng}, task=None) is rng
    assert rank_rng({}, task=None) is None


def _klbench(tmp_path: Path, pair, *extra, check: bool = True) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    args, env = rank_args(tmp_path, pair, "ddp", 2, *extra), rank_env(tmp_path)
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 or not check, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_a_two_process_ddp_run_stopped_and_resumed_equals_the_straight_run(tmp_path, tiny_arch):
    pair = tiny_arch("llama")
    straight = final_metrics(_klbench(tmp_path / "a", pair, "task.max_steps=6"))
    _klbench(tmp_path / "b", pair, "task.max_steps=2")  # stops at its validation of step 2
    ckpt = torch.load(tmp_path / "b" / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    resumed = final_metrics(_klbench(tmp_path / "b", pair, "task.max_steps=6", "ckpt_path=last",
                              "ckpt_allow_changes=[task.max_steps]"))
    assert straight["val/seq_kl"] > 0 and straight == resumed, (straight, resumed)
    assert ckpt["global_step"] == 2 and len(ckpt["rng_ranks"]) == 2
    ranks = ckpt["rng_ranks"]
    assert not torch.equal(ranks[0]["torch"], ranks[1]["torch"])  # each rank its own stream
    # one process would continue other random streams: refused in one line
    other = _klbench(tmp_path / "b", pair, "hardware.devices=1", "task.max_steps=8", "ckpt_path=last",
                     "ckpt_allow_changes=[task.max_steps]", check=False)
    said = [line for line in (other.stdout + other.stderr).splitlines() if "was saved by 2 hardware=ddp ranks" in line]
    assert other.returncode != 0 and said and "this run has 1" in said[0], other.stdout[-2000:] + other.stderr[-2000:]
