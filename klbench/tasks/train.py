"""The run's flow: `run_task`, the entry point of every task (it checks the config and runs the task the registry
klbench.tasks.TASKS names), and the training of task=rl and task=distill in a Lightning Trainer. Hydra-free:
takes an OmegaConf config."""
from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import time
import warnings

import torch
from omegaconf import DictConfig, OmegaConf

from klbench.tasks import lean

with lean.lightning():  # without torchmetrics' transformers, scipy and matplotlib (klbench/tasks/lean.py)
    import lightning.pytorch as pl
from lightning.pytorch.plugins.environments import LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment

from klbench.console import messages as console, progress

from klbench.record import folder_run, resume, tracking
from klbench.tasks.rank_hosts import RankHosts
from klbench.record.lifecycle import recorded_run
from klbench.models.policies import build_policy, sampling_params, sampling_text, task_sampling
from klbench.rewards.reward import build_reward
from klbench.config.schema import check_followed_sampling, validate
from klbench.tasks import build_task, runner
from klbench.tasks.uses import shown_uses

log = logging.getLogger(__name__)
# LMPolicy keeps its models in eval mode on purpose (no dropout: see policies.py); Lightning's notice about it
# would only alarm users at every run
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")
# a resume draws the uninterrupted run's prompts exactly (klbench.data.prompts.EpochShuffle starts from the restored
# step), so Lightning's notice that the dataloader is not resumable mid-epoch is wrong for klbench's data
warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")


def check_config(cfg: DictConfig) -> None:
    """Stop bad input before anything is built or trained, naming the config field: the typed schema
    (klbench.config.schema, also run by the CLI before torch is imported), then what needs torch to tell."""
    validate(cfg)
    if cfg.task.name == "pretrain":
        return
    hw = cfg.hardware
    from klbench.tasks.sharding import check_devices
    check_devices(hw)  # hardware=fsdp: no more ranks than this machine's devices
    if hw.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ValueError(f"hardware.accelerator={hw.accelerator} but no CUDA GPU is visible; use hardware=cpu")
    from klbench.config.device_checks import check_bf16
    check_bf16(hw)  # hardware=bf16 or bf16_true on a GPU or CPU without bfloat16


_ddp_store = None  # the store of local_ddp_store, alive until the process exits (or the next run's replaces it)


def local_ddp_store(cfg: DictConfig) -> None:
    """hardware=ddp on this machine alone (no SLURM, torchrun or LSF): the rendezvous store of the
    ranks listens on 127.0.0.1 only.

    torch's TCPStore server (rank 0's) binds the wildcard address, :: or 0.0.0.0, whatever MASTER_ADDR says:
    the address only tells clients where to connect (torch 2.13, both the libuv and the legacy backend). So
    klbench binds the socket to 127.0.0.1 itself, serves a TCPStore on it (master_listen_fd), and has every
    rank, rank 0 included, connect as a client: TORCHELASTIC_USE_AGENT_STORE=True is torch's switch for a
    store hosted by someone else (torch.distributed.rendezvous._create_c10d_store). The ranks Lightning
    starts inherit the environment. A MASTER_ADDR that is not loopback is the user's choice and kept.
    NCCL (GPUs) picks its own interface for its bootstrap: NCCL_SOCKET_IFNAME=lo keeps it on loopback.
    """
    global _ddp_store
    hw = cfg.hardware
    one_device = hw.devices == 1 or (OmegaConf.is_list(hw.devices) and len(hw.devices) == 1)
    # auto: ddp on 2+ devices; fsdp2 (hardware=fsdp) rendezvous as ddp does
    ddp = "ddp" in str(hw.strategy) or hw.strategy == "fsdp2" or (hw.strategy == "auto" and not one_device)
    if not ddp or hw.num_nodes != 1 or os.environ.get("LOCAL_RANK", "0") != "0":
        return  # no process group, several nodes, or a rank Lightning started (the store is its parent's)
    if any(env.detect() for env in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment)):
        return  # ranks and rendezvous come from the cluster (docs/scale-out.md)
    if not _loopback(os.environ.get("MASTER_ADDR", "127.0.0.1")):
        return
    _ddp_store = None  # a previous run's, in this process: its port may be the one MASTER_PORT names
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", int(os.environ.get("MASTER_PORT", "0"))))  # 0: a free port
    sock.listen(128)
    port = sock.getsockname()[1]
    # the store's libuv server owns the socket from here on (it closes it)
    _ddp_store = torch.distributed.TCPStore("127.0.0.1", port, None, True, master_listen_fd=sock.detach(),
                                            wait_for_workers=False, use_libuv=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    # gloo (CPU) listens on the address of the host's name unless told an interface: loopback here too
    loopback = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback[0])


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback


def build_data(cfg: DictConfig, fixed_prompt: str | None = None, policy=None) -> pl.LightningDataModule:
    """The `dataset` group's prompts, or for a policy that ignores prompts (Policy.fixed_prompt) its one prompt.
    With `policy`, the prompts are checked against its context before anything is trained."""
    from klbench.data.prompts import PromptData, check_prompt_lengths, load_prompts
    t = cfg.task
    if (prompt := fixed_prompt) is not None:  # the data only sets the batch shape
        # many batches per epoch, so every DDP process gets full batches after the sampler splits them
        return PromptData([prompt] * t.prompts_per_step * 64, [prompt] * t.val_prompts,
                          t.prompts_per_step, t.val_prompts, cfg.seed)
    train, val = load_prompts(cfg.dataset, policy)
    if len(train) < t.prompts_per_step:  # PromptData's ValueError was a traceback (issue 50)
        from klbench.config.errors import ConfigError
        raise ConfigError(f"task.prompts_per_step={t.prompts_per_step}: the dataset has {len(train)} train prompts; "
                          f"choose at most {len(train)}, or a dataset with more")
    if policy is not None:
        check_prompt_lengths(cfg.dataset, policy, train, val[:t.val_prompts])
    return PromptData(train, val, t.prompts_per_step, t.val_prompts, cfg.seed)


def build_trainer(cfg: DictConfig, logger, max_steps: int, val_every: int) -> pl.Trainer:
    hw = cfg.hardware
    # last.ckpt after every validation, with the config and the metrics it makes durable
    ckpt = tracking.RecordCheckpoint(cfg.paths.ckpt_dir, OmegaConf.to_container(cfg, resolve=True))
    # on a terminal, the step bar; redirected output (a sweep trial's log) gets none
    bar = [progress.StepProgressBar()] if progress.wanted() else []
    plugins = []
    if SLURMEnvironment.detect():
        # ranks come from SLURM (srun tasks), but requeueing is submitit's: Lightning's own auto-requeue
        # would answer a signal with a second `scontrol requeue` and an hpc checkpoint nobody resumes
        plugins.append(SLURMEnvironment(auto_requeue=False))
    parallel = dict(strategy=hw.strategy, precision=hw.precision)
    if hw.strategy == "fsdp2":  # hardware=fsdp: FSDP2 through ModelParallelStrategy (klbench/tasks/sharding.py)
        from klbench.tasks.sharding import trainer_arguments
        parallel = trainer_arguments(hw)
    trainer = pl.Trainer(plugins=plugins, accelerator=hw.accelerator, devices=hw.devices, **parallel,
                      num_nodes=hw.num_nodes, max_steps=max_steps, val_check_interval=val_every,
                      check_val_every_n_epoch=None, logger=logger, callbacks=[ckpt, *bar, *progress.lines(), RankHosts()],
                      enable_checkpointing=False,
                      enable_progress_bar=bool(bar),
                      gradient_clip_val=cfg.task.grad_clip, log_every_n_steps=1,
                      num_sanity_val_steps=0, enable_model_summary=False, deterministic=False)
    from klbench.tasks.sharding import stop_together
    stop_together(trainer)  # SIGTERM: every rank stops at the same step, none blocked (issue 50)
    return trainer


def run_task(cfg: DictConfig) -> dict[str, float]:
    """The entry point of every run: checks the config, then runs its task as the registry
    (klbench.tasks.TASKS) names it; returns the task's metrics."""
    console.setup()
    check_config(cfg)
    from klbench.models.embedded.cache import check_folder
    check_folder(cfg.paths.cache)  # a file where the cache should be: one line before anything is made
    os.makedirs(cfg.paths.outputs, exist_ok=True)
    return runner(cfg.task.name)(cfg)


def run_training(cfg: DictConfig) -> dict[str, float]:
    """task=rl, task=distill: train one run, or resume it; returns the final validation metrics."""
    ckpt_path, payload = _resume_from(cfg)
    if payload is not None and resume.finished(payload, cfg) and folder_run.run_finished(cfg):
        return _already_finished(cfg, payload, ckpt_path)
    if payload is not None:
        log.info("resuming from step %s of %s", payload.get("step"), ckpt_path)
    pl.seed_everything(cfg.seed, workers=True)
    local_ddp_store(cfg)
    t0 = time.time()
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.cache, cfg.get("teacher"),
                          *task_sampling(cfg.task))
    from klbench.tasks.allocator import fix_for_vocabulary
    # at a large vocabulary a fixed mmap threshold: the process's peak follows what it holds (docs/scale.md)
    fix_for_vocabulary(getattr(policy, "vocab", None))
    if policy.sampling != task_sampling(cfg.task)[0]:  # model.generation_config=follow chose the folder's
        s = policy.sampling
        check_followed_sampling(cfg, s.temperature, s.top_k, s.top_p)
    target = sampling_text(policy)
    print(f"klbench: {target}")
    uses = shown_uses(cfg, policy)
    reward = build_reward(cfg.reward, policy, cfg.dataset)
    module = build_task(cfg, policy, reward)
    fingerprint = resume.frozen_fingerprint(module)
    if ckpt_path is not None:  # before the record reopens: a refused resume leaves the run as it was
        _settled_if_refused(cfg, resume.check_weights, module, ckpt_path, payload, cfg, fingerprint)
    data = build_data(cfg, policy.fixed_prompt, policy)
    built_s = time.time() - t0  # the models (the embedded LM's first build included) and the data
    pending = payload["pending_metrics"] if payload is not None else None
    with recorded_run(cfg, resume=ckpt_path is not None, pending=pending) as record:
        tracking.log_params(record.logger, {**sampling_params(policy), **uses})
        trainer = build_trainer(cfg, record.logger, cfg.task.max_steps, cfg.task.val_every)
        tracking.RecordCheckpoint.of(trainer).fingerprint = fingerprint
        before, t_train = None, time.time()
        if ckpt_path is None:
            trainer.validate(module, datamodule=data, verbose=False)
            before = _val_metrics(trainer.callback_metrics)
            record.commit(0)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        # a validation at the last step, unless fit's own schedule made one (a resume at max_steps made none)
        if trainer.global_step % cfg.task.val_every != 0 or not _val_metrics(trainer.callback_metrics):
            trainer.validate(module, datamodule=data, verbose=False)
            tracking.RecordCheckpoint.of(trainer).save(trainer)
        after = _val_metrics(trainer.callback_metrics)
        record.commit(trainer.global_step)
        if trainer.is_global_zero:
            tracking.log_samples(record.logger, module.sample_tables, cfg)
            _print_summary(before, after, trainer.global_step, time.time() - t_train, built_s,
                           getattr(module, "exact_keys", set()), payload.get("step") if payload else None, target)
            console.print_run_where(cfg, record.logger)
        for key in ("val/reward", "val/seq_kl"):
            if not math.isfinite(after.get(key, float("nan"))):
                raise FloatingPointError(f"{key} is {after.get(key)} after training: this run is not usable")
        if trainer.global_step < cfg.task.max_steps:
            raise RuntimeError(f"training stopped at step {trainer.global_step} of {cfg.task.max_steps}")
    return after


def _resume_from(cfg: DictConfig) -> tuple[str | None, dict | None]:
    """The checkpoint to resume and its klbench section, checked before anything is built or logged:
    it exists, it is klbench's, it was made under this config and by this folder's MLflow run.
    A refused resume settles the run it meant to continue (KILLED, if its process is gone)."""
    try:
        ckpt_path = resume.resolve_ckpt(cfg, folder_run.folder_run_state)
        if ckpt_path is None:
            return None, None
        payload = resume.load_payload(ckpt_path)
        resume.check_config(payload, cfg, ckpt_path)
        resume.check_nodes(payload, cfg, ckpt_path)  # another hardware.num_nodes: one line, run unchanged
        resume.check_ranks(ckpt_path, cfg)  # in fit it came after the record reopened: FINISHED became FAILED
        resume.check_run(payload, cfg, ckpt_path)
        folder_run.check_resume_store(cfg, payload)
    except resume.ResumeError as e:
        folder_run.settle_folder_run(cfg, f"resume refused: {e}")
        raise
    return ckpt_path, payload


def _settled_if_refused(cfg: DictConfig, check, *args) -> None:
    """check(*args); a ResumeError it raises first settles the run the resume meant to continue (_resume_from)."""
    try:
        check(*args)
    except resume.ResumeError as e:
        folder_run.settle_folder_run(cfg, f"resume refused: {e}")
        raise


def _already_finished(cfg: DictConfig, payload: dict, ckpt_path: str) -> dict[str, float]:
    """Resuming a run that finished changes nothing: its record stays FINISHED, and its final validation
    is the answer (a sweep trial re-run after it finished gets its result without training)."""
    step = payload["step"]
    print(f"klbench: this run already finished: {ckpt_path} is at step {step} of task.max_steps={cfg.task.max_steps}, "
          "and its record is left as it is. To train it further, raise task.max_steps and add "
          "ckpt_allow_changes=[task.max_steps]")
    return dict(payload["val_metrics"])


def _val_metrics(metrics) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k.startswith("val/")}


def _print_summary(before: dict | None, after: dict, step: int, train_s: float, built_s: float,
                   exact: set[str], resumed_at: int | None = None, target: str | None = None) -> None:
    """train_s: the training and its validations; built_s: the models and data before it. `exact`: the
    metrics that are the truth (the tabular model), each beside its `_sampled` estimate from the samples."""
    keys = sorted(after)
    # a resumed run times only the steps this process took
    steps = f"{step} steps" if resumed_at is None else f"steps {resumed_at} -> {step} ({step - resumed_at})"
    print(f"\nklbench: {steps} in {train_s:.0f} s (before them, building the models and data took "
          f"{built_s:.0f} s)")
    if target:
        print(f"klbench: {target}")
    print(f"{'metric':<22} {'before (step 0)':>16} {'after (step ' + str(step) + ')':>18}")
    for k in keys:
        b = f"{before[k]:.4f}" if before and k in before else "-"
        how = "  exact" if k in exact else "  from the samples" if k.endswith("_sampled") else ""
        print(f"{k:<22} {b:>16} {after[k]:>18.4f}{how}")
    if exact:
        print("exact: over every response the model can give; from the samples: over the validation responses")
