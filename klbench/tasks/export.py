"""`klbench-export <run folder or .ckpt> [--out DIR] [--adapter]`: a trained policy as a save_pretrained folder.

    klbench-export outputs/runs/2026-11-28/10-02-11-rl-rb              # -> <run>/hf: the policy, LoRA merged
    klbench-export outputs/runs/.../checkpoints/last.ckpt --adapter    # -> <run>/hf-adapter: the peft adapter

A run keeps its policy only in Lightning's last.ckpt (the trained weights; a LoRA run the adapter alone).
The export rebuilds the run's model from the config the checkpoint carries, loads the weights as
`task=probe ckpt_path=...` does (klbench.record.resume.load_policy_weights), and writes what transformers,
peft and vLLM load: the weights (merged into the base, or with --adapter the adapter that peft loads on the
base named in its adapter_config.json), the tokenizer with its chat template, and a generation_config holding
the sampling the run trained with (temperature, top_k, top_p, every stop id, max_new_tokens).

Bad input ends in one line and leaves nothing: a folder that is no run, a run that never checkpointed, a
target that exists (nothing is overwritten: the folder is written beside it and renamed into place at the end).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import shutil
import sys
import tempfile
from pathlib import Path

CKPT = Path("checkpoints") / "last.ckpt"


class ExportError(ValueError):
    """What the user gave cannot be exported; the message says why and what to give instead."""


def find_checkpoint(source: str) -> tuple[Path, Path]:
    """(the checkpoint, its run folder) for a run folder or a .ckpt; ExportError otherwise."""
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise ExportError(f"{source}: no such file or folder; give a run folder (outputs/runs/<date>/<time>-...) "
                          "or its checkpoints/last.ckpt")
    if path.is_file():
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, run
    if (path / CKPT).is_file():
        return path / CKPT, path
    if not (path / ".hydra" / "config.yaml").is_file() and not (path / "checkpoints").is_dir():
        raise ExportError(f"{path} is not a klbench run folder (it has no .hydra/config.yaml and no checkpoints/): "
                          "give a run folder (outputs/runs/<date>/<time>-...) or a .ckpt")
    raise ExportError(f"{path} never checkpointed: it has no {CKPT} (written at each validation, every "
                      "task.val_every steps, once training started), so there is no trained policy to export")


class Interrupted(Exception):
    """SIGTERM (or SIGHUP) during an export: raised where the export is, so that its hidden folder is removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def export(source: str, out: str | None = None, adapter: bool = False) -> Path:
    """Writes the folder and returns it; ExportError (or the load's own ConfigError / ResumeError) for bad input."""
    ckpt, run = find_checkpoint(source)
    target = Path(out).expanduser().resolve() if out else run / ("hf-adapter" if adapter else "hf")
    if os.path.lexists(target):
        raise ExportError(f"{target} exists; klbench-export never overwrites: give --out a path that does not exist")
    made = check_target(target)  # before anything is loaded: a large model takes minutes (issue 51)
    with on_signals(), hidden_folder(target, made) as tmp:
        from omegaconf import OmegaConf

        from klbench.record import resume
        data = resume.read_checkpoint(str(ckpt))  # ONE read: config, step and weights of one version
        payload = data["klbench"]
        cfg = OmegaConf.create(payload["config"])
        if cfg.model.kind == "tabular":
            raise ExportError(f"{ckpt} is a run of the tabular model (model=tabular), which is a table of logits, "
                              "not a language model: there is no save_pretrained form to export")
        lora = bool((cfg.model.get("lora") or {}).get("r"))
        if adapter and not lora:
            raise ExportError(f"--adapter: {ckpt}'s run trained the whole model (model.lora.r is null), so it has "
                              "no adapter; export it without --adapter")
        check_finite(data, ckpt)
        policy, step = load_policy(cfg, ckpt, data)
        from safetensors import SafetensorError
        try:
            write(policy, cfg, tmp, adapter)
        except (OSError, SafetensorError) as e:  # disk full, quota: one line, the hidden folder removed
            why = (e.strerror if isinstance(e, OSError) else None) or str(e).split("I/O error: ")[-1]
            raise ExportError(f"could not write {target}: {why}; nothing was left behind") from None
        if os.path.lexists(target):  # made while this export ran
            raise ExportError(f"{target} exists; klbench-export never overwrites: give --out a path that does not "
                              "exist")
        os.rename(tmp, target)
    what = "LoRA adapter" if adapter else "policy (LoRA merged into its base)" if lora else "policy"
    chat = " and chat template" if getattr(policy.tok, "chat_template", None) else ""
    max_steps = int(cfg.task.max_steps)
    when = (f"step {step}" if resume.finished(payload, cfg) else
            f"step {step} of {max_steps}, an unfinished run (still training, or stopped before task.max_steps)")
    print(f"klbench-export: wrote {target}: the {what} at {when} of {run}, its tokenizer{chat}, "
          f"and a generation_config with the run's sampling ({policy.sampling.describe()})")
    if adapter:  # peft loads the base's generation_config and never reads the adapter folder's (issue 51)
        print(f"klbench-export: peft samples with the base's generation_config, not this folder's: pass "
              f"generation_config=GenerationConfig.from_pretrained(\"{target}\") to generate() to sample as the "
              "run did")
    return target


PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[a-z0-9_]{8}")  # hidden_folder's name: .<target>.<pid>.<random>
LEGACY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}")  # what exports before issue 50 left (no pid in the name)


def check_target(target: Path) -> list[Path]:
    """ExportError, one line, unless `target`'s folder can be made and written; the folders made for it."""
    made, parent = [], target.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"cannot write {target}: {parent} is a file, not a folder; give --out a path in a folder")
    for folder in reversed(made):
        try:
            folder.mkdir()
        except OSError as e:
            remove_made(made)
            raise ExportError(f"cannot write {target}: making {folder} failed ({e.strerror or e}); give --out a "
                              "folder you can write") from None
    if not os.access(target.parent, os.W_OK | os.X_OK):  # root passes access() on a read-only mount: mkdtemp tells
        remove_made(made)
        raise ExportError(f"cannot write {target}: {target.parent} is not writable for this user; give --out a "
                          "folder you can write")
    return made


def remove_made(made: list[Path]) -> None:
    for folder in made:  # innermost first
        try:
            folder.rmdir()
        except OSError:
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(target: Path) -> None:
    """The hidden folders that exports to `target` left when killed (kill -9 gives no chance to clean up): those
    whose process is gone. A running export's folder is kept."""
    for p in target.parent.iterdir():
        m = PARTIAL.fullmatch(p.name) or LEGACY.fullmatch(p.name)
        if not m or m["name"] != target.name or not p.is_dir() or ("pid" in m.groupdict() and m["pid"]
                                                                    and alive(int(m["pid"]))):
            continue
        shutil.rmtree(p, ignore_errors=True)
        print(f"klbench-export: removed {p}, the unfinished folder of an export to {target} that was killed")


@contextlib.contextmanager
def hidden_folder(target: Path, made: list[Path]):
    """A folder beside `target`, renamed into place when whole, removed on any error or signal; with the mode
    save_pretrained's folders get (the umask's), not mkdtemp's 0700, so that a model server under another uid reads
    the export."""
    remove_stale(target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", dir=target.parent))
    except OSError as e:  # a read-only file system (root passes access() there), a full disk
        remove_made(made)
        raise ExportError(f"cannot write {target}: {e.strerror or e} in {target.parent}; give --out a folder you "
                          "can write") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made(made)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # renamed away when whole: nothing there then


@contextlib.contextmanager
def on_signals():
    """SIGTERM and SIGHUP raise Interrupted where the export is, so that its hidden folder is removed; the
    previous handlers are put back after."""
    def raise_(signum, frame):
        raise Interrupted(signum)
    before = {s: signal.signal(s, raise_) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def check_finite(data: dict, ckpt: Path) -> None:
    """ExportError naming the policy tensors holding NaN or inf: such a policy samples nothing."""
    import torch
    bad = [k for k, v in (data.get("state_dict") or {}).items()
           if k.startswith("policy.") and torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ExportError(f"{ckpt} holds non-finite policy weights (NaN or inf) in {len(bad)} tensor(s): "
                          f"{', '.join(b[len('policy.'):] for b in bad[:3])}{', ...' if len(bad) > 3 else ''}; "
                          "the run diverged or the file was altered: export an earlier checkpoint")


def load_policy(cfg, ckpt: Path, data: dict | None = None):
    """The run's policy with the checkpoint's weights, and the checkpoint's step (`data`: the checkpoint as read)."""
    from klbench.models.policies import build_policy, task_sampling
    from klbench.record import resume
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.get("cache"), cfg.get("teacher"),
                          *task_sampling(cfg.task), notices=False)  # the run's start-up notice: not the export's
    return policy, resume.load_policy_weights(policy, str(ckpt), cfg, data)


def generation_config(policy, max_new_tokens: int):
    """The sampling the run trained with, as generate() reads it. Built fresh: the folder's other options
    (repetition_penalty and the like) were not applied in training, so they are not carried over."""
    from transformers import GenerationConfig
    s, tok = policy.sampling, policy.tok
    eos = list(policy.eos_ids)
    return GenerationConfig(do_sample=True, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            max_new_tokens=max_new_tokens, eos_token_id=eos[0] if len(eos) == 1 else eos,
                            bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)


def write(policy, cfg, folder: Path, adapter: bool) -> None:
    from klbench.models.lora import is_lora
    model = policy.model
    if is_lora(model) and not adapter:
        model = model.merge_and_unload()  # W + B A into each wrapped layer; a plain transformers model again
    model.generation_config = generation_config(policy, int(cfg.task.max_new_tokens))
    model.save_pretrained(folder)
    if adapter:  # peft writes the adapter only; generate() reads the generation_config from the same folder
        model.generation_config.save_pretrained(folder)
    policy.tok.save_pretrained(folder)  # the chat template with it (chat_template.jinja)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="klbench-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run folder, or a klbench .ckpt")
    parser.add_argument("--out", help="the folder to write (must not exist); default <run folder>/hf or hf-adapter")
    parser.add_argument("--adapter", action="store_true", help="the peft LoRA adapter alone, not merged")
    args = parser.parse_args(argv)
    from klbench.config.errors import ConfigError
    from klbench.record.resume import ResumeError
    try:
        export(args.source, args.out, args.adapter)
    except (ExportError, ConfigError, ResumeError, FileNotFoundError) as e:
        sys.exit(f"klbench-export: error: {e}")
    except (Interrupted, KeyboardInterrupt) as e:  # the hidden folder is gone; 128 + the signal, as a shell expects
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"klbench-export: stopped by {signal.Signals(signum).name}; the unfinished folder was removed, "
              "nothing was written", file=sys.stderr)
        sys.exit(128 + signum)


if __name__ == "__main__":
    main()
