"""A run's status must say what happened: who owns a RUNNING run, and noticing the ones whose process died.

Every klbench run (and sweep parent run) is tagged with the host, pid and process start time of the
process that drives it. A RUNNING run whose process is gone (`kill -9`, an out-of-memory kill, a
power cut) can write nothing itself; whatever opens the store next on that host (a new or resumed
run, a resumed sweep, `klbench-pareto`) marks it KILLED. Runs owned by another host are left alone:
from here we cannot tell whether their process lives.

No torch, Lightning or Hydra here.
"""
from __future__ import annotations

import os
import socket
import time

HOST, PID, PID_START = "klbench.host", "klbench.pid", "klbench.pid_start"
STEPS_DONE, MAX_STEPS = "klbench.steps_done", "klbench.max_steps"
ERROR, ENDED = "klbench.error", "klbench.ended"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with the pid, it
    tells a live process from a later one that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tags() -> dict[str, str]:
    pid = os.getpid()
    return {HOST: socket.gethostname(), PID: str(pid), PID_START: _start_time(pid) or ""}


def owner_alive(tags: dict[str, str]) -> bool | None:
    """True or False for a run owned by a process on this host; None when that cannot be told from here."""
    if tags.get(HOST) != socket.gethostname() or not tags.get(PID, "").isdigit():
        return None
    if not os.path.isdir("/proc/self"):
        return None  # no procfs: no way to tell a reused pid
    start = _start_time(int(tags[PID]))
    return start is not None and start == tags.get(PID_START)


def reap(client, experiment_ids: list[str], noticed_by: str) -> list[str]:
    """Marks KILLED every RUNNING run in these experiments whose owning process on this host is gone;
    returns their ids."""
    if not experiment_ids:
        return []
    dead = []
    for run in client.search_runs(experiment_ids, "attributes.status = 'RUNNING'", max_results=50000):
        if owner_alive(run.data.tags) is False:
            rid = run.info.run_id
            client.set_tag(rid, ENDED, f"process {run.data.tags[PID]} on {run.data.tags[HOST]} is gone; "
                                       f"noticed by {noticed_by} at {time.strftime('%Y-%m-%d %H:%M:%S')}")
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
