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
import os
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


def export(source: str, out: str | None = None, adapter: bool = False) -> Path:
    """Writes the folder and returns it; ExportError (or the load's own ConfigError) for bad input."""
    ckpt, run = find_checkpoint(source)
    target = Path(out).expanduser().resolve() if out else run / ("hf-adapter" if adapter else "hf")
    if os.path.lexists(target):
        raise ExportError(f"{target} exists; klbench-export never overwrites: give --out a path that does not exist")
    from omegaconf import OmegaConf

    from klbench.record import resume
    try:
        cfg = OmegaConf.create(resume.load_payload(str(ckpt))["config"])
    except resume.ResumeError as e:
        raise ExportError(str(e).split(" so it is not loaded")[0].rstrip(",")) from None
    if cfg.model.kind == "tabular":
        raise ExportError(f"{ckpt} is a run of the tabular model (model=tabular), which is a table of logits, not a "
                          "language model: there is no save_pretrained form to export")
    lora = bool((cfg.model.get("lora") or {}).get("r"))
    if adapter and not lora:
        raise ExportError(f"--adapter: {ckpt}'s run trained the whole model (model.lora.r is null), so it has no "
                          "adapter; export it without --adapter")
    policy, step = load_policy(cfg, ckpt)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # renamed into place when whole
    try:
        write(policy, cfg, tmp, adapter)
        if os.path.lexists(target):  # made while this export ran
            raise ExportError(f"{target} exists; klbench-export never overwrites: give --out a path that does not exist")
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    what = "LoRA adapter" if adapter else "policy (LoRA merged into its base)" if lora else "policy"
    chat = " and chat template" if getattr(policy.tok, "chat_template", None) else ""
    print(f"klbench-export: wrote {target}: the {what} at step {step} of {run}, its tokenizer{chat}, "
          f"and a generation_config with the run's sampling ({policy.sampling.describe()})")
    return target


def load_policy(cfg, ckpt: Path):
    """The run's policy with the checkpoint's weights, and the checkpoint's step."""
    from klbench.models.policies import build_policy, task_sampling
    from klbench.record import resume
    policy = build_policy(cfg.model, cfg.task.max_new_tokens, cfg.paths.get("cache"), cfg.get("teacher"),
                          *task_sampling(cfg.task), notices=False)  # the run's start-up notice: not the export's
    return policy, resume.load_policy_weights(policy, str(ckpt), cfg)


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
    try:
        export(args.source, args.out, args.adapter)
    except (ExportError, ConfigError, FileNotFoundError) as e:
        sys.exit(f"klbench-export: error: {e}")


if __name__ == "__main__":
    main()
