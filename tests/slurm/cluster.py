"""A private single-node SLURM cluster, with job accounting, for the tests.

    python tests/slurm/cluster.py start|stop|status      (as root; prints the env to export: SLURM_CONF=...)

Everything lives under $KLBENCH_SLURM_DIR (default /tmp/klbench-slurm): its own slurm.conf, munge socket,
MariaDB and state. Clients find it through SLURM_CONF alone (slurm.conf names the munge socket), so nothing
in /etc is read or written. `start` reuses a healthy cluster; otherwise it stops any leftovers from its
pid files and starts all daemons again, keeping the munge key, database and job state (job ids stay unique).

Why slurmdbd + MariaDB instead of a filter on submitit's "Bypassing sacct error" warning: submitit 1.5.4
learns a job's state only from `sacct -o JobID,State,NodeList` (no squeue or scontrol fallback), and Slurm
22.05 has no accounting storage besides slurmdbd (accounting_storage/none makes sacct exit 1). Without
it every state reads UNKNOWN, which submitit counts as unfinished: a job killed before writing its result
(scancel, timeout, node failure, OOM) would make job.wait()/results() spin forever, and job.state could
never say COMPLETED/FAILED/PREEMPTED. Hiding the warning would hide that bug; accounting removes it.
slurmdbd only stores to MySQL/MariaDB, hence a private MariaDB on loopback.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

BASE = Path(os.environ.get("KLBENCH_SLURM_DIR", "/tmp/klbench-slurm"))
# fixed ports so that a second `start` finds the first cluster; off Slurm's defaults (6817-6819) so a
# site installation on the same machine is left alone
PORT = int(os.environ.get("KLBENCH_SLURM_PORT", "6917"))  # slurmctld; slurmd, slurmdbd, MariaDB follow
CLUSTER = "klbench"
BINARIES = ["munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct"]
ETC, RUN, LOG, DB = BASE / "etc", BASE / "run", BASE / "log", BASE / "mariadb"
CONF = ETC / "slurm.conf"
MUNGE_DIR = BASE / "munge"  # munged wants to own its directory, open to all (clients use the socket)
MUNGE_SOCKET = MUNGE_DIR / "munge.socket"
# (pid file, process name), in start order
DAEMONS = [(MUNGE_DIR / "munged.pid", "munged"), (DB / "mariadbd.pid", "mariadbd"),
           (RUN / "slurmdbd.pid", "slurmdbd"), (RUN / "slurmctld.pid", "slurmctld"), (RUN / "slurmd.pid", "slurmd")]


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (slurmd starts jobs as their users)"
    absent = [b for b in BINARIES if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]
    if absent:
        return f"{', '.join(absent)} not installed: run .ci/install_servers.sh"
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError as e:
        return f"this host's name {host!r} does not resolve ({e}); the SLURM daemons bind to its address"
    if not ipaddress.ip_address(addr).is_loopback:
        # slurmctld and slurmdbd (Slurm 22.05) bind either to every interface or to the address of the host's
        # name (NoCtldInAddrAny, NoInAddrAny); the test cluster must not listen beyond loopback
        return f"this host's name {host!r} resolves to {addr}, not to a loopback address (see /etc/hosts)"
    return None


def env() -> dict[str, str]:
    return {"SLURM_CONF": str(CONF)}


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**os.environ, **env()}, capture_output=True, text=True, check=check,
                          timeout=timeout)


def _alive(pid: int, name: str) -> bool:
    """pid runs `name`: a stale pid file can name a pid since reused, and a zombie has stopped already."""
    try:
        comm, state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    except (OSError, ValueError):
        return False
    return name.startswith(comm.split("(", 1)[1]) and state.split()[0] != "Z"


def _pid(pidfile: Path, name: str) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if _alive(pid, name) else None


def _tail(log: Path | None) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log and log.exists() else ""


def _launch(cmd: list[str], log: Path, **kw) -> None:
    """Run a daemon that forks into the background; its errors, if it exits with one, in the exception."""
    r = subprocess.run(cmd, env={**os.environ, **env()}, capture_output=True, text=True, **kw)
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} exited {r.returncode}: {r.stderr.strip()}\n{log}:\n{_tail(log)}")


def _wait(ready, what: str, log: Path | None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s; {log}:\n{_tail(log)}")


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _chown(path: Path, user: str, mode: int) -> None:
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)
    path.chmod(mode)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def _configure(db_password: str, first_job_id: int = 1) -> None:
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    mem_mb = int(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 * 0.9)
    auth = f"AuthType=auth/munge\nSlurmUser=root\nAuthInfo=socket={MUNGE_SOCKET}"
    _write(CONF, f"""ClusterName={CLUSTER}
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={PORT}
SlurmdPort={PORT + 1}
# cred_expire: also how long a requeued (preempted) job waits before it may start again; 120 s by default
{auth},cred_expire=10
StateSaveLocation={BASE / "state"}
SlurmdSpoolDir={BASE / "spool"}
SlurmctldPidFile={RUN / "slurmctld.pid"}
SlurmdPidFile={RUN / "slurmd.pid"}
SlurmctldLogFile={LOG / "slurmctld.log"}
SlurmdLogFile={LOG / "slurmd.log"}
PlugStackConfig={ETC / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={PORT + 2}
# the munge socket for talking to slurmdbd (AuthInfo covers only slurmctld/slurmd traffic)
AccountingStoragePass={MUNGE_SOCKET}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
# bind to the addresses named here (loopback), not to every interface
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ReturnToService=2
JobRequeue=1
# finished jobs leave slurmctld after 5 s; sacct (what submitit polls) keeps them
MinJobAge=5
# SIGKILL 5 s after SIGTERM (scancel, time limit, preemption), not 30
KillWait=5
# a full scheduling pass every 2 s (default 60, backfill 30): jobs that could not start at submission
# (array tasks over the limit, requeued jobs) start within seconds of becoming eligible
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
# a job in `urgent` preempts jobs in `main`: SIGTERM, KillWait seconds, SIGKILL, requeued. No GraceTime:
# with it 22.05 does not preempt at all (the urgent job stays pending on Resources)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# the node description below is what the tests get, whatever the hardware says
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Sockets={cpus} CoresPerSocket=1 ThreadsPerCore=1 RealMemory={mem_mb} State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=2
""")
    # 22.05 has no CgroupPlugin=disabled; autodetect only loads, nothing above uses cgroups
    _write(ETC / "cgroup.conf", "CgroupPlugin=autodetect\n")
    _write(ETC / "plugstack.conf", "")
    # slurmdbd refuses a config readable by others (it holds the database password)
    _write(ETC / "slurmdbd.conf", f"""{auth}
# as slurm.conf's CommunicationParameters: bind to this host's name's address (loopback, see missing()),
# not to every interface; DbdAddr and DbdHost only tell others where slurmdbd is
CommunicationParameters=NoInAddrAny
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort={PORT + 2}
PidFile={RUN / "slurmdbd.pid"}
LogFile={LOG / "slurmdbd.log"}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={PORT + 3}
StorageUser=slurm
StoragePass={db_password}
StorageLoc=slurm_acct_db
""", 0o600)


def _start_munge() -> None:
    key = MUNGE_DIR / "munge.key"
    if not key.exists():
        key.write_bytes(secrets.token_bytes(1024))
    _chown(key, "munge", 0o400)
    MUNGE_SOCKET.unlink(missing_ok=True)
    _launch(["munged", f"--key-file={key}", f"--socket={MUNGE_SOCKET}", f"--pid-file={DAEMONS[0][0]}",
             f"--log-file={MUNGE_DIR / 'munged.log'}", f"--seed-file={MUNGE_DIR / 'munged.seed'}"],
            MUNGE_DIR / "munged.log", user="munge", group="munge")
    _wait(MUNGE_SOCKET.exists, "munged", MUNGE_DIR / "munged.log", 10)


def _start_mariadb(db_password: str) -> None:
    data = DB / "data"
    if data.exists() and data.stat().st_uid != pwd.getpwnam("mysql").pw_uid:  # packages reinstalled since
        subprocess.run(["chown", "-R", "mysql:mysql", str(DB)], check=True)
    if not (data / "mysql").exists():
        shutil.rmtree(data, ignore_errors=True)
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=mysql",
                        "--skip-test-db", "--auth-root-authentication-method=socket"],
                       check=True, capture_output=True)
    init = DB / "init.sql"  # run by mariadbd at every start: the password follows slurmdbd.conf
    _write(init, f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';\n"
                 f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{db_password}';\n"
                 "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';\n", 0o600)
    _chown(init, "mysql", 0o600)
    log = DB / "mariadbd.log"  # mariadbd writes as mysql: in its own directory
    cmd = ["mariadbd", "--no-defaults", f"--datadir={data}", "--user=mysql", f"--port={PORT + 3}",
           "--bind-address=127.0.0.1", f"--socket={DB / 'mysqld.sock'}", f"--pid-file={DAEMONS[1][0]}",
           f"--log-error={log}", f"--init-file={init}", "--skip-name-resolve", "--skip-log-bin",
           # small and lazy: a test database on a machine that runs other things
           "--innodb-buffer-pool-size=64M", "--innodb-flush-log-at-trx-commit=2", "--performance-schema=OFF"]
    # mariadbd does not fork: a new session keeps it alive after this process (the CLI's `start`) exits
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait(lambda: _port_open(PORT + 3) or proc.poll() is not None, "mariadbd", log)
    if proc.poll() is not None:
        raise RuntimeError(f"mariadbd exited {proc.returncode}; {log}:\n{_tail(log)}")


def _node_state() -> str:
    r = _run("sinfo", "-h", "-N", "-o", "%T", check=False)  # one line per partition, all the same
    return r.stdout.split()[0] if r.returncode == 0 and r.stdout.strip() else ""


UP = {"idle", "mixed", "allocated", "completing"}  # sinfo %T of a node that takes jobs


def listening() -> dict[str, list[str]]:
    """The TCP addresses ("127.0.0.1:6917") that each running daemon of this cluster listens on, from /proc."""
    out: dict[str, list[str]] = {}
    inodes: dict[str, str] = {}  # socket inode -> daemon
    for pidfile, name in DAEMONS:
        pid = _pid(pidfile, name)
        if pid is None:
            continue
        out[name] = []
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # exited meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes[link[8:-1]] = name
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()  # sl, local address, remote address, state (0A: LISTEN), ..., inode (10th)
            if cols[3] != "0A" or cols[9] not in inodes:
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)  # 32-bit words, each in the host's (little-endian) byte order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[inodes[cols[9]]].append(f"{socket.inet_ntop(family, raw)}:{int(hexport, 16)}")
    return out


def loopback_only(addresses: dict[str, list[str]]) -> bool:
    return all(ipaddress.ip_address(a.rsplit(":", 1)[0]).is_loopback for addrs in addresses.values() for a in addrs)


def healthy() -> bool:
    if not CONF.exists() or not all(_pid(*d) for d in DAEMONS):
        return False
    if not loopback_only(listening()):  # a cluster started by an older cluster.py: restart it
        return False
    return _node_state().rstrip("*") in UP


def _start_daemons() -> None:
    for d in (ETC, RUN, LOG, DB, BASE / "state", BASE / "spool"):
        d.mkdir(parents=True, exist_ok=True)
    MUNGE_DIR.mkdir(exist_ok=True)
    _chown(MUNGE_DIR, "munge", 0o755)
    _chown(DB, "mysql", 0o700)
    pw_file = ETC / "db_password"
    if not pw_file.exists():
        _write(pw_file, secrets.token_hex(16), 0o600)
    db_password = pw_file.read_text().strip()
    _configure(db_password)
    _start_munge()
    _start_mariadb(db_password)
    _launch(["slurmdbd"], LOG / "slurmdbd.log")
    _wait(lambda: _port_open(PORT + 2), "slurmdbd", LOG / "slurmdbd.log")
    # a lost or unreadable state dir restarts job ids at 1, ids the database already holds: sacct shows the
    # newest job of an id, and a new job not recorded yet would read as the old one, finished
    ids = _run("sacct", "-a", "-X", "-n", "-P", "-o", "JobIDRaw", "-S", "2000-01-01", "-E", "now").stdout.split()
    _configure(db_password, first_job_id=max((int(i) for i in ids if i.isdigit()), default=0) + 1)
    # -i: a state directory left by an older or killed run is read as far as it goes, not fatal
    _launch(["slurmctld", "-i"], LOG / "slurmctld.log")
    _wait(lambda: _run("scontrol", "ping", check=False).stdout.count("UP") > 0, "slurmctld", LOG / "slurmctld.log")
    _launch(["slurmd"], LOG / "slurmd.log")
    _wait(lambda: _node_state() != "", "slurmd", LOG / "slurmd.log")
    if _node_state().rstrip("*") in {"down", "drained", "draining"}:  # kept from a previous run's state
        _run("scontrol", "update", f"nodename={socket.gethostname()}", "state=resume", check=False)
    _wait(lambda: _node_state().rstrip("*") in UP, "node (up in sinfo)", LOG / "slurmd.log")


@contextmanager
def _lock():
    BASE.mkdir(parents=True, exist_ok=True)
    with open(BASE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def start() -> bool:
    """Start the cluster unless a healthy one is running; True when this call started it."""
    with _lock():
        if healthy():
            return False
        _stop_daemons()
        _start_daemons()
        return True


def _stop_daemons() -> None:
    if _pid(*DAEMONS[3]):  # no jobs left to outlive their cluster or to come back at the next start
        jobs = _run("squeue", "-h", "-o", "%A", check=False).stdout.split()
        if jobs:
            _run("scancel", *jobs, check=False)
            deadline = time.monotonic() + 15
            while _run("squeue", "-h", "-o", "%A", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
    for pidfile, name in reversed(DAEMONS):
        pid = _pid(pidfile, name)
        if pid:
            os.kill(pid, signal.SIGTERM)
            # the process, not its pid file (removed early by some): the next start needs its port
            deadline = time.monotonic() + 15
            while _alive(pid, name) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid, name):
                os.kill(pid, signal.SIGKILL)
        pidfile.unlink(missing_ok=True)


def stop() -> None:
    with _lock():
        _stop_daemons()


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd not in {"start", "stop", "status"}:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    if cmd != "status" and (why := missing()):
        print(f"cannot {cmd}: {why}", file=sys.stderr)
        return 1
    if cmd == "start":
        t = time.monotonic()
        started = start()
        print(f"# {'started' if started else 'reused'} in {time.monotonic() - t:.1f} s", file=sys.stderr)
    elif cmd == "stop":
        stop()
        return 0
    up = healthy()
    for k, v in env().items():
        print(f"export {k}={v}")
    if cmd == "status":
        addresses = listening()
        for pidfile, name in DAEMONS:
            where = ", ".join(addresses.get(name, [])) or "no TCP port"
            print(f"# {name}: {_pid(pidfile, name) or 'not running'} ({where})", file=sys.stderr)
    return 0 if up else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
