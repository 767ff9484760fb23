import importlib.util
import logging
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm


def _cluster_module():
    """cluster.py, loaded by path as conftest.py loads it (the module keeps no state of its own)."""
    path = Path(__file__).with_name("cluster.py")
    spec = importlib.util.spec_from_file_location("klbench_tests_slurm_cluster_t", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_daemons_listen_on_loopback_only(slurm_cluster):
    """docs/scale-out.md: the cluster listens on 127.0.0.1 only (slurmdbd listened on 0.0.0.0 until its
    slurmdbd.conf said NoInAddrAny)."""
    cluster = _cluster_module()
    addresses = cluster.listening()
    for name in ("mariadbd", "slurmdbd", "slurmctld", "slurmd"):
        assert addresses.get(name), (name, addresses)
    assert cluster.loopback_only(addresses), addresses


def _final_state(job, timeout=30):
    """sacct hears of a job's end a moment after its result file appears."""
    deadline = time.monotonic() + timeout
    while not job.watcher.is_done(job.job_id, mode="force") and time.monotonic() < deadline:
        time.sleep(0.5)
    return job.watcher.get_state(job.job_id, mode="cache")


def test_sbatch_runs(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    subprocess.run(["sbatch", "--wait", "-o", str(out), "--wrap", "echo hello from $SLURM_JOB_ID"],
                   check=True, timeout=60, capture_output=True)
    assert out.read_text().startswith("hello from ")


def _executor(folder):
    import submitit
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1, slurm_partition="main")
    return ex


def test_submitit_job_state_from_sacct(slurm_cluster, tmp_path, caplog, capfd):
    import submitit
    ex = _executor(tmp_path)
    with caplog.at_level(logging.DEBUG, logger="submitit"):
        ok = ex.submit(pow, 2, 10)  # stdlib functions: the job needs no import of this test module
        bad = ex.submit(int, "not a number")
        assert ok.result() == 1024
        with pytest.raises(submitit.core.utils.FailedJobError, match="ValueError"):
            bad.result()
        assert _final_state(ok) == "COMPLETED"
        assert _final_state(bad) == "FAILED"
    logged = caplog.text + "".join(capfd.readouterr())
    assert "Command sacct" in logged  # the states above came from sacct calls ...
    assert "Bypassing sacct error" not in logged  # ... none of which failed


def test_job_killed_by_slurm_is_done(slurm_cluster, tmp_path):
    """No result file will ever come: only sacct's state tells submitit the job is over (without accounting
    job.wait() would spin forever)."""
    job = _executor(tmp_path).submit(time.sleep, 600)
    job.cancel()
    assert _final_state(job).startswith("CANCELLED")
    assert job.done()
