"""Resuming from a checkpoint: only a klbench checkpoint, and only under the config it was made with.

A checkpoint carries the resolved config of its run (klbench.record.tracking.RecordCheckpoint). Resuming it
under another model, teacher, reward, dataset, task, estimator or seed would continue one experiment
as another, so it is refused with the differing keys named, unless the user lists them in
`ckpt_allow_changes` (e.g. `ckpt_allow_changes=[task.max_steps]` to train a finished run longer).

A checkpoint's policy weights alone (load_policy_weights, for task=probe) load only into the model and
teacher they were made with: the checkpoint's format is the record's (RecordCheckpoint), so reading it is too.
"""
from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from klbench.record.redact import redact_obj
from klbench.record.runs import RUN_ID_FILE

# what makes a run the run it is; hardware, logger and paths may change between attempts
IDENTITY = ("task", "estimator", "kl_ctl", "model", "teacher", "reward", "dataset", "seed")
# what a group or option was before it existed, for checkpoints made then: the value that does what
# klbench did (beta was always fixed; one optimiser step per rollout)
BEFORE = {"kl_ctl": {"name": "fixed"}, "task.inner_steps": 1, "task.clip_eps": 0.2,
          # the adaptive controller before issue 18: integral part only, horizon in sequences
          "kl_ctl.kp": 0.0, "kl_ctl.horizon_unit": "sequences",
          # before issue 29: plain sampling, whose every target is one pair; klbench's sampling, not the folder's
          "task.temperature": 1.0, "task.top_k": 0, "task.top_p": 1.0, "task.kl_target": "sampler",
          "model.generation_config": "klbench", "teacher.generation_config": "klbench",
          # issue 46: dataset=arith's config gained the chat keys every dataset declares (false and null)
          "dataset.chat_template": False,
          # issue 53: the sampler was the trainer's own model; a behaviour policy carried the sampler's log-probs
          "task.sampler": {"precision": "same", "attn_implementation": "same", "lag": 0},
          "task.behaviour": "sampler", "task.pg_correction": {"mode": "none", "cap": 3.0, "floor": None}}


# task keys that only add measurements (klbench.probe.measure at validations, on its own RNG stream): they never
# change what a run trains, so a run may resume with them changed or added
MEASUREMENT_ONLY = ("task.probe_every", "task.probe")


class ResumeError(ValueError):
    pass


def resolve_ckpt(cfg: DictConfig, recorded=None) -> str | None:
    """The checkpoint that `ckpt_path` names (`last`: this run folder's last.ckpt), or None; it must exist.
    recorded(cfg) -> (MLflow run id, status, steps done) or None: what the folder's record says, asked only when
    last.ckpt is missing, to tell a run that never checkpointed from one whose checkpoint was deleted."""
    if cfg.ckpt_path in (None, "null"):
        return None
    path = os.path.join(cfg.paths.ckpt_dir, "last.ckpt") if cfg.ckpt_path == "last" else cfg.ckpt_path
    if not os.path.isfile(path):
        hint = (f"the run stopped before its first checkpoint (written at every validation, every "
                f"task.val_every={cfg.task.get('val_every')} steps): start it again without ckpt_path"
                if cfg.ckpt_path == "last" else "check the path")
        if cfg.ckpt_path == "last" and recorded is not None and (rec := recorded(cfg)) and rec[2] > 0:
            # its record went past step 0, so a checkpoint was written: someone removed it
            hint = (f"yet its MLflow run {rec[0]} is {rec[1]} at step {rec[2]}, so the checkpoint was deleted or "
                    "moved: put it back (or give ckpt_path its path), or start a new run without ckpt_path "
                    "and hydra.run.dir")
        raise ResumeError(f"ckpt_path={cfg.ckpt_path!r}: no checkpoint at {path}; {hint}")
    return path


def folder_run_id(cfg: DictConfig) -> str | None:
    """The MLflow run this run folder belongs to (its mlflow_run_id.txt), or None."""
    path = Path(cfg.paths.ckpt_dir).parent / RUN_ID_FILE
    return (path.read_text().strip() or None) if path.is_file() else None


def check_run(payload: dict, cfg: DictConfig, path: str) -> None:
    """A checkpoint resumes only into the MLflow run that wrote it. Two runs that once shared a folder left
    one's mlflow_run_id.txt beside the other's last.ckpt; continuing would splice one run into the other."""
    mine, folder = payload.get("mlflow_run_id"), folder_run_id(cfg)
    if cfg.logger.get("kind") == "mlflow" and mine and folder and mine != folder:
        raise ResumeError(f"{path} was written by MLflow run {mine}, but its folder belongs to MLflow run "
                          f"{folder} ({RUN_ID_FILE}): two runs shared this folder, so neither can be resumed "
                          "from it. Start the run again in a folder of its own (without hydra.run.dir)")


def finished(payload: dict, cfg: DictConfig) -> bool:
    """The checkpoint is of a run that trained all of cfg.task.max_steps and ran its final validation."""
    return int(payload.get("step", -1)) >= int(cfg.task.max_steps) and bool(payload.get("val_metrics"))


def load_payload(path: str) -> dict:
    """The klbench section of a checkpoint (config, pending metrics, step); ResumeError otherwise."""
    return _section(_torch_load(path, path), path)


def read_checkpoint(path: str) -> dict:
    """The whole checkpoint (its klbench section checked), read ONCE through one open file, its archive's CRC-32s
    checked first; ResumeError otherwise. One open file is one version of it: RecordCheckpoint replaces last.ckpt
    with os.replace at every validation, so a run checkpointing while this reads cannot give the config of one step
    and the weights of the next (three reads did, issue 50). torch's zip reader never checks the CRCs, so zeroed
    bytes inside a tensor's entry load as weights without them."""
    with open(path, "rb") as f:
        if zipfile.is_zipfile(f):
            f.seek(0)
            try:
                bad = zipfile.ZipFile(f).testzip()  # reads every entry: the name of the first whose CRC fails
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                bad = f"its directory ({e})"
            if bad:
                raise ResumeError(f"{path} is damaged: {bad} fails the zip archive's CRC-32 check, so what it holds "
                                  "is not what was saved (a disk or copy error). Use another copy of the checkpoint, "
                                  "or an earlier run's")
        f.seek(0)
        ckpt = _torch_load(f, path)
    _section(ckpt, path)
    return ckpt


def _torch_load(source, path: str):
    """torch.load of a path or an open file, every reader's failure as ResumeError naming `path`."""
    import torch
    try:
        # weights_only: a checkpoint is data, never code. klbench's load under it; anything else is not ours
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError, OSError, ValueError, IndexError,
            KeyError, TypeError) as e:
        # a zip of torch tensors is what klbench writes; anything else fails somewhere in torch's readers,
        # random bytes in the legacy unpickler with whatever the bytes happen to say (UnpicklingError too)
        zipped = zipfile.is_zipfile(path)
        why = ("it holds Python objects that klbench never saves" if zipped and isinstance(e, pickle.UnpicklingError)
               else "it is not a torch checkpoint (a zip archive)" if not zipped else
               f"it cannot be read as one ({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})")
        raise ResumeError(f"{path} is not a klbench checkpoint: {why}, so it is not loaded. {WHAT_TO_DO}") from None


def _section(ckpt, path: str) -> dict:
    if not isinstance(ckpt, dict) or "klbench" not in ckpt or "config" not in ckpt["klbench"]:
        raise ResumeError(f"{path} is not a klbench checkpoint: it has no klbench section (config and metrics). "
                          + WHAT_TO_DO)
    return ckpt["klbench"]


WHAT_TO_DO = ("Give ckpt_path a last.ckpt that klbench wrote, or start the run again without ckpt_path (and without "
              "hydra.run.dir, in a folder of its own)")


def config_changes(saved: dict, cfg: DictConfig) -> list[str]:
    """Dotted keys under IDENTITY whose values differ between the checkpoint's config and this one."""
    now = redact_obj(OmegaConf.to_container(cfg, resolve=True))  # the checkpoint holds its config redacted
    out: list[str] = []

    def walk(a, b, key: str) -> None:
        if key in MEASUREMENT_ONLY:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                sub = f"{key}.{k}" if key else k
                walk(a[k] if k in a else BEFORE.get(sub), b.get(k), sub)
        elif a != b:
            out.append(f"{key} ({a!r} in the checkpoint, {b!r} now)")

    for group in IDENTITY:
        walk(saved[group] if group in saved else BEFORE.get(group), now.get(group), group)
    return out


def check_config(payload: dict, cfg: DictConfig, path: str) -> None:
    allowed = list(cfg.get("ckpt_allow_changes") or [])
    changes = [c for c in config_changes(payload["config"], cfg)
               if "*" not in allowed and not any(c == a or c.startswith(a + ".") or c.startswith(a + " ")
                                                 for a in allowed)]
    if changes:
        keys = ",".join(c.split(" ", 1)[0] for c in changes)
        raise ResumeError(f"{path} was made under another config: " + "; ".join(changes)
                          + f". Resume with the checkpoint's values, or accept the change with "
                            f"ckpt_allow_changes=[{keys}]")


def check_nodes(payload: dict, cfg: DictConfig, path: str) -> None:
    """hardware.num_nodes as the checkpoint's run had it. Another node count moves every rank but rank 0 to another
    node and another place in the ranks' order, so a multi-node run resumes on its own count of nodes only (the
    ranks' count is checked again where each rank takes its RNG stream: klbench.tasks.sharding.rank_rng)."""
    saved = int(((payload["config"].get("hardware") or {}).get("num_nodes")) or 1)  # before it was saved: 1 node
    now = int(cfg.hardware.num_nodes)
    if saved != now and not _allows(cfg, "hardware.num_nodes", "hardware"):
        raise ResumeError(f"{path} was saved by a run on hardware.num_nodes={saved} and this one asks for {now}: "
                          f"resume it with hardware.num_nodes={saved} (and hydra.launcher.nodes={saved} under SLURM)")


def check_ranks(path: str, cfg: DictConfig) -> None:
    """The number of ranks as the checkpoint's run had it, told before the record reopens (issue 50: the same
    refusal inside fit turned a FINISHED run FAILED). A checkpoint of several ranks holds each rank's RNG stream
    (klbench.tasks.sharding.save_rank_rng), which an exact resume gives back to each; `hardware.devices` given as
    `auto` is counted only in fit (klbench.tasks.sharding.rank_rng)."""
    import torch
    hw = cfg.hardware
    devices = hw.get("devices")
    if isinstance(devices, bool) or not (isinstance(devices, int) and devices >= 1 or OmegaConf.is_list(devices)):
        return  # auto, -1 (all): counted by Lightning
    multi = "ddp" in str(hw.get("strategy")) or hw.get("strategy") in ("fsdp2", "auto")
    world = ((devices if isinstance(devices, int) else len(devices)) * int(hw.get("num_nodes") or 1)) if multi else 1
    ranks = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("rng_ranks")
    if ranks is not None and len(ranks) != world:
        saved = (_section_of(path) or {}).get("config", {}).get("hardware") or {}
        kind = "hardware=fsdp" if saved.get("strategy") == "fsdp2" else "hardware=ddp"
        raise ResumeError(f"{path} was saved by {len(ranks)} {kind} ranks and this run has {world}: each rank's "
                          f"samples continue its own random stream, so an exact resume needs hardware.devices x "
                          f"hardware.num_nodes = {len(ranks)}")


def _section_of(path: str) -> dict | None:
    try:
        return load_payload(path)
    except ResumeError:
        return None


def load_policy_weights(policy, path: str, cfg: DictConfig, ckpt: dict | None = None) -> int:
    """Loads a klbench checkpoint's policy weights into `policy` (a torch module whose parameters the
    checkpoint's `policy.` entries name, as RecordCheckpoint saves them); returns the checkpoint's step.
    `ckpt`: the checkpoint already read (read_checkpoint), so that its step and weights are one version.
    Refuses a checkpoint made with another model or teacher, naming the keys, and one without weights or
    with a weight of another shape, naming it."""
    if ckpt is None:
        ckpt = _torch_load(path, path)
    payload = _section(ckpt, path)  # "not a klbench checkpoint" for anything else
    changes = [c for c in config_changes(payload["config"], cfg) if c.startswith(("model", "teacher"))]
    if changes:
        raise ResumeError(f"{path} holds a policy of another model: " + "; ".join(changes)
                          + ". Load it with the model (and teacher) options of its run")
    state = ckpt.get("state_dict")
    if not isinstance(state, dict) or not any(k.startswith("policy.") for k in state):
        what = "its state_dict has no policy.* entry" if isinstance(state, dict) else "it has no state_dict"
        raise ResumeError(f"{path} holds no policy weights ({what}): it is not a checkpoint RecordCheckpoint "
                          "wrote whole. Use another checkpoint of the run")
    state = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    mine = policy.state_dict()
    for name, value in state.items():  # load_state_dict's size mismatch is a 19-line traceback
        if name in mine and tuple(value.shape) != tuple(mine[name].shape):
            raise ResumeError(f"{path} holds policy.{name} of shape {list(value.shape)}, the run's model has "
                              f"{list(mine[name].shape)}: the checkpoint does not fit the model its config names")
    missing, unexpected = policy.load_state_dict(state, strict=False)
    # neither the frozen reference nor frozen policy weights (a LoRA base) are checkpointed
    frozen = {name for name, p in policy.named_parameters() if not p.requires_grad}
    missing = [k for k in missing if not k.startswith("ref.") and k not in frozen]
    if missing or unexpected:
        raise ResumeError(f"{path}: the policy's weights do not fit this model (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    return int(payload.get("step") or 0)


def _allows(cfg: DictConfig, *groups: str) -> bool:
    """ckpt_allow_changes accepts a change within any of `groups` (the group, a key of it such as model.dtype,
    which changes the frozen weights on purpose, or `*`)."""
    allowed = list(cfg.get("ckpt_allow_changes") or [])
    return "*" in allowed or any(a == g or a.startswith(g + ".") for a in allowed for g in groups)


def frozen_fingerprint(module) -> str:
    """A hash of the weights a checkpoint leaves out (a LoRA base, the frozen reference, a teacher): names,
    shapes, dtypes and up to 4096 evenly spaced values of each. A checkpoint records it, so that a resume on a
    base replaced at the same path is refused instead of continuing an adapter trained for another base.
    Taken before fit, where hardware.precision has not cast anything yet."""
    import hashlib

    import torch
    h = hashlib.sha256()
    frozen = sorted((n, p) for n, p in module.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        for name, p in frozen:
            flat = p.detach().reshape(-1)  # [numel]
            sample = flat[::max(1, flat.numel() // 4096)].float().cpu()  # [<= 4097]
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def check_weights(module, path: str, payload: dict, cfg: DictConfig, fingerprint: str | None = None) -> None:
    """Before a resume loads anything: the checkpoint holds every parameter this run trains, each with this
    model's shape, and nothing else; and the weights it leaves out are those it was made on (`fingerprint`:
    frozen_fingerprint(module), checked when the checkpoint recorded one). The task loads with
    strict_loading=False (the frozen weights are not in it), which would otherwise start a missing adapter
    from zero without a word, and a reshaped one ends in torch's size-mismatch traceback after the run was
    reopened."""
    import torch
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    check_sampler_queue(ckpt, path, payload, cfg)
    state = ckpt.get("state_dict") or {}
    mine = module.state_dict()  # what the task checkpoints: trained parameters and buffers, frozen ones left out
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    changed = "; ".join(c for c in config_changes(payload["config"], cfg) if c.startswith(("model", "teacher")))
    since = f" (changed since: {changed})" if changed else ""
    if missing := [n for n in trained if n not in state]:
        raise ResumeError(f"{path} holds no weights for {len(missing)} of the {len(trained)} parameters this run "
                          f"trains ({', '.join(missing[:2])}{', ...' if len(missing) > 2 else ''}){since}: resuming "
                          f"would restart them from their initial values. {WHAT_TO_DO}")
    if unexpected := [n for n in state if n not in mine]:
        raise ResumeError(f"{path} holds weights this model does not have ({', '.join(unexpected[:2])}"
                          f"{', ...' if len(unexpected) > 2 else ''}){since}: resume with the model options of the "
                          "checkpoint, or start a new run without ckpt_path")
    for name, value in mine.items():
        if name in state and tuple(state[name].shape) != tuple(value.shape):
            raise ResumeError(f"{path} holds {name} of shape {list(state[name].shape)}, this model's is "
                              f"{list(value.shape)}{since}: a checkpoint loads only into the shapes it was made "
                              "with; resume with the checkpoint's values, or start a new run without ckpt_path")
    saved = payload.get("frozen_fingerprint")
    if saved and fingerprint and saved != fingerprint and not _allows(cfg, "model", "teacher"):
        where = cfg.model.get("name_or_path") or "the model folder"
        raise ResumeError(f"{path} was trained on other frozen weights (the LoRA base, the reference or the "
                          f"teacher) than those loaded now: {where} (or the reference's folder) changed since the "
                          "checkpoint was made. Put back the weights it was trained on, start a new run without "
                          "ckpt_path, or accept the change with ckpt_allow_changes=[model]")


def check_sampler_queue(ckpt: dict, path: str, payload: dict, cfg: DictConfig) -> None:
    """task.sampler.lag = k: the checkpoint carries the weights the next k steps' rollouts are drawn by (RLTask's
    `sampler_engine`), and was made at the same lag; a changed lag is refused even where ckpt_allow_changes lists
    it, since the queue it holds was drawn for the other lag."""
    lag = int(OmegaConf.select(cfg, "task.sampler.lag", default=0) or 0)
    saved = (payload["config"].get("task") or {}).get("sampler") or BEFORE["task.sampler"]
    if int(saved.get("lag", 0)) != lag:
        raise ResumeError(f"task.sampler.lag={lag}: {path} was made at task.sampler.lag={saved.get('lag', 0)}, and "
                          "its next steps' rollouts would be drawn by weights of another age than the run's; resume "
                          f"at task.sampler.lag={saved.get('lag', 0)}, or start a new run without ckpt_path")
    step = int(payload.get("step") or 0)
    queue = (ckpt.get("sampler_engine") or {}).get("queue") or []
    if lag and len(queue) < min(lag, step):
        raise ResumeError(f"task.sampler.lag={lag}: {path} holds the rollout engine's weights of {len(queue)} of the "
                          f"{min(lag, step)} steps before step {step}, so the next rollouts have no weights to be "
                          "drawn by; resume from a checkpoint this run wrote, or start a new run without ckpt_path")
