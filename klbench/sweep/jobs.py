"""The trial jobs of a sweep, read from submitit's folders: which still live, and what each returned.

A sweep's launcher config puts every job in `<sweep dir>/.submitit/<job id>/` (conf/hydra/launcher).
A SLURM job has a `<id>_submission.sh` there and is asked about with squeue; a job of submitit's local
executor is a process on this host, its id a pid. When a job ends, task 0 writes `<id>_0_result.pkl`:
("success", the trial's JobReturn) or ("error", a traceback).

Used by a restarted sweep to take over the trials its dead predecessor launched. A result file is a
pickle, and unpickling runs code, so one is read only from a sweep folder this user's own sweep recorded
(`record_sweep_dir`, `recorded_sweep_dir`: a file in the outputs folder that only this user can have
written), and only when the file and every folder from the sweep folder down to it are this user's and
writable by no one else (`unsafe`). No torch here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import socket
import stat
import time
from pathlib import Path

from klbench.record.runs import slurm_jobs_alive

log = logging.getLogger(__name__)
POLL_S = 5.0
REGISTRY = Path(".klbench") / "sweeps"  # under the outputs folder: <key>.json per study, its latest sweep folder


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


def wait(folder: Path) -> None:
    """Returns when no job under this .submitit folder is pending or running."""
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


def unsafe(path: Path, root: Path, st: os.stat_result | None = None) -> str | None:
    """Why `path` (at or under the folder `root`) may hold what someone else wrote, or None: it and every
    folder from root down to it must be this user's, no symbolic link, writable by no one else, and a
    file must have no second name (a hard link). `st`: the file's fstat, to check what was opened."""
    uid = os.getuid()
    chain = [root, *(root / Path(*path.relative_to(root).parts[:i + 1])
                     for i in range(len(path.relative_to(root).parts)))]
    for i, p in enumerate(chain):
        s = st if (st is not None and i == len(chain) - 1) else os.lstat(p)
        if stat.S_ISLNK(s.st_mode):
            return f"{p} is a symbolic link"
        if s.st_uid != uid:
            return f"{p} is owned by uid {s.st_uid}, not by this user (uid {uid})"
        if s.st_mode & 0o022:
            return f"{p} is writable by its group or by others (mode {stat.filemode(s.st_mode)})"
        if stat.S_ISREG(s.st_mode) and s.st_nlink != 1:
            return f"{p} has {s.st_nlink} names (hard links)"
    return None


def _open_own(path: Path, root: Path):
    """The file opened for reading if `unsafe` finds nothing against it, checked again on what was opened
    (the name may change hands in between); None, with a warning, otherwise."""
    try:
        why = unsafe(path, root)
        if why is None:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            why = unsafe(path, root, os.fstat(fd))
            if why is None:
                return os.fdopen(fd, "rb")
            os.close(fd)
    except OSError as e:
        why = str(e)
    log.warning("not reading %s: %s", path, why)
    return None


def results(sweep_dir: Path) -> list:
    """The JobReturn of every job under `<sweep_dir>/.submitit` that ended, from result files that pass
    `unsafe` below sweep_dir (the rest are refused, each with a warning)."""
    sweep_dir = Path(sweep_dir).resolve()
    folder = sweep_dir / ".submitit"
    if not folder.is_dir():
        return []
    returns = []
    for result in sorted(folder.glob("*/*_0_result.pkl")):
        f = _open_own(result, sweep_dir)
        if f is None:
            continue
        try:
            with f:
                outcome, value = pickle.load(f)
        except Exception as e:  # a truncated file from a killed job: no result
            log.warning("unreadable job result %s (%s): ignored", result, e)
            continue
        # a trial that raised still succeeds as a job: Hydra returns it as a JobReturn with status FAILED.
        # "error" means the launcher itself failed, and tells nothing about the trial
        if outcome == "success" and getattr(value, "overrides", None) is not None:
            returns.append(value)
    return returns


# ---- one sweep process per study: the same command started again while it runs is refused ----

_claims: dict[Path, int] = {}  # the lock files this process holds, by path: their open descriptors


class StudyBusy(RuntimeError):
    """Another live process runs this study (the same sweep command, or one with the same study name)."""


def claim(outputs: Path, study: str, storage: str) -> None:
    """Makes this process the one that runs `study` until it ends: an exclusive lock (flock) on the study's
    lock file in the outputs folder's registry, which the system releases when the process ends (kill -9
    included). Raises StudyBusy, naming the process that holds it. `storage`: the URL without its password.
    Two processes running one study would each run the trials it lacks (duplicates that TPE then samples
    from), and each would take the other's RUNNING trials for a dead sweep's."""
    import fcntl
    path = _registry_file(outputs, study, storage).with_suffix(".lock")
    if path in _claims:
        return
    (outputs / REGISTRY.parent).mkdir(mode=0o700, parents=True, exist_ok=True)
    (outputs / REGISTRY).mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        for _ in range(20):  # the holder writes its name just after it takes the lock
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            if holder:
                break
            time.sleep(0.05)
        os.close(fd)
        raise StudyBusy(f"study {study!r} in {storage} is being run by {holder or 'another process'}: "
                        "wait for it to end and run this command again (it then resumes the study), or give "
                        "this sweep a study of its own with hydra.sweeper.study_name=<new name>") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()} (since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}, lock {path})".encode(), 0)
    _claims[path] = fd


def release_claims() -> None:
    """Ends this process's claims (the sweep's end; the process's end does it too)."""
    while _claims:
        os.close(_claims.popitem()[1])


# ---- which sweep folder was a study's: recorded by this user, never taken from the study database ----

def _registry_file(outputs: Path, study: str, storage: str) -> Path:
    key = hashlib.sha256(f"{storage}\n{study}".encode()).hexdigest()[:32]
    return outputs / REGISTRY / f"{key}.json"


def record_sweep_dir(outputs: Path, study: str, storage: str, sweep_dir: Path) -> None:
    """Notes `sweep_dir` as the study's latest sweep folder, in a file only this user can write (0600, in
    0700 folders). `storage`: the storage URL without its password."""
    path = _registry_file(outputs, study, storage)
    try:
        (outputs / REGISTRY.parent).mkdir(mode=0o700, parents=True, exist_ok=True)
        (outputs / REGISTRY).mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"study": study, "storage": storage, "sweep_dir": str(Path(sweep_dir).resolve()),
                       "host": socket.gethostname(), "uid": os.getuid(), "time": time.time()}, f)
        os.replace(tmp, path)
    except OSError as e:  # a resume then finds no folder to take results from, and says so
        log.warning("could not record this sweep's folder in %s: %s", path, e)


def recorded_sweep_dir(outputs: Path, study: str, storage: str) -> Path | None:
    """The study's latest sweep folder as this user recorded it (record_sweep_dir); None when there is no
    record or the record could have been written by someone else."""
    path = _registry_file(outputs, study, storage)
    if not path.exists():
        return None
    f = _open_own(path, path.parent)
    if f is None:
        return None
    with f:
        try:
            rec = json.loads(f.read().decode())
        except ValueError as e:
            log.warning("unreadable record %s (%s): ignored", path, e)
            return None
    if rec.get("study") != study or rec.get("storage") != storage:
        return None
    return Path(rec["sweep_dir"])


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
