"""hardware=fsdp: FSDP2 through Lightning's ModelParallelStrategy (the models' side: klbench/models/fsdp.py).

    strategy, precision = trainer_arguments(cfg.hardware)   # klbench.tasks.train.build_trainer
    configure_model(task)                                   # RLTask.configure_model: shards the policy's models

Every rank holds a 1/world shard of the policy, its gradients and AdamW's state, and of the reference. The run is
the same experiment whatever the number of ranks: task.prompts_per_step is the step's global batch, split evenly
(prompts_per_rank), and each prompt's samples stay on one rank (their group baselines are exact). Gradients are
averaged over ranks by FSDP's reduce-scatter, which is the global batch's gradient for every loss that is a mean
over sequences (the default task.loss_agg=seq_sum; token_mean normalises by each rank's own token count).
"""
from __future__ import annotations

import os

import torch

from lightning.pytorch.strategies import ModelParallelStrategy

STRATEGY = "fsdp2"  # conf/hardware/fsdp.yaml's hardware.strategy: Lightning's own "fsdp" is FSDP1


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure FSDP2 over every rank (no tensor parallelism), carrying the mixed-precision
    policy configure_model applies. Checkpoints are whole (save_distributed_checkpoint=False): gathered through
    torch.distributed.checkpoint's state-dict API on rank 0 into one file, which klbench's resume checks read and
    any number of ranks can load."""

    def __init__(self, world: int, mp_policy):
        super().__init__(data_parallel_size=world, tensor_parallel_size=1, save_distributed_checkpoint=False)
        self.mp_policy = mp_policy


def world_size(hw) -> int:
    devices = hw.devices
    n = len(devices) if isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str) \
        else int(devices)
    return n * int(hw.num_nodes)


def trainer_arguments(hw):
    """(the Trainer's strategy, its precision) for hardware=fsdp. bf16-mixed becomes FSDP2's MixedPrecisionPolicy:
    bfloat16 parameters in forward and backward, gradients reduced in float32, float32 shards for AdamW; Lightning's
    precision stays 32-true (its autocast would cast again what FSDP has cast). bf16-true: bfloat16 shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    precision = str(hw.precision)
    if precision == "bf16-mixed":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        precision = "32-true"
    else:
        mp = MixedPrecisionPolicy()
    return FSDP2Strategy(world_size(hw), mp), precision


def configure_model(task) -> None:
    """RLTask.configure_model: under hardware=fsdp, shard the policy and the reference over the data-parallel mesh;
    under any other strategy nothing."""
    strategy = task.trainer.strategy
    if not isinstance(strategy, FSDP2Strategy):
        return
    from klbench.models.fsdp import shard_policy
    shard_policy(task.policy, strategy.device_mesh["data_parallel"], strategy.mp_policy)


def prompts_per_rank(cfg) -> int:
    """task.prompts_per_step per process: all of them, except under hardware=fsdp, where it is the global batch."""
    n = int(cfg.task.prompts_per_step)
    if cfg.hardware.strategy != STRATEGY:
        return n
    return n // world_size(cfg.hardware)


def check(cfg) -> None:
    """One-line refusals of hardware=fsdp (klbench.config.schema calls it): models it cannot shard, more ranks than
    devices, a global batch the ranks cannot split."""
    from klbench.config.errors import ConfigError
    hw = cfg.hardware
    if hw.strategy != STRATEGY:
        return
    kind = cfg.model.kind
    if kind != "hf":
        raise ConfigError(f"hardware=fsdp shards a transformers model's decoder layers: it needs model=hf (a "
                          f"Llama-architecture folder, ...), got model.kind={kind}; use hardware=ddp or hardware=cpu")
    world = world_size(hw)
    if hw.num_nodes == 1 and not isinstance(hw.devices, str):
        on_gpu = hw.accelerator in ("gpu", "cuda") or (hw.accelerator == "auto" and torch.cuda.is_available())
        have = torch.cuda.device_count() if on_gpu else os.cpu_count() or 1
        if world > have:
            raise ConfigError(f"hardware.devices={hw.devices}: this machine has {have} "
                              f"{'GPUs' if on_gpu else 'CPU cores'}; choose at most {have}")
    n = int(cfg.task.prompts_per_step)
    if n % world:
        raise ConfigError(f"hardware=fsdp splits task.prompts_per_step={n} (the global batch) over "
                          f"hardware.devices x hardware.num_nodes = {world} ranks, which does not divide it: choose "
                          f"a multiple of {world}")
