"""hardware=fsdp: FSDP2 through Lightning's ModelParallelStrategy (the models' side: klbench/models/fsdp.py).

    pl.Trainer(..., **trainer_arguments(cfg.hardware))   # klbench.tasks.train.build_trainer
    configure_model(task)                                # RLTask.configure_model: shards the policy's models

Every rank holds a 1/world shard of the policy, its gradients and AdamW's state, and of the reference. The run is
the same experiment whatever the number of ranks: task.prompts_per_step is the step's global batch, split evenly
(FSDP2Strategy.batch_to_device), and each prompt's samples stay on one rank (their group baselines are exact).
Gradients are averaged over ranks by FSDP's reduce-scatter, which is the global batch's gradient for every loss
that is a mean over sequences (the default task.loss_agg=seq_sum; token_mean normalises by each rank's own token count).
"""
from __future__ import annotations

import os

import torch

from lightning.pytorch.strategies import ModelParallelStrategy

STRATEGY = "fsdp2"  # conf/hardware/fsdp.yaml's hardware.strategy: Lightning's own "fsdp" is FSDP1


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure FSDP2 over every rank (no tensor parallelism), carrying the mixed-precision
    policy configure_model applies. Checkpoints are whole (save_distributed_checkpoint=False): gathered through
    torch.distributed.checkpoint's state-dict API on rank 0 into one file, which klbench's resume checks read, with
    every rank's RNG state (save_rank_rng): an exact resume needs as many ranks (rank_rng refuses others)."""

    whole_batches = True  # every rank loads each batch whole (klbench.data.prompts: no share of the prompts)

    def __init__(self, world: int, mp_policy):
        super().__init__(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=False)
        self.mp_policy = mp_policy

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        # every rank loads the step's whole batch of prompts (no distributed sampler: klbench.data.prompts.EpochShuffle
        # then resumes mid-epoch exactly) and keeps its own contiguous share: a prompt's samples stay on one rank
        if isinstance(batch, (list, tuple)) and batch:
            n, r, w = len(batch), self.global_rank, self.world_size
            batch = batch[r * n // w:(r + 1) * n // w]
        return super().batch_to_device(batch, device, dataloader_idx)


def world_size(hw) -> int:
    """Ranks: hardware.devices (a count or a list of indices) x hardware.num_nodes."""
    devices = hw.devices
    return (devices if isinstance(devices, int) else len(devices)) * int(hw.num_nodes)


def trainer_arguments(hw):
    """The Trainer's strategy, precision and use_distributed_sampler for hardware=fsdp (FSDP2Strategy.batch_to_device
    splits the batches). bf16-mixed becomes FSDP2's MixedPrecisionPolicy:
    bfloat16 parameters in forward and backward, gradients reduced in float32, float32 shards for AdamW; Lightning's
    precision stays 32-true (its autocast would cast again what FSDP has cast). bf16-true: bfloat16 shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    precision = str(hw.precision)
    if precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        precision = "32-true"
    else:
        mp = MixedPrecisionPolicy()
    return dict(strategy=FSDP2Strategy(world_size(hw), mp), precision=precision, use_distributed_sampler=False)


def configure_model(task) -> None:
    """RLTask.configure_model: every rank but 0 seeds its own random stream (seed_rank); under hardware=fsdp, shard
    the policy and the reference over the data-parallel mesh."""
    strategy = task.trainer.strategy
    seed_rank(strategy.global_rank)
    if not isinstance(strategy, FSDP2Strategy):
        return
    from klbench.models.fsdp import shard_policy
    shard_policy(task.policy, strategy.device_mesh["data_parallel"], strategy.mp_policy)


def seed_rank(rank: int) -> None:
    """Rank r > 0 of a multi-process run (ddp, fsdp) draws its own stream, seeded from (seed, r), once the models are
    built (the same on every rank, from the seed alone) and before a checkpoint restores the streams. Rank 0 keeps
    the seed's stream, so a one-process run draws what it always drew. Idempotent: Lightning calls configure_model
    at every fit and validate."""
    seed = os.environ.get("PL_GLOBAL_SEED")  # pl.seed_everything(cfg.seed) sets it
    if rank == 0 or seed is None:
        return
    import random

    import numpy as np
    state = np.random.SeedSequence([int(seed), rank]).generate_state(2)
    torch.manual_seed(int(state[0]))
    random.seed(int(state[0]))
    np.random.seed(int(state[1]))


def save_rank_rng(checkpoint: dict, rng: dict) -> None:
    """RLTask.on_save_checkpoint, on every rank: checkpoint["rng"] is this rank's RNG state, and with several ranks
    checkpoint["rng_ranks"] every rank's (all-gathered; rank 0 writes the file): the ranks draw their rollouts
    apart, and an exact resume gives each its own stream back."""
    checkpoint["rng"] = rng
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rng)
        checkpoint["rng_ranks"] = ranks


def rank_rng(checkpoint: dict, task) -> dict | None:
    """RLTask.on_load_checkpoint: the RNG state this rank resumes from. A checkpoint of several ranks gives each
    its own and refuses another number of ranks in one line; one without rng_ranks (one process's, or of several
    ranks before they were kept) gives its "rng" to every rank."""
    ranks = checkpoint.get("rng_ranks")
    if ranks is None:
        return checkpoint.get("rng")
    trainer = task.trainer
    if len(ranks) != trainer.world_size:
        from klbench.record.resume import ResumeError
        kind = "hardware=fsdp" if isinstance(trainer.strategy, FSDP2Strategy) else "hardware=ddp"
        raise ResumeError(f"{trainer.ckpt_path} was saved by {len(ranks)} {kind} ranks and this run has "
                          f"{trainer.world_size}: each rank's samples continue its own random stream, so an "
                          f"exact resume needs hardware.devices x hardware.num_nodes = {len(ranks)}")
    return ranks[trainer.global_rank]


def check_devices(hw) -> None:
    """hardware=fsdp with more ranks on this machine than it has GPUs (or CPU cores, for CPU ranks): one line.
    The rest is refused before torch loads (klbench.config.schema._check_fsdp)."""
    if hw.strategy != STRATEGY or hw.num_nodes != 1:
        return
    on_gpu = hw.accelerator in ("gpu", "cuda") or (hw.accelerator == "auto" and torch.cuda.is_available())
    have = torch.cuda.device_count() if on_gpu else os.cpu_count() or 1
    if world_size(hw) > have:
        from klbench.config.errors import ConfigError
        raise ConfigError(f"hardware.devices={hw.devices}: this machine has {have} {'GPUs' if on_gpu else 'CPU cores'} "
                          f"for hardware=fsdp's ranks; choose at most {have}")


def grad_norm(policy) -> torch.Tensor:
    """train/grad_norm: the 2-norm of the whole gradient. Lightning's grad_norm, except under hardware=fsdp, where
    it is computed from every rank's shards (Lightning's reads each parameter's local tensor and cannot)."""
    grads = [p.grad for p in policy.trainable() if p.grad is not None]
    if not any(hasattr(g, "full_tensor") for g in grads):
        from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
        return lightning_grad_norm(policy, norm_type=2).get("grad_2.0_norm_total", torch.tensor(0.0))
    return torch.nn.utils.get_total_norm(grads, 2.0).full_tensor()


# ---- SIGTERM to a multi-process run: every rank stops at the same step (issue 50) ----

def stop_together(trainer) -> None:
    """Lightning's SIGTERM handler (2.6) broadcasts from inside the handler, on each rank, whatever collective the
    rank is in at that moment: rank 0's broadcast met rank 1's FSDP all-gather, and both ranks waited in
    futex_do_wait for good (1 try in 6). And each rank raised its stop at the end of its own step, from its own
    flag: rank 1 could leave first, and Lightning's child-process observer then SIGKILLed rank 0 before it marked
    the run KILLED (1 in 6). Here the handler only notes the signal (and passes it to the ranks it launched), and
    the collective at the start of every step (TrainingEpochLoop._broadcast_sigterm_tensor, which every rank runs at
    the same point) hands rank 0's note to all: every rank stops at the same step. A rank stuck all the same is
    ended by klbench.record.interrupts.watchdog."""
    import types
    if trainer.world_size <= 1:
        return
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    connector, loop = trainer._signal_connector, trainer.fit_loop.epoch_loop
    connector.sigterm_noted = False

    def note(self, signum, frame) -> None:
        if not self.sigterm_noted:
            self.sigterm_noted = True
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks this process started (they only note it too)

    def broadcast(self) -> None:
        dist = torch.distributed
        flag = torch.tensor([1 if connector.sigterm_noted else 0], device=self.trainer.strategy.root_device)
        dist.broadcast(flag, src=0)  # rank 0's note, at the same point on every rank
        if flag.item() == 1:
            connector.received_sigterm = True  # Lightning's own checks after the step see it from here on
            dist.barrier()
            raise SIGTERMException()

    connector._sigterm_notifier_fn = types.MethodType(note, connector)
    loop._broadcast_sigterm_tensor = types.MethodType(broadcast, loop)
    _spare_the_stopping_launcher()


def _spare_the_stopping_launcher() -> None:
    """Lightning's child-process observer (in the launching rank 0) SIGKILLs rank 0 when a rank it launched exits
    non-zero. A rank stopped by SIGTERM exits 143 while rank 0 marks the run KILLED: the observer's SIGKILL left it
    RUNNING. While rank 0 is itself stopping on a signal, the observer leaves rank 0 alone (it still ends the other
    ranks); rank 0 ends on its own, or by klbench.record.interrupts.watchdog if blocked."""
    from lightning.fabric.strategies.launchers import subprocess_script
    observer = subprocess_script._ChildProcessObserver
    if getattr(observer, "_klbench_spared", False):
        return
    terminate_all = observer._terminate_all

    def spare(self) -> None:
        from klbench.record import interrupts
        if interrupts.received is None:
            return terminate_all(self)
        for p in self._child_processes:
            p.send_signal(self._termination_signal)
    observer._terminate_all = spare
    observer._klbench_spared = True

