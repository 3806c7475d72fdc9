"""NCCL-like baselines: multi-channel rail-aligned rings, as NCCL builds them on rail-optimized clusters.

:mod:`jaxccl.synth.baselines` has the single-ring building blocks (every
channel follows one order). NCCL on a rail-optimized fabric runs one ring per
NIC: channel ``k`` enters and leaves every host through the GPUs of rails
``k-1`` and ``k``, so the channels together use every NIC of every host and
the inter-host hops always join two GPUs of the same rail. This module builds
those per-channel orders (:func:`rail_channel_orders`), merges per-channel
schedules into one multi-channel schedule (:func:`merge_channels`) and exposes
the baselines the simulator compares against:

- :func:`nccl_allgather`, :func:`nccl_reduce_scatter`, :func:`nccl_allreduce`
  (ring, or NCCL's double binary tree with ``method="tree"``);
- :func:`nccl_alltoall` (direct: one send/receive pair per peer, as NCCL's
  grouped point-to-point AllToAll);
- :func:`nccl_schedule` dispatching on the collective name.

Example:
    >>> from jaxccl.topology import rail
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> rail_channel_orders(topo, 2)
    [[0, 1, 2, 3, 7, 6, 5, 4], [1, 2, 3, 0, 4, 7, 6, 5]]
    >>> s = nccl_allgather(topo).validate()
    >>> s.chunks_per_period, s.info["channels"]
    (4, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Collective, Op, Schedule, Threadblock
from jaxccl.synth.baselines import (
    direct_alltoall,
    double_binary_tree_allreduce,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from jaxccl.util.options import choose, renamed

__all__ = [
    "METHODS",
    "merge_channels",
    "nccl_allgather",
    "nccl_allreduce",
    "nccl_alltoall",
    "nccl_reduce_scatter",
    "nccl_schedule",
    "rail_channel_orders",
]

METHODS = ("ring", "tree")  # nccl_allreduce's method= choices


def _gpus_per_host(topo: Any) -> int:
    return max(len(h) for h in topo.hosts)


def default_channels(topo: Any) -> int:
    """One ring per rail (NIC) when the topology has several hosts, else one."""
    hosts = topo.hosts
    return _gpus_per_host(topo) if len(hosts) > 1 else 1


def rail_channel_orders(topo: Any, channels: int | None = None) -> list[list[int]]:
    """NCCL-style rail-aligned ring orders, one per channel.

    Channel ``k`` walks even hosts ascending from local GPU ``k`` and odd hosts
    descending from local GPU ``k - 1`` (indices modulo the host size), so it
    leaves an even host and enters the next odd one on rail ``k - 1``, and
    leaves an odd host and enters the next even one on rail ``k``. Channel 0
    is :func:`jaxccl.synth.baselines.rail_ring_order`. With an odd number of
    hosts the closing hop crosses rails (NCCL routes it through PXN).

    Args:
        topo: a Topology with host information.
        channels: number of rings (default :func:`default_channels`).
    """
    ch = default_channels(topo) if channels is None else channels
    if not isinstance(ch, int) or isinstance(ch, bool) or ch < 1:
        raise ScheduleError(f"channels must be a positive integer, got {channels!r}")
    orders = []
    for k in range(ch):
        order: list[int] = []
        for h, gpus in enumerate(topo.hosts):
            g = sorted(gpus)
            n = len(g)
            if h % 2 == 0:
                order.extend(g[(k + i) % n] for i in range(n))
            else:
                order.extend(g[(k - 1 - i) % n] for i in range(n))
        orders.append(order)
    return orders


def _remap(off: int, c1: int, k: int, n_ch: int) -> int:
    """Chunk ``off`` of a ``c1``-chunk-period layout -> channel ``k``'s chunk of the merged layout."""
    return (off // c1) * c1 * n_ch + (off % c1) * n_ch + k


def merge_channels(schedules: Sequence[Schedule], *, name: str = "", info: dict[str, Any] | None = None) -> Schedule:
    """Runs ``K`` schedules of the same collective side by side as ``K`` channels of one schedule.

    Schedule ``k`` moves chunk class ``c`` of its own layout as class
    ``c * K + k`` of the merged layout (``C = K * C1``), so each takes ``1/K``
    of the data; its threadblocks keep their order and get channel
    ``k * (its channels) + channel``.

    >>> from jaxccl.synth.baselines import ring_allgather
    >>> merge_channels([ring_allgather(4), ring_allgather(4, order=[0, 2, 1, 3])]).validate().chunks_per_period
    2
    """
    if not schedules:
        raise ScheduleError("merge_channels needs at least one schedule")
    first = schedules[0]
    n_ch = len(schedules)
    c1 = first.chunks_per_period
    for s in schedules:
        if s.collective != first.collective or s.num_ranks != first.num_ranks or s.chunks_per_period != c1:
            raise ScheduleError("merge_channels needs schedules of one collective, rank count and chunks per period")
    width = 1 + max((tb.channel for s in schedules for tbs in s.ranks for tb in tbs), default=0)
    scratch = max(s.scratch_chunks for s in schedules)
    scratch_period = -(-scratch // c1) * c1 if scratch else 0
    ranks = []
    for r in range(first.num_ranks):
        tbs: list[Threadblock] = []
        for k, s in enumerate(schedules):
            base = len(tbs)
            for tb in s.ranks[r]:
                if any(op.count != 1 for op in tb.ops):
                    # chunk c of a period maps to c*K + k: a run of chunks would not stay contiguous
                    raise ScheduleError("merge_channels supports single-chunk ops only")
                ops = tuple(
                    Op(
                        op.kind,
                        op.src,
                        _remap(op.src_off, c1, k, n_ch),
                        op.dst,
                        _remap(op.dst_off, c1, k, n_ch),
                        op.count,
                        tuple((t + base, i) for t, i in op.deps),
                    )
                    for op in tb.ops
                )
                tbs.append(Threadblock(ops, tb.send_peer, tb.recv_peer, k * width + tb.channel))
        ranks.append(tuple(tbs))
    return Schedule(
        collective=first.collective,
        num_ranks=first.num_ranks,
        chunks_per_period=c1 * n_ch,
        ranks=tuple(ranks),
        scratch_chunks=scratch_period * n_ch,
        name=name or f"{first.name}x{n_ch}",
        info=dict(info or {}),
    )


def _check_topo(topo: Any, what: str) -> None:
    if not hasattr(topo, "hosts") or not hasattr(topo, "num_gpus"):
        raise ScheduleError(f"{what} needs a Topology, got {type(topo).__name__}")


def nccl_allgather(topo: Any, *, channels: int | None = None) -> Schedule:
    """NCCL's ring AllGather: one rail-aligned ring per channel (:func:`rail_channel_orders`)."""
    _check_topo(topo, "nccl_allgather")
    orders = rail_channel_orders(topo, channels)
    parts = [ring_allgather(topo, order=o) for o in orders]
    info = {"algorithm": "ring", "channels": len(orders), "orders": orders, "baseline": "nccl"}
    return merge_channels(parts, name="nccl_allgather", info=info)


def nccl_reduce_scatter(topo: Any, *, channels: int | None = None) -> Schedule:
    """NCCL's ring ReduceScatter over rail-aligned rings (not rank-ordered)."""
    _check_topo(topo, "nccl_reduce_scatter")
    orders = rail_channel_orders(topo, channels)
    parts = [ring_reduce_scatter(topo, order=o) for o in orders]
    info = {"algorithm": "ring", "channels": len(orders), "orders": orders, "baseline": "nccl"}
    info["ordered_reduction"] = topo.num_gpus <= 2
    return merge_channels(parts, name="nccl_reduce_scatter", info=info)


def nccl_allreduce(
    topo: Any, *, channels: int | None = None, method: str = "ring", algorithm: str | None = None
) -> Schedule:
    """NCCL's AllReduce: rail-aligned rings (``method="ring"``) or the double binary tree (``method="tree"``).

    ``algorithm=`` is the deprecated old name of ``method=`` (removed in the next release).

    Raises:
        OptionError: ``method`` is not ``"ring"`` or ``"tree"``.

    >>> from jaxccl.topology import rail
    >>> nccl_allreduce(rail(hosts=2, gpus_per_host=2), method="tree").name
    'nccl_allreduce_tree'
    """
    method = choose("method", renamed("nccl_allreduce", "algorithm", algorithm, "method", method, "ring"), METHODS)
    _check_topo(topo, "nccl_allreduce")
    if method == "tree":
        s = double_binary_tree_allreduce(topo)
        return s.replace(name="nccl_allreduce_tree", info={**s.info, "baseline": "nccl"})
    orders = rail_channel_orders(topo, channels)
    parts = [ring_allreduce(topo, order=o) for o in orders]
    info = {"algorithm": "ring", "channels": len(orders), "orders": orders, "baseline": "nccl"}
    info["ordered_reduction"] = topo.num_gpus <= 2
    return merge_channels(parts, name="nccl_allreduce", info=info)


def nccl_alltoall(topo: Any) -> Schedule:
    """NCCL's AllToAll: direct point-to-point exchanges with every peer (routes as the topology's)."""
    s = direct_alltoall(topo)
    return s.replace(name="nccl_alltoall", info={**s.info, "baseline": "nccl"})


_BY_NAME = {
    Collective.ALL_GATHER: nccl_allgather,
    Collective.REDUCE_SCATTER: nccl_reduce_scatter,
    Collective.ALL_REDUCE: nccl_allreduce,
    Collective.ALL_TO_ALL: nccl_alltoall,
}


def nccl_schedule(collective: Collective | str, topo: Any, **kwargs: Any) -> Schedule:
    """The NCCL-like baseline for ``collective`` (``"all_gather"``, ``"all_to_all"``, ...) on ``topo``."""
    try:
        fn = _BY_NAME[Collective(collective)]
    except ValueError as e:
        raise ScheduleError(f"unknown collective {collective!r}") from e
    return fn(topo, **kwargs)
