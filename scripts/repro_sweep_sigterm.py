"""Reproduces issue 34's open race: SIGTERM to a sweep right after trial 1 starts, under CPU load, sometimes leaves the
sweep's MLflow parent run RUNNING (the process still exits 143). Run two busy loops beside it, e.g.
    for i in 1 2; do timeout 300 python3 -c "while True: pass" & done; python scripts/repro_sweep_sigterm.py
On 2026-11-27 the second of three attempts failed: `parent.stop`'s INSERT INTO tags (klbench.sweep.trials, '1 FINISHED,
1 RUNNING') raised an SQLAlchemy OperationalError 16 s later than a clean stop takes (MLflow's
SQLite sessions wait 20 s on a lock), and Hydra turned it into a warning. Prints each
attempt's exit code, time to exit and parent status, and the stderr of the first failure.
"""
import os, signal, subprocess, sys, time, tempfile
from pathlib import Path
for attempt in range(3):
    d = Path(tempfile.mkdtemp()); out, sw = d/"outputs", d/"sweep"
    env = {**os.environ, "KLBENCH_OUTPUTS": str(out), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "klbench"), "-m", "sweep=rl_beta", "experiment=tabular", "task.val_every=20",
        "task.max_steps=300", "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sw}"], env=env, cwd=d,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (sw/"1"/"mlflow_run_id.txt").exists():
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM); t = time.time()
    o, e = p.communicate(timeout=200)
    from mlflow import MlflowClient
    c = MlflowClient(f"sqlite:///{out}/mlflow.db")
    st = c.get_run((sw/"mlflow_parent_run_id.txt").read_text().strip()).info.status
    print(attempt, "rc", p.returncode, "after", round(time.time()-t,1), "s parent", st, flush=True)
    if st != "KILLED":
        print("STDERR:", e[-3000:]); break
