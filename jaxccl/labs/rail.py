"""A rail of real NICs on one machine: one process per rank, one shaped NIC per rank, hosts as namespaces.

MCCL's rail-optimized hosts give every GPU its own NIC, and a cut NIC can only be routed around
because the GPUs of a host also reach each other without it (NVLink). :class:`RailLab` builds
that on one machine:

- every emulated **host** is one network namespace (a node of a :class:`~jaxccl.labs.netlab.NetLab`);
- every **rank** is one process in its host's namespace with its **own NIC** there
  (``eth<local rank>``, a veth to the lab's bridge, shaped in both directions with HTB);
  source-address routing sends whatever a rank's process sends from its address out of its NIC;
- the ranks of one host reach each other over the namespace's loopback (the "NVLink": not
  shaped, far faster than a NIC);
- the transport of each process is restricted to its own NIC and the loopback
  (:meth:`RailLab.transport_options`), so bytes to another host cross exactly two shaped NICs.

:func:`rank_rail` is the :class:`~jaxccl.topology.Topology` of such a lab: MCCL's rail with the
NICs at the lab's rate and the loopback as NVLink. :meth:`RailLab.shape` cuts one rank's NIC live.

>>> from jaxccl.labs.netlab import LinkShape
>>> topo = rank_rail(2, 2, LinkShape(rate_mbit=100))
>>> topo.num_gpus, topo.capacity(0, "tor:s0r0")
(4, 12500000.0)
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence

from jaxccl.distributed.launch import LAB_COORDINATOR_PORT, collect
from jaxccl.distributed.transport import NETWORK_ONLY
from jaxccl.labs.netlab import LinkShape, NetLab
from jaxccl.labs.netlab.commands import NetlabError, in_namespace, run, shape_rate
from jaxccl.labs.netlab.lab import SUBNET, node_address
from jaxccl.topology import rail

__all__ = ["LOOPBACK_SPEEDUP", "RailLab", "rank_rail"]

LOOPBACK_SPEEDUP = 40  # "NVLink" capacity in NIC capacities: the loopback is never the bottleneck
_ROUTE_TABLE_BASE = 100


def rank_rail(hosts: int, gpus_per_host: int, nic: LinkShape):
    """The topology of a :class:`RailLab`: ``hosts x gpus_per_host`` ranks, every NIC shaped as ``nic``."""
    nic_gbps = nic.rate_bytes_per_s * 8 / 1e9
    return rail(hosts, gpus_per_host, nic_gbps=nic_gbps, nvlink_gbps=nic_gbps * LOOPBACK_SPEEDUP)


class RailLab:
    """Hosts as namespaces, one shaped NIC per rank; a context manager that removes everything it made.

    Args:
        hosts: emulated hosts (namespaces).
        gpus_per_host: ranks per host, one NIC each.
        shape: every NIC's shape.

    Rank ``r`` lives on host ``r // gpus_per_host`` with NIC ``eth<r % gpus_per_host>``.
    Everything sits in the namespaces of a :class:`~jaxccl.labs.netlab.NetLab` (its reaper and
    cleanup remove it all, also when the owner dies).

    Raises:
        NetlabError: namespaces are not available here, or a command failed.
    """

    def __init__(self, hosts: int, gpus_per_host: int, shape: LinkShape):
        if not isinstance(gpus_per_host, int) or gpus_per_host < 1:
            raise NetlabError(f"RailLab: gpus_per_host must be a positive integer, got {gpus_per_host!r}")
        self.hosts, self.gpus_per_host = hosts, gpus_per_host
        self.num_ranks = hosts * gpus_per_host
        self.lab = NetLab(hosts)
        self._initial = shape
        self._shapes: dict[int, LinkShape] = {}

    def __enter__(self) -> RailLab:
        self.lab.open()
        try:
            for r in range(self.num_ranks):
                self._add_nic(r)
            for h in range(self.hosts):
                self._route_by_source(h)
        except BaseException:
            self.lab.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.lab.close()

    # ------------------------------------------------------------------ names

    def host_of(self, rank: int) -> int:
        return rank // self.gpus_per_host

    def device(self, rank: int) -> str:
        """The NIC of ``rank`` inside its host's namespace."""
        return f"eth{rank % self.gpus_per_host}"

    def address(self, rank: int) -> str:
        """The address of ``rank``'s NIC (rank 0's is where the job's coordinator listens)."""
        h, local = divmod(rank, self.gpus_per_host)
        return node_address(h) if local == 0 else node_address(self.hosts + rank)

    def _switch_port(self, rank: int) -> str:
        return f"n{self.host_of(rank)}" if rank % self.gpus_per_host == 0 else f"r{rank}"

    def transport_options(self, rank: int) -> dict[str, str]:
        """UCX options for ``rank``'s process: its own NIC to other hosts, the loopback inside its host."""
        return {**NETWORK_ONLY, "NET_DEVICES": f"{self.device(rank)},lo", "MAX_RNDV_RAILS": "1"}

    # ------------------------------------------------------------------ building

    def _add_nic(self, rank: int) -> None:
        ns, dev, port = self.lab.namespace(self.host_of(rank)), self.device(rank), self._switch_port(rank)
        if rank % self.gpus_per_host:  # NetLab made eth0 of every host; the others are ours
            sw = self.lab.switch
            run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", ns])
            run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/16", "dev", dev])
            run(["ip", "-n", ns, "link", "set", dev, "up"])
        self.shape(rank, self._initial)

    def _route_by_source(self, host: int) -> None:
        # Several NICs in one subnet: answer ARP only on the NIC that holds the address, and send what a rank
        # sends from its address out of its own NIC (one routing table per NIC, chosen by source address).
        ns = self.lab.namespace(host)
        # The loopback gets a NIC's MTU, so that TCP inside a host segments as on the NICs. (Its 64 KiB MTU with
        # NETWORK_ONLY's small socket buffers was a suspect for the hang in the multi-process guide; not its cause.)
        run(["ip", "-n", ns, "link", "set", "lo", "mtu", "1500"])
        for key in ("arp_ignore=1", "arp_announce=2", "rp_filter=0"):
            for scope in ("all", "default"):
                run(in_namespace(ns, ["sysctl", "-q", "-w", f"net.ipv4.conf.{scope}.{key}"]))
        for local in range(self.gpus_per_host):
            rank = host * self.gpus_per_host + local
            dev, table = self.device(rank), str(_ROUTE_TABLE_BASE + local)
            run(in_namespace(ns, ["sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.rp_filter=0"]))
            address = self.address(rank)
            run(["ip", "-n", ns, "route", "add", SUBNET, "dev", dev, "src", address, "table", table])
            run(["ip", "-n", ns, "rule", "add", "from", address, "table", table])

    def shape(self, rank: int, shape: LinkShape) -> None:
        """Shapes ``rank``'s NIC in both directions now (HTB rate and ceiling); works live."""
        if not 0 <= rank < self.num_ranks:
            raise NetlabError(f"RailLab: rank {rank!r} is not one of 0..{self.num_ranks - 1}")
        fresh = rank not in self._shapes
        for ns, dev in (
            (self.lab.namespace(self.host_of(rank)), self.device(rank)),
            (self.lab.switch, self._switch_port(rank)),
        ):
            shape_rate(ns, dev, shape.rate_mbit, fresh=fresh)
        self._shapes[rank] = shape

    # ------------------------------------------------------------------ processes

    def launch(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 300.0,
        during: Callable[[list[subprocess.Popen]], None] | None = None,
    ):
        """Runs one process per rank (``argv`` each) in its host's namespace, as a JAX job; see
        :func:`~jaxccl.distributed.launch.launch`. Each process finds its UCX options in
        ``JAXCCL_UCX_OPTIONS`` (``key=value;...``)."""
        import os

        base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
        base.update(env or {})
        base["JAXCCL_COORDINATOR"] = f"{self.address(0)}:{LAB_COORDINATOR_PORT}"
        base["JAXCCL_NUM_PROCESSES"] = str(self.num_ranks)
        procs = []
        try:
            for r in range(self.num_ranks):
                options = ";".join(f"{k}={v}" for k, v in self.transport_options(r).items())
                penv = dict(base, JAXCCL_PROCESS_ID=str(r), JAXCCL_UCX_OPTIONS=options)
                kwargs = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=penv)
                procs.append(self.lab.popen(self.host_of(r), list(argv), **kwargs))
            if during is not None:
                during(procs)
            return collect(procs, timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def transport_options_from_env() -> dict[str, str]:
    """The UCX options :meth:`RailLab.launch` gave this process (empty outside a rail lab)."""
    import os

    text = os.environ.get("JAXCCL_UCX_OPTIONS", "")
    return dict(item.split("=", 1) for item in text.split(";") if item)
