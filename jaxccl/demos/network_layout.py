"""The real-socket demo's layout: 2 emulated hosts x 4 ranks, which process holds which ranks, its links.

With ``--network netns`` every rank is one process with its own shaped NIC, and the ranks of a
host share that host's network namespace (a :class:`~jaxccl.labs.rail.RailLab`):
they reach each other over its loopback, the "NVLink", so a cut NIC can be routed around, as on
MCCL's rail-optimized hosts. The Topology is :func:`~jaxccl.labs.rail.rank_rail`
at the lab's NIC rate. With ``--network loopback`` there is no NIC: 2 processes (one per host, its
4 ranks sharing the process's memory; the default, for less start time on a small machine) or 8
(one per rank) talk over the machine's loopback, and the same Topology is the nominal one.

>>> process_of_rank(2)
[0, 0, 0, 0, 1, 1, 1, 1]
>>> check_processes("netns", 8), check_processes("loopback", 2)
(1, 4)
"""

from __future__ import annotations

from jaxccl.errors import DemoNetworkError
from jaxccl.labs.netlab import LinkShape
from jaxccl.labs.rail import rank_rail
from jaxccl.topology.presets import tor

HOSTS = 2
RANKS_PER_HOST = 4
NUM_RANKS = HOSTS * RANKS_PER_HOST
FAILED_RANK = 1  # its NIC is cut (rank 0's NIC carries the job's coordinator, as in the loop's drill)


def default_processes(network: str) -> int:
    """One process per rank on namespaces (a NIC each), one per host on loopback.

    >>> default_processes("netns"), default_processes("loopback")
    (8, 2)
    """
    return NUM_RANKS if network == "netns" else HOSTS


def check_processes(network: str, processes: int) -> int:
    """The number of ranks each of ``processes`` processes holds on ``network``.

    Raises:
        DemoNetworkError: the layout does not allow ``processes`` there.
    """
    if network == "netns" and processes != NUM_RANKS:
        raise DemoNetworkError(
            f"--processes {processes}: on --network netns every rank is a process with its own NIC (8 processes); "
            "with fewer, one NIC would carry several ranks and a cut one could not be routed around"
        )
    if processes not in (HOSTS, NUM_RANKS):
        raise DemoNetworkError(
            f"--processes {processes}: the demo runs 2 hosts x 4 ranks as 2 processes (one per host) or 8 "
            "(one per rank); a process never spans two hosts"
        )
    return NUM_RANKS // processes


def process_of_rank(processes: int) -> list[int]:
    """Which process holds each rank (consecutive ranks share a process)."""
    per = NUM_RANKS // processes
    return [r // per for r in range(NUM_RANKS)]


def demo_topology(nic_rate_mbit: float):
    """The Topology of the demo's links: MCCL's rail of 2 hosts x 4 GPUs, every NIC at ``nic_rate_mbit``.

    >>> demo_topology(100).capacity(FAILED_RANK, failed_link()[1])
    12500000.0
    """
    return rank_rail(HOSTS, RANKS_PER_HOST, LinkShape(rate_mbit=nic_rate_mbit))


def failed_link() -> tuple[int, str]:
    """The cut NIC as a Topology link (rank -> its rail's ToR).

    >>> failed_link()
    (1, 'tor:s0r1')
    """
    return FAILED_RANK, tor(0, FAILED_RANK % RANKS_PER_HOST)
