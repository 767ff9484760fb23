"""Issue 43, "when things go wrong, round 4": each defect as the issue reproduced it, on real parts (tiny
save_pretrained folders, real klbench processes, real MLflow stores and Optuna studies). Each test failed on the
code before the fix."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klbench.record import runs
from test_record import all_runs, client_of, env_for


def klbench(outputs: Path, *overrides: str, env: dict | None = None, timeout: int = 300):
    return subprocess.run([sys.executable, "-m", "klbench.cli", *overrides], cwd=outputs.parent,
                          env={**env_for(outputs), **(env or {})}, capture_output=True, text=True, timeout=timeout)


def one_line_error(proc, *words: str) -> str:
    """The process failed with klbench's one line (no traceback), holding every one of `words`."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("klbench: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


# ---- 1, 3 and the base's fingerprint: what a LoRA checkpoint must hold to resume ----

def _lora_args(base: str, run_dir: Path, *extra: str) -> list[str]:
    # naive_mc at beta 1 moves the adapter off zero (the random model earns no reward), so that a resume from a
    # zeroed adapter would differ
    return ["model=hf", f"model.name_or_path={base}", "model.lora.r=4", "estimator=naive_mc", "estimator.beta=1.0",
            "task.prompts_per_step=4", "task.val_prompts=4", "task.max_new_tokens=8", "task.val_every=4",
            "task.log_every=1", f"hydra.run.dir={run_dir}", *extra]


def test_lora_resumes_refused_in_one_line_leave_the_finished_run(tmp_path, tiny_arch):
    base = str(shutil.copytree(tiny_arch("llama")[0], tmp_path / "base"))
    outputs, run_dir = tmp_path / "outputs", tmp_path / "D"
    first = klbench(outputs, *_lora_args(base, run_dir, "task.max_steps=8"))
    assert first.returncode == 0, first.stderr[-3000:]
    client = client_of(outputs)
    (run,) = all_runs(client)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    intact = ckpt.read_bytes()
    longer = ("task.max_steps=12", "ckpt_path=last")

    def unchanged() -> None:  # each refusal leaves the finished run as it was
        (now,) = all_runs(client)
        assert now.info.status == "FINISHED" and now.info.end_time == run.info.end_time
        assert now.data.tags[runs.STEPS_DONE] == "8"

    # 1. a checkpoint without the adapter's weights: resumed silently from a zero adapter before
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved["state_dict"] = {}
    torch.save(saved, ckpt)
    proc = klbench(outputs, *_lora_args(base, run_dir, *longer, "ckpt_allow_changes=[task.max_steps]"))
    one_line_error(proc, str(ckpt), "holds no weights for", "lora_A")
    unchanged()
    ckpt.write_bytes(intact)

    # 3. the rank changed on purpose: a 45-line size-mismatch traceback and a FAILED run before
    proc = klbench(outputs, *_lora_args(base, run_dir, *longer, "model.lora.r=8",
                                        "ckpt_allow_changes=[task.max_steps,model.lora.r]"))
    one_line_error(proc, "of shape [4, ", "model.lora.r (4 in the checkpoint, 8 now)")
    unchanged()

    # the base replaced at the same path (another model of the same architecture): resumed silently before
    for name in os.listdir(other := tiny_arch("llama")[1]):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(other, name), os.path.join(base, name))
    proc = klbench(outputs, *_lora_args(base, run_dir, *longer, "ckpt_allow_changes=[task.max_steps]"))
    one_line_error(proc, "other frozen weights", base)
    unchanged()

    # a finished run's deleted last.ckpt: "stopped before its first checkpoint" before
    ckpt.unlink()
    proc = klbench(outputs, *_lora_args(base, run_dir, *longer, "ckpt_allow_changes=[task.max_steps]"))
    one_line_error(proc, "FINISHED at step 8", "deleted or moved")
    unchanged()
