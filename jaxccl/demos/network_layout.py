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

from typing import Any

from jaxccl import synth
from jaxccl.errors import DemoNetworkError
from jaxccl.labs.netlab import LinkShape
from jaxccl.labs.rail import rank_rail
from jaxccl.synth.tree_reduce_scatter import tree_reduce_scatter
from jaxccl.topology.presets import tor

HOSTS = 2
RANKS_PER_HOST = 4
NUM_RANKS = HOSTS * RANKS_PER_HOST
FAILED_RANK = 1  # its NIC is cut by default (rank 0's NIC carries the job's coordinator, as in the loop's drill)
MAX_CHUNKS = 2  # chunks per shard of the demo's AllGather schedules (see demo_allgather)


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


def demo_allgather(topo: Any, previous: Any = None) -> Any:
    """The demo's AllGather synthesizer (the healthy schedule's and the controller's): at most
    ``MAX_CHUNKS`` chunks per shard, warm-started from ``previous``.

    Finer chunks would send quarter shards between processes, which finish in the socket's and
    the qdisc's buffers on these shaped links: their completion times would no longer measure the
    link, and the loop would see a cut NIC as recovered.

    >>> demo_allgather(demo_topology(200)).chunks_per_period <= MAX_CHUNKS
    True
    """
    return synth.all_gather(topo, previous=previous, max_chunks=MAX_CHUNKS)


def demo_reduce_scatter(topo: Any, previous: Any = None) -> Any:
    """The demo's ReduceScatter synthesizer (the healthy schedule's and the controller's): gloo's tree
    fold, routed for ``topo`` (:func:`jaxccl.synth.tree_reduce_scatter.tree_reduce_scatter`), so its sums
    are XLA's across processes bit for bit; at most ``MAX_CHUNKS`` chunks per shard, as
    :func:`demo_allgather`.

    >>> s = demo_reduce_scatter(demo_topology(200))
    >>> s.info["fold"], s.chunks_per_period <= MAX_CHUNKS
    ('gloo_tree', True)
    """
    return tree_reduce_scatter(topo, previous=previous, max_chunks=MAX_CHUNKS)


def failed_link(rank: int = FAILED_RANK) -> tuple[int, str]:
    """``rank``'s NIC as a Topology link (rank -> its rail's ToR).

    >>> failed_link(), failed_link(6)
    ((1, 'tor:s0r1'), (6, 'tor:s0r2'))
    """
    return rank, tor(0, rank % RANKS_PER_HOST)


def failed_links(cut_ranks: tuple[int, ...]) -> tuple[tuple[int, str], ...]:
    """The NICs of ``cut_ranks`` as Topology links, in their order.

    >>> failed_links((1, 6))
    ((1, 'tor:s0r1'), (6, 'tor:s0r2'))
    """
    return tuple(failed_link(r) for r in cut_ranks)


def check_cut_ranks(cut_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks whose NICs the netns demo cuts, checked: one or more, distinct, in range, never rank 0.

    >>> check_cut_ranks([1, 6])
    (1, 6)
    >>> check_cut_ranks((0,))
    Traceback (most recent call last):
    ...
    jaxccl.errors.DemoNetworkError: cut_ranks (0,): rank 0's NIC carries the job's coordinator; cut others (1..7)

    Raises:
        DemoNetworkError: the ranks are empty, repeated, out of range or include rank 0.
    """
    ranks = tuple(cut_ranks)
    if not ranks or any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
        raise DemoNetworkError(f"cut_ranks {ranks}: need one or more rank numbers (1..{NUM_RANKS - 1})")
    if 0 in ranks:
        raise DemoNetworkError(
            f"cut_ranks {ranks}: rank 0's NIC carries the job's coordinator; cut others (1..{NUM_RANKS - 1})"
        )
    if not all(0 < r < NUM_RANKS for r in ranks):
        raise DemoNetworkError(f"cut_ranks {ranks}: the demo has ranks 0..{NUM_RANKS - 1}")
    if len(set(ranks)) != len(ranks):
        raise DemoNetworkError(f"cut_ranks {ranks}: a rank is named twice")
    return ranks


def describe_cut(cut_ranks: tuple[int, ...]) -> str:
    """The cut NICs in words, for the demo's prints and its PNG.

    >>> print(describe_cut((1,)), "/", describe_cut((1, 6)))
    rank 1's NIC / the NICs of ranks 1 and 6
    """
    if len(cut_ranks) == 1:
        return f"rank {cut_ranks[0]}'s NIC"
    return f"the NICs of ranks {', '.join(map(str, cut_ranks[:-1]))} and {cut_ranks[-1]}"
