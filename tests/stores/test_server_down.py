"""The MLflow server goes away mid-run (issue 18): the run ends in one line that says what failed, what
became of the MLflow run and how to resume; pasted once the server is back, that command finishes the
same run. MLflow's own retries are cut to one here (MLFLOW_HTTP_REQUEST_MAX_RETRIES; how long its default
rides out: docs/record.md), so the test takes seconds, not minutes."""
from __future__ import annotations

import shlex
import subprocess
import sys
import time

import mlflow
import pytest

from klbench.cli import hydra_override
from klbench.record import runs
from test_record import env_for

pytestmark = pytest.mark.servers


@pytest.mark.slow  # 77 s on the 2-core CI VM (docs/testing.md)
def test_run_outlives_its_server_then_resumes(own_mlflow_server, tmp_path):
    server = own_mlflow_server
    # spaces, quotes, backslashes (one at the end), non-ASCII: the printed command must still paste
    run_dir = tmp_path / "run folder 'é' a\\b\"q\\"  # ends in a backslash
    env = {**env_for(tmp_path / "outputs"), "MLFLOW_TRACKING_URI": server.url,
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    args = ["experiment=tabular", "task.max_steps=100000", "task.val_every=100", hydra_override("hydra.run.dir", str(run_dir))]
    proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (run_dir / "checkpoints" / "last.ckpt").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    server.stop()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    run_id = (run_dir / runs.RUN_ID_FILE).read_text().strip()
    assert line.startswith(f"klbench: error: the MLflow server {server.url} does not answer; MLflow run {run_id} "
                           "could not be marked FAILED"), line
    command = line.split("resume it from last.ckpt: ", 1)[1]
    assert command.startswith("klbench ") and command.endswith("ckpt_path=last")

    server.start()  # back, on the same port and store: the printed command, pasted, finishes the run
    argv = [a if not a.startswith("task.max_steps=") else "task.max_steps=200" for a in shlex.split(command)[1:]]
    resumed = subprocess.run([sys.executable, "-m", "klbench.cli", *argv, "ckpt_allow_changes=[task.max_steps]"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "View run" not in resumed.stdout, resumed.stdout[-2000:]  # klbench's own link ends the run's output
    r = mlflow.MlflowClient(server.url).get_run(run_id)
    assert r.info.status == "FINISHED" and r.data.tags[runs.STEPS_DONE] == "200"
