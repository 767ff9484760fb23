"""Reproduces issue 34's race: SIGTERM to a sweep right after trial 1 starts, under CPU load, left the sweep's MLflow
parent run RUNNING (the process still exited 143). Run two busy loops beside it, e.g.
    for i in 1 2; do timeout 300 python3 -c "while True: pass" & done; python scripts/repro_sweep_sigterm.py
Cause (docs/record.md): the signal landed inside one of MLflow's SQLite writes, and SQLite kept the closed connection's
write lock while the interrupt's traceback referenced one of its statements, so `parent.stop`'s tag write waited 20 s
on its own process and failed. 4 of 24 attempts failed before klbench.record.interrupts deferred a signal past store
writes, freed the traceback and raised a signal Lightning let pass (raise_noted); 0 of 10 after. Prints each attempt's exit code, time to exit and parent status, and
the stderr of the first failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient

KLBENCH = os.path.join(os.path.dirname(sys.executable), "klbench")

for attempt in range(3):
    root = Path(tempfile.mkdtemp())
    outputs, sweep = root / "outputs", root / "sweep"
    env = {**os.environ, "KLBENCH_OUTPUTS": str(outputs), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([KLBENCH, "-m", "sweep=rl_beta", "experiment=tabular", "task.val_every=20",
                             "task.max_steps=300", "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}"],
                            env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (sweep / "1" / "mlflow_run_id.txt").exists():  # trial 1 has just started
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    _, err = proc.communicate(timeout=200)
    parent = (sweep / "mlflow_parent_run_id.txt").read_text().strip()
    status = MlflowClient(f"sqlite:///{outputs}/mlflow.db").get_run(parent).info.status
    print(f"attempt {attempt}: exit {proc.returncode} after {time.time() - sent:.1f} s, parent {status}", flush=True)
    if status != "KILLED":
        print("stderr:", err[-3000:])
        break
