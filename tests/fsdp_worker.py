"""One training step's loss, gradients and memory on `world` CPU ranks (gloo, FSDP2 when world > 1), for
tests/test_fsdp.py: python tests/fsdp_worker.py WORLD OUT OVERRIDE... [:: OUT OVERRIDE...]...
(one start of the ranks for several configs).

Every rank builds the same models and draws the same global rollout (same seed) before sharding, scores its own
prompts' rows (a prompt's samples on one rank), and backpropagates through klbench's step (klbench/tasks/step.py);
rank 0 saves the loss averaged over ranks, every parameter's whole gradient, and each rank's bytes of parameters,
gradients and AdamW state. world=1 runs the plain unsharded path: the baseline.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def step(rank: int, world: int, out: str, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    from klbench.config.compose import compose
    from klbench.models.fsdp import memory_per_rank, shard_policy
    from klbench.models.policies import build_policy, task_sampling
    from klbench.tasks import build_task
    from klbench.tasks.step import backward_in_parts
    cfg = compose(overrides, outputs=os.path.join(os.path.dirname(out), "outputs"),
                  run_dir=os.path.join(os.path.dirname(out), "run"))
    t = cfg.task
    policy = build_policy(cfg.model, t.max_new_tokens, None, cfg.get("teacher"), *task_sampling(t))
    task = build_task(cfg, policy, None)
    task.metrics_read = False  # no trainer: nothing is logged
    prompts = ["the film was", "a slow and", "i liked", "not once"][: t.prompts_per_step]
    torch.manual_seed(0)
    ro = policy.rollout(prompts, t.n_samples)  # the global batch, the same on every rank
    reward = torch.randn(len(ro.texts), generator=torch.Generator().manual_seed(1))
    B = len(ro.texts)
    i, j = rank * B // world, (rank + 1) * B // world
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy
        shard_policy(policy, init_device_mesh("cpu", (world,)), MixedPrecisionPolicy())
        # a rollout through the sharded policy (gathered once, decoded unsharded) draws the unsharded policy's tokens
        torch.manual_seed(0)
        again = policy.rollout(prompts, t.n_samples)
        same = torch.equal(again.tokens, ro.tokens) and torch.allclose(again.sampled_logp, ro.sampled_logp, atol=1e-5)
        ro, reward = ro.rows(i, j), reward[i:j]
    else:
        same = True
    scoring = policy.scoring(ro, t.get("micro_batch_size"), task.needs_token_kl(1))
    _, loss, _ = backward_in_parts(policy, scoring, lambda b: task.step_loss(b, ro, reward, 0, "test"))
    loss.backward()
    value = loss.detach().clone()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    grads = {n: _whole(p.grad) for n, p in policy.model.named_parameters() if p.grad is not None}
    from klbench.tasks.sharding import grad_norm
    norm = float(grad_norm(policy))  # train/grad_norm: Lightning's in one process, from the shards on several
    opt = torch.optim.AdamW(policy.trainable(), lr=1e-3)
    opt.step()  # allocates AdamW's two moments
    mem = memory_per_rank(task, opt)
    import resource
    mem["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the whole process's, load included
    mems = [None] * world
    if world > 1:
        dist.all_gather_object(mems, mem)
    else:
        mems = [mem]
    if rank == 0:
        torch.save({"same_rollout": same, "loss": float(value), "grad_norm": norm, "grads": grads, "memory": mems,
                    "rows": B}, out)


def _whole(g):
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def steps(rank: int, world: int, jobs: list[tuple[str, list[str]]], port: int) -> None:
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    for out, overrides in jobs:
        step(rank, world, out, overrides)
    if world > 1:
        dist.destroy_process_group()


def main() -> None:
    world, jobs = int(sys.argv[1]), []
    for job in " ".join(sys.argv[2:]).split(" :: "):
        out, *overrides = job.split()
        jobs.append((out, overrides))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if world == 1:
        steps(0, 1, jobs, port)
    else:
        mp.spawn(steps, args=(world, jobs, port), nprocs=world)


if __name__ == "__main__":
    main()
