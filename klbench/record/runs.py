"""A run's status must say what happened: who owns a RUNNING run, and noticing the ones whose process died.

Every klbench run (and sweep parent run) is tagged with the host, pid and process start time of the
process that drives it, and with its SLURM job id inside a SLURM job. A RUNNING run whose process is
gone (`kill -9`, an out-of-memory kill, a power cut) can write nothing itself; whatever opens the store
next on that host (a new or resumed run, a resumed sweep, `klbench-pareto`) marks it KILLED. A run owned
by another host is marked KILLED only when it ran in a SLURM job that the cluster no longer knows as
pending, running or requeued; otherwise it is left alone: from here we cannot tell whether it lives.

No torch, Lightning or Hydra here.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

HOST, PID, PID_START = "klbench.host", "klbench.pid", "klbench.pid_start"
SLURM_JOB = "klbench.slurm_job"  # <array job>_<task> for an array task, else the job id
STEPS_DONE, MAX_STEPS = "klbench.steps_done", "klbench.max_steps"
ERROR, ENDED = "klbench.error", "klbench.ended"
RUN_ID_FILE = "mlflow_run_id.txt"  # in a run's folder: its MLflow run id, so a resume continues that run


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it
    tells a live process from a later one that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def slurm_job_id() -> str | None:
    """This process's SLURM job, named as squeue and sacct name it; None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def slurm_jobs_alive(job_ids: list[str], running: bool = False) -> set[str] | None:
    """The ones among these SLURM jobs that are pending, running, requeued or ending; None without squeue.
    `running`: only those running or ending, whose processes exist now. A job pending again after a requeue (a node
    lost, a preemption) holds no process: its run's owner is gone until the next attempt starts (issue 52)."""
    if not job_ids or not shutil.which("squeue"):
        return None if job_ids else set()
    # -r: one line per array task, so "12_3" is matched as such; an id the cluster forgot prints nothing
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %t", "-j", ",".join(job_ids)], capture_output=True,
                         text=True, timeout=60)
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return None  # the controller did not answer: say nothing rather than guess
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]  # "7 R", "7 PD", "12_3 CG"
    return {r[0] for r in rows if not running or r[1] in ("R", "CG", "SO", "ST", "S", "RS", "SI")} & set(job_ids)


def owner_tags() -> dict[str, str]:
    pid = os.getpid()
    tags = {HOST: socket.gethostname(), PID: str(pid), PID_START: _start_time(pid) or ""}
    if job := slurm_job_id():
        tags[SLURM_JOB] = job
    return tags


def owner_alive(tags: dict[str, str], slurm_alive: set[str] | None = None) -> bool | None:
    """True or False for a run owned by a process on this host, or by a SLURM job; None when that cannot
    be told from here. `slurm_alive`: the live jobs among those asked about already (one squeue call)."""
    if tags.get(HOST) != socket.gethostname() or not tags.get(PID, "").isdigit():
        job = tags.get(SLURM_JOB)
        if job:
            alive = slurm_jobs_alive([job], running=True) if slurm_alive is None else slurm_alive
            return None if alive is None else job in alive
        return None
    if not os.path.isdir("/proc/self"):
        return None  # no procfs: no way to tell a reused pid
    start = _start_time(int(tags[PID]))
    return start is not None and start == tags.get(PID_START)


def reap(client, experiment_ids: list[str], noticed_by: str) -> list[str]:
    """Marks KILLED every RUNNING run in these experiments whose owning process is known to be gone;
    returns their ids."""
    if not experiment_ids:
        return []
    running = client.search_runs(experiment_ids, "attributes.status = 'RUNNING'", max_results=50000)
    jobs = sorted({r.data.tags[SLURM_JOB] for r in running if r.data.tags.get(SLURM_JOB)})
    slurm_alive = slurm_jobs_alive(jobs, running=True)  # a requeued job's pending attempt runs nothing yet
    dead = []
    for run in running:
        if owner_alive(run.data.tags, slurm_alive) is False:
            rid, tags = run.info.run_id, run.data.tags
            who = f"process {tags.get(PID)} on {tags.get(HOST)}" + (f", SLURM job {tags[SLURM_JOB]}"
                                                                   if tags.get(SLURM_JOB) else "")
            client.set_tag(rid, ENDED, f"{who} is gone; noticed by {noticed_by} at "
                                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
            client.set_terminated(rid, "KILLED")
            dead.append(rid)
    return dead


def progress(client, run_id: str, steps_done: int, max_steps: int | None = None) -> None:
    client.set_tag(run_id, STEPS_DONE, str(int(steps_done)))
    if max_steps is not None:
        client.set_tag(run_id, MAX_STEPS, str(int(max_steps)))


def completed(tags: dict[str, str]) -> tuple[bool, str]:
    """(True, "") when the run reached its max_steps, else (False, why)."""
    done, total = tags.get(STEPS_DONE), tags.get(MAX_STEPS)
    if done is None or total is None:
        return False, f"no {STEPS_DONE} tag (not made by this klbench)"
    if int(done) < int(total):
        return False, f"stopped at step {done} of {total}"
    return True, ""
