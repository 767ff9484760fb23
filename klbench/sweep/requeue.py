"""A trial's job that SLURM requeued after a node failure is still the trial's: the sweep keeps waiting for it.

SLURM requeues a batch job whose node failed (JobRequeue=1, its default): the attempt ends NODE_FAIL and the same
job id is pending again, to run once enough nodes are up; the trial then resumes from its last.ckpt
(klbench.sweep.trial). submitit 1.5 learns a job's state from `sacct -o JobID,State,NodeList` alone, which shows
the failed attempt's NODE_FAIL until the next attempt starts, and counts NODE_FAIL as finished: the sweep took
the trial for dead while SLURM ran it again (issue 52's node-loss test, 1 try in 1). Installed in the sweeper's
process (klbench.sweep.callback): a NODE_FAIL that squeue still lists (pending or running) reads as PENDING.
No torch here.
"""
from __future__ import annotations

import logging

from klbench.record.runs import slurm_jobs_alive

log = logging.getLogger(__name__)
REQUEUED_STATES = ("NODE_FAIL",)  # preemption and time limits requeue through submitit itself (USR2)


def _still_queued(info: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """sacct's {job id: {"State": ...}} with each requeued NODE_FAIL job that squeue still lists as PENDING."""
    failed = [j for j, stats in info.items() if stats.get("State", "").split()[0:1] == ["NODE_FAIL"]]
    if not failed:
        return info
    live = slurm_jobs_alive(failed) or set()
    for job in sorted(live):
        log.warning("SLURM job %s lost a node (NODE_FAIL) and is queued again: waiting for its next attempt, "
                    "which resumes the trial from its last checkpoint", job)
        info[job] = {**info[job], "State": "PENDING"}
    return info


def install() -> None:
    """Wraps submitit's SLURM state reader in this process (idempotent)."""
    from submitit.slurm.slurm import SlurmInfoWatcher
    read = SlurmInfoWatcher.read_info
    if getattr(read, "klbench_requeue", False):
        return

    def read_info(self, string):
        return _still_queued(read(self, string))

    read_info.klbench_requeue = True
    SlurmInfoWatcher.read_info = read_info
