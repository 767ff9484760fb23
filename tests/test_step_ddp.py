"""Each micro-batch's backward runs inside training_step (klbench/tasks/step.py) and Lightning's backward applies
their sum: under DDP the ranks' gradients are still reduced, every part of them. Two CPU processes whose samples
differ end with the same parameters, bit for bit, with micro-batches of 3 out of 8 sequences."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = r'''
import os, sys, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_config import compose_cfg
from klbench.tasks.train import run_task
import klbench.tasks.rl as rl


def on_train_end(self):
    theta = torch.cat([p.detach().flatten() for p in self.policy.trainable()])
    both = self.all_gather(theta)  # [2, D]
    moved = float((theta - self.start).abs().max())
    print(f"RANK {{self.global_rank}} gap {{float((both[0] - both[1]).abs().max())}} moved {{moved}}", flush=True)


def on_train_start(self):
    self.start = torch.cat([p.detach().flatten() for p in self.policy.trainable()]).clone()


rl.RLTask.on_train_end, rl.RLTask.on_train_start = on_train_end, on_train_start
run_task(compose_cfg(Path({out!r}), ["model=hf", "model.name_or_path={policy}", "model.ref_name_or_path={ref}",
                                "hardware=ddp", "hardware.accelerator=cpu", "hardware.devices=2", "task.max_steps=3",
                                "task.val_every=3", "logger=none", "task.prompts_per_step=2", "task.n_samples=4",
                                "task.micro_batch_size=3", "task.max_new_tokens=8", "task.val_prompts=2",
                                "estimator=loo"]))
'''


def test_ddp_ranks_stay_equal_with_micro_batches(tmp_path, tiny_arch):
    policy, ref = tiny_arch("llama")
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), out=str(tmp_path / "out"), policy=policy,
                                    ref=ref))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the two processes share the output: their lines may run together, so they are found anywhere in it
    number = r"([0-9.]+(?:e[+-]?[0-9]+)?)"
    found = re.findall(rf"RANK (\d) gap {number} moved {number}", proc.stdout)
    assert sorted(r for r, _, _ in found) == ["0", "1"], proc.stdout[-2000:]
    for rank, gap, moved in found:
        assert float(gap) == 0.0 and float(moved) > 1e-6, (rank, gap, moved)
