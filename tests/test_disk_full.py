"""A full disk under the record (issue 18): the store's creation and a run that fills the disk both end in
one line naming the path and the cause, and leave nothing that a later start misreads.

The disk is a small tmpfs mounted for the test (root only; skipped, saying why, elsewhere).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from klbench.record import runs
from test_record import client_of, env_for, klbench

ARGS = ["experiment=tabular", "task.max_steps=20", "task.val_every=10"]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 4 MiB at tmp_path/disk, unmounted after the test."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(disk: Path, leave_kib: int) -> Path:
    """Takes all but about `leave_kib` KiB of the disk. A run writing there meanwhile can take the last
    bytes first (the free space was read before): the disk is then full all the same."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    data = memoryview(b"\0" * max(0, free - leave_kib * 1024))
    with open(filler, "wb", buffering=0) as f:
        while data:
            try:
                data = data[f.write(data):]
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    return filler


def test_store_creation_on_a_full_disk(small_disk, tmp_path):
    """Creation fails midway: one line with the path and the cause; the half-made file is removed, so a
    start after freeing space creates the store instead of calling it old or half-migrated."""
    outputs = small_disk / "outputs"
    filler = fill(small_disk, 300)  # a fresh store needs about 1.2 MB
    proc = klbench(outputs, *ARGS, f"hydra.run.dir={tmp_path / 'r1'}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"cannot create the MLflow store {outputs / 'mlflow.db'}: the disk is full" in line, line
    assert not (outputs / "mlflow.db").exists()
    filler.unlink()
    again = klbench(outputs, *ARGS, f"hydra.run.dir={tmp_path / 'r2'}")
    assert again.returncode == 0, again.stderr[-3000:]


def test_disk_fills_during_a_run(small_disk):
    """The disk fills while a run trains: one line saying so, with where and the run's state. The run could
    not be marked FAILED (the store is on that disk); the next start after freeing space marks it KILLED."""
    outputs = small_disk / "outputs"
    run_dir = small_disk / "run"
    args = ["experiment=tabular", "task.max_steps=100000", "task.val_every=50", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "klbench.cli", *args], cwd=small_disk.parent,
                            env=env_for(outputs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (run_dir / "checkpoints" / "last.ckpt").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    filler = fill(small_disk, 0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("klbench: error: the disk is full") and str(small_disk) in line, line
    run_id = (run_dir / runs.RUN_ID_FILE).read_text().strip()
    assert f"MLflow run {run_id}" in line
    filler.unlink()
    client = client_of(outputs)
    marked = "is marked FAILED" in line
    assert client.get_run(run_id).info.status == ("FAILED" if marked else "RUNNING")
    klbench(outputs, "experiment=tabular", "task.max_steps=10", f"hydra.run.dir={small_disk / 'next'}")
    assert client.get_run(run_id).info.status == ("FAILED" if marked else "KILLED")


def test_a_store_write_on_a_full_disk_raises_without_mlflow_traceback(small_disk, tmp_path, capfd):
    """MLflow logs each failed SQLite write with its traceback before raising it; klbench says the raised
    error once (above, in one line), so that log record is dropped once klbench opens the store."""
    import mlflow
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException

    from klbench.record import store
    uri = store.tracking_uri(small_disk / "outputs")
    exp = store.ensure_experiment(uri, "full", None, template_dir=tmp_path / "cache")
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(exp).info.run_id
    capfd.readouterr()
    fill(small_disk, 0)
    with pytest.raises(MlflowException) as raised:
        for step in range(100):  # far more pages than the file has spare
            client.log_batch(run_id, metrics=[Metric(f"m{i}", 1.0, 0, step) for i in range(1000)])
    assert store.disk_full(raised.value)
    err = capfd.readouterr().err
    assert "SQLAlchemy database error" not in err and "Traceback" not in err, err[-3000:]
