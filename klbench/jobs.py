"""The trial jobs of a sweep, read from submitit's folders: which still live, and what each returned.

A sweep's launcher config puts every job in `<sweep dir>/.submitit/<job id>/` (conf/hydra/launcher).
A SLURM job has a `<id>_submission.sh` there and is asked about with squeue; a job of submitit's local
executor is a process on this host, its id a pid. When a job ends, task 0 writes `<id>_0_result.pkl`:
("success", the trial's JobReturn) or ("error", a traceback).

Used by a restarted sweep to take over the trials its dead predecessor launched. No torch here.
"""
from __future__ import annotations

import logging
import math
import pickle
import time
from pathlib import Path

from klbench.runs import slurm_jobs_alive

log = logging.getLogger(__name__)
POLL_S = 5.0


def _local_alive(job_id: str) -> bool:
    try:
        return b"submitit" in Path(f"/proc/{int(job_id)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False


def alive(folder: Path) -> list[str]:
    """Ids of the jobs under this .submitit folder that are pending or running (or cannot be told)."""
    if not folder.is_dir():
        return []
    dirs = [d for d in folder.iterdir() if d.is_dir()]
    slurm = [d.name for d in dirs if (d / f"{d.name}_submission.sh").is_file() or "_" in d.name]
    local = [d.name for d in dirs if d.name not in slurm and _local_alive(d.name)]
    if not slurm:
        return local
    live = slurm_jobs_alive(slurm)
    if live is None:  # no squeue here, or the controller is down: cannot tell, so assume they still run
        unfinished = [j for j in slurm if not (folder / j / f"{j}_0_result.pkl").is_file()]
        if unfinished:
            raise RuntimeError(f"cannot ask SLURM about the jobs {unfinished} of the previous sweep process "
                               "(squeue missing or failing); rerun where squeue works, or scancel them")
        return local
    return local + sorted(live)


def wait_and_collect(folder: Path) -> list:
    """Waits until no job under `folder` runs, then returns the JobReturn of every job that ended."""
    waited = 0.0
    while live := alive(folder):
        if waited == 0:
            log.warning("waiting for %d trial job(s) the previous sweep process left running (%s); their "
                        "results join the study. scancel/kill them to run those trials again instead",
                        len(live), ", ".join(live))
        elif waited % 60 < POLL_S:
            log.info("still waiting for %s (%.0f s)", ", ".join(live), waited)
        time.sleep(POLL_S)
        waited += POLL_S
    returns = []
    for result in sorted(folder.glob("*/*_0_result.pkl")) if folder.is_dir() else []:
        try:
            with open(result, "rb") as f:
                outcome, value = pickle.load(f)
        except Exception as e:  # a truncated file from a killed job: no result
            log.warning("unreadable job result %s (%s): ignored", result, e)
            continue
        # a trial that raised still succeeds as a job: Hydra returns it as a JobReturn with status FAILED.
        # "error" means the launcher itself failed, and tells nothing about the trial
        if outcome == "success" and getattr(value, "overrides", None) is not None:
            returns.append(value)
    return returns


def objective_values(ret, n_objectives: int) -> list[float] | None:
    """The trial's objectives as the sweeper would tell them, or None when the job failed."""
    status = getattr(getattr(ret, "status", None), "name", None)
    if status != "COMPLETED":
        return None
    value = ret._return_value  # .return_value re-raises a failure
    try:
        values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    except (TypeError, ValueError):
        return None
    if len(values) != n_objectives or not all(math.isfinite(v) for v in values):
        return None
    return values
