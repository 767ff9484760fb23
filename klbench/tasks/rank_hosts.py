"""Where each rank of a multi-process run runs: its node's name and the address its collectives use, gathered once
per attempt, logged by rank 0 and kept as the MLflow tag `klbench.rank_hosts` (docs/scale-out.md, "Two nodes").

The address is gloo's: the address of the interface GLOO_SOCKET_IFNAME names when it is set, else the address the
host's own name resolves to (torch's default gloo device binds that one). On a cluster each node's is its own;
on one machine klbench points gloo at loopback (klbench.tasks.train.local_ddp_store).
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

import lightning.pytorch as pl

log = logging.getLogger(__name__)
TAG = "klbench.rank_hosts"


def _interface_address(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFADDR: the interface's IPv4 address
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def this_host() -> tuple[str, str]:
    """(host name, the address gloo binds on this host)."""
    host = socket.gethostname()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        addr = _interface_address(ifname.split(",")[0]) if ifname else socket.gethostbyname(host)
    except OSError as e:  # gloo would fail on it too; the record says why instead of an address
        addr = f"unresolved ({e})"
    return host, addr


def text(hosts: list[tuple[str, str]]) -> str:
    """"0=klb-n1/10.200.0.2 1=klb-n2/10.200.0.3": rank=host/address, in rank order."""
    return " ".join(f"{rank}={host}/{addr}" for rank, (host, addr) in enumerate(hosts))


class RankHosts(pl.Callback):
    """Gathers every rank's this_host() at the first setup of a run with a process group (all ranks take part)."""

    def __init__(self) -> None:
        self.done = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import torch.distributed as dist
        if self.done or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        self.done = True
        hosts: list = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, this_host())  # [world] of (host, address), by global rank
        if not trainer.is_global_zero:
            return
        line = text(hosts)
        log.info("ranks: %s", line)
        client, run_id = getattr(trainer.logger, "client", None), getattr(trainer.logger, "run_id", None)
        if client is not None and run_id is not None:  # the RecordLogger (logger=mlflow): this attempt's placement
            client.set_tag(run_id, TAG, line)
