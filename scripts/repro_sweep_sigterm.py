"""Reproduces issue 34's open race: SIGTERM to a sweep right after trial 1 starts, under CPU load, sometimes leaves the
sweep's MLflow parent run RUNNING (the process still exits 143). Run two busy loops beside it, e.g.
    for i in 1 2; do timeout 300 python3 -c "while True: pass" & done; python scripts/repro_sweep_sigterm.py
On 2026-11-27 the second of three attempts failed: `parent.stop`'s INSERT INTO tags (klbench.sweep.trials, '1 FINISHED,
1 RUNNING') raised an SQLAlchemy OperationalError 16 s later than a clean stop takes (MLflow's
SQLite sessions wait 20 s on a lock), and Hydra turned it into a warning. Prints each
attempt's exit code, time to exit and parent status, and the stderr of the first failure.
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
