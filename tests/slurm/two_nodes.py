"""A private two-node SLURM cluster on this one machine, for the multi-node tests (issue 52).

    python tests/slurm/two_nodes.py start|stop|status     (as root; prints the env to export: SLURM_CONF=...)

Each node is a `slurmd` in network, UTS and mount namespaces of its own: its own interface and address on a
private bridge (10.200.0.0/24 by default, KLBENCH_SLURM2_NET), its own host name (klb-n1, klb-n2), its own
/etc/hosts (bind-mounted inside its mount namespace only; the machine's /etc is never written), spool, log and
pid files. Jobs inherit their node's namespaces, so a rank on klb-n2 reaches klb-n1 over the bridge as it
would reach another machine, and gloo binds the address its node's name resolves to, never loopback.

The controller is a slurmctld of its own (cluster `klbench2n`), in the machine's network namespace, bound to the
bridge's address (10.200.0.1, reachable from the nodes and from this machine, from nowhere else). The
single-node cluster's slurmctld cannot serve: it binds loopback (cluster.missing), which no other network
namespace reaches. Munge (a Unix socket, the same path in every namespace) and slurmdbd with its MariaDB are
the single-node cluster's (cluster.py), which must be up first; `stop` stops only what this file started,
and removes the namespaces and the bridge.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _single_node():
    """cluster.py, the single-node cluster (munge socket, slurmdbd port, helpers), loaded by path as conftest does
    (`import cluster` would depend on sys.path and could meet another `cluster`)."""
    import importlib.util
    name = "klbench_tests_slurm_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("cluster.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


one = _single_node()

BASE = Path(os.environ.get("KLBENCH_SLURM2_DIR", "/tmp/klbench-slurm-2n"))
NET = ipaddress.ip_network(os.environ.get("KLBENCH_SLURM2_NET", "10.200.0.0/24"))
PORT = one.PORT + 10  # this slurmctld; slurmd one above (each node's own address, so one port serves both)
CLUSTER = "klbench2n"
NODES = ["klb-n1", "klb-n2"]
PARTITION = "two"
CTL_NAME = "klb-ctl"
BRIDGE = "klb2n-br"
HOSTS_ADDR = list(NET.hosts())
CTL_ADDR = str(HOSTS_ADDR[0])
ADDR = {n: str(HOSTS_ADDR[i + 1]) for i, n in enumerate(NODES)}  # klb-n1: 10.200.0.2, klb-n2: 10.200.0.3
ETC, RUN, LOG = BASE / "etc", BASE / "run", BASE / "log"
CONF, HOSTS = ETC / "slurm.conf", ETC / "hosts"


def netns(node: str) -> str:
    return f"klb2n-{node.split('-')[-1]}"  # klb2n-n1


def _veth(node: str) -> str:
    return f"klb2n-h{node.split('-')[-1][1:]}"  # host side of the node's veth pair: klb2n-h1


def env() -> dict[str, str]:
    return {"SLURM_CONF": str(CONF)}


def missing() -> str | None:
    """Why this machine cannot run the two-node cluster, or None."""
    if (why := one.missing()) is not None:
        return why
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return f"{tool} not installed (iproute2, util-linux): run .ci/install_servers.sh"
    probe = "klb2n-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"network namespaces unavailable here (ip netns add: {r.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for line in used.splitlines():
        iface, addr = line.split()[1], ipaddress.ip_interface(line.split()[3])
        if iface != BRIDGE and addr.network.overlaps(NET):
            return f"{NET} is in use on {iface} ({addr}): set KLBENCH_SLURM2_NET to a free private /24"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _network_up() -> None:
    if _ip("link", "show", BRIDGE, check=False).returncode:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{CTL_ADDR}/{NET.prefixlen}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    existing = _ip("netns", "list").stdout
    for node in NODES:
        ns, host = netns(node), _veth(node)
        if ns not in existing:
            _ip("netns", "add", ns)
        if _ip("link", "show", host, check=False).returncode:
            _ip("link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ADDR[node]}/{NET.prefixlen}", "dev", "eth0")
        _ip("link", "set", host, "master", BRIDGE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", "eth0", "up")  # no default route: the nodes reach the bridge's /24 only


def _network_down() -> None:
    for node in NODES:
        _ip("link", "del", _veth(node), check=False)  # takes the peer in the namespace with it
        _ip("netns", "del", netns(node), check=False)
    _ip("link", "del", BRIDGE, check=False)


def _configure() -> None:
    for d in (ETC, RUN, LOG, BASE / "state", *(BASE / "spool" / n for n in NODES)):
        d.mkdir(parents=True, exist_ok=True)
    # every namespace's /etc/hosts: the nodes' names resolve to their bridge addresses (Lightning's MASTER_ADDR
    # is the first name of SLURM_NODELIST; gloo binds the address of its own host name)
    one._write(HOSTS, "127.0.0.1 localhost\n" + f"{CTL_ADDR} {CTL_NAME}\n"
               + "".join(f"{a} {n}\n" for n, a in ADDR.items()))
    main = one.CONF.read_text()
    auth = next(line for line in main.splitlines() if line.startswith("AuthType"))
    acct = [line for line in main.splitlines() if line.startswith(("AccountingStorage", "AuthInfo"))]
    one._write(CONF, f"""ClusterName={CLUSTER}
SlurmctldHost={CTL_NAME}({CTL_ADDR})
SlurmctldPort={PORT}
SlurmdPort={PORT + 1}
{auth}
{chr(10).join(a for a in acct if not a.startswith("AuthInfo"))}
AuthInfo=socket={one.MUNGE_SOCKET},cred_expire=10
StateSaveLocation={BASE / "state"}
SlurmdSpoolDir={BASE / "spool" / "%n"}
SlurmctldPidFile={RUN / "slurmctld.pid"}
SlurmdPidFile={RUN / "slurmd-%n.pid"}
SlurmctldLogFile={LOG / "slurmctld.log"}
SlurmdLogFile={LOG / "slurmd-%n.log"}
PlugStackConfig={one.ETC / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ReturnToService=2
JobRequeue=1
MinJobAge=5
KillWait=5
# a node whose slurmd stops answering is DOWN after 10 s (default 300): the node-loss test's job fails over
SlurmdTimeout=10
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
NodeName=DEFAULT CPUs=1 Sockets=1 CoresPerSocket=1 ThreadsPerCore=1 RealMemory=4096 State=UNKNOWN
""" + "".join(f"NodeName={n} NodeHostname={n} NodeAddr={a}\n" for n, a in ADDR.items())
        + f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP\n")
    _copy = ETC / "cgroup.conf"
    one._write(_copy, "CgroupPlugin=autodetect\n")


def _in_node(node: str | None, cmd: list[str]) -> list[str]:
    """cmd inside the node's namespaces (None: the controller's: this machine's network, its own name): a host
    name of its own (UTS), and the cluster's hosts file over /etc/hosts in a private mount namespace."""
    name = CTL_NAME if node is None else node
    inner = f"mount --bind {HOSTS} /etc/hosts && hostname {name} && exec \"$@\""
    wrap = ["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c", inner, "sh", *cmd]
    # nsenter, not `ip netns exec`: that one remounts /sys for the namespace, hiding /sys/fs/cgroup from slurmd
    return wrap if node is None else ["nsenter", f"--net=/run/netns/{netns(node)}", *wrap]


def _pidfile(node: str) -> Path:
    return RUN / f"slurmd-{node}.pid"


def _nodes_state() -> dict[str, str]:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env={**os.environ, **env()}, capture_output=True,
                       text=True, timeout=30)
    return dict(line.split() for line in r.stdout.splitlines() if line.strip()) if r.returncode == 0 else {}


def healthy() -> bool:
    if not CONF.exists() or not one._pid(RUN / "slurmctld.pid", "slurmctld"):
        return False
    if not all(one._pid(_pidfile(n), "slurmd") for n in NODES):
        return False
    states = _nodes_state()
    return all(states.get(n, "").rstrip("*") in one.UP for n in NODES)


def start_node(node: str) -> None:
    """The node's slurmd (again, after stop_node), and the node resumed should SLURM hold it DOWN."""
    one._launch(_in_node(node, ["slurmd", "-f", str(CONF), "-N", node]), LOG / f"slurmd-{node}.log")
    one._wait(lambda: one._pid(_pidfile(node), "slurmd"), f"slurmd {node}", LOG / f"slurmd-{node}.log", 30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = _nodes_state().get(node, "").rstrip("*")
        if state in one.UP:
            return
        if state.startswith(("down", "drain")):
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env={**os.environ, **env()},
                           capture_output=True)
        time.sleep(0.3)
    raise RuntimeError(f"node {node} not up after 30 s: {_nodes_state()}\n{one._tail(LOG / f'slurmd-{node}.log')}")


def stop_node(node: str, sig: int = 9) -> None:
    """The node lost: its slurmd and every process in its network namespace (its jobs) killed with `sig`."""
    pids = subprocess.run(["ip", "netns", "pids", netns(node)], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass


def _start() -> None:
    _network_up()
    _configure()
    one._launch(_in_node(None, ["slurmctld", "-f", str(CONF), "-i"]), LOG / "slurmctld.log")
    one._wait(lambda: subprocess.run(["scontrol", "ping"], env={**os.environ, **env()}, capture_output=True,
                                     text=True).stdout.count("UP") > 0, "slurmctld (two nodes)", LOG / "slurmctld.log")
    for node in NODES:
        start_node(node)


@contextmanager
def _lock():
    BASE.mkdir(parents=True, exist_ok=True)
    with open(BASE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def start() -> bool:
    """Starts the two-node cluster unless a healthy one runs (the single-node cluster must be up: its munge and
    slurmdbd serve this one too); True when this call started it."""
    with _lock():
        if healthy():
            return False
        _stop()
        _start()
        return True


def _stop() -> None:
    if one._pid(RUN / "slurmctld.pid", "slurmctld"):
        jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env={**os.environ, **env()}, capture_output=True,
                              text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env={**os.environ, **env()}, capture_output=True)
    for node in NODES:
        if netns(node) in _ip("netns", "list", check=False).stdout:
            stop_node(node)
        _pidfile(node).unlink(missing_ok=True)
    pid = one._pid(RUN / "slurmctld.pid", "slurmctld")
    if pid:
        os.kill(pid, 15)
        deadline = time.monotonic() + 15
        while one._alive(pid, "slurmctld") and time.monotonic() < deadline:
            time.sleep(0.1)
        if one._alive(pid, "slurmctld"):
            os.kill(pid, 9)
    (RUN / "slurmctld.pid").unlink(missing_ok=True)
    time.sleep(0.2)  # the killed processes leave the namespaces before they go
    _network_down()


def stop() -> None:
    with _lock():
        _stop()


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd not in {"start", "stop", "status"}:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    if cmd == "start":
        if why := missing():
            print(f"cannot start: {why}", file=sys.stderr)
            return 1
        one.start()
        t = time.monotonic()
        print(f"# {'started' if start() else 'reused'} in {time.monotonic() - t:.1f} s", file=sys.stderr)
    elif cmd == "stop":
        stop()
        return 0
    for k, v in env().items():
        print(f"export {k}={v}")
    print(f"# nodes: {_nodes_state()}", file=sys.stderr)
    return 0 if healthy() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
