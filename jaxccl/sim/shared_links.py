"""Group collectives that run at once and share links: the fluid (link-load) model.

The groups of one kind (every DP group of a training step, say) run their
collective at the same time. On their own GPUs and NICs they never meet; a
group collective that relays through GPUs outside the group
(``jaxccl.synth.all_gather(topo, group=...)``, :mod:`jaxccl.synth.group`)
crosses the NICs and NVLinks of the *other* groups of its hosts, which carry
those groups' own traffic at the same moment.

The event simulator cannot run a relayed schedule: a message of a schedule
is a transfer between two of its ranks, which the simulator sends over the
primary route between them, while the synthesizer planned it over relays; the
planned routes survive only as the schedule's per-link chunk counts
(``info["link_chunks"]``). This module adds those loads up over every group on
the cluster's links and takes the time of the busiest link, plus the
latency of filling the deepest tree: the fluid limit that a schedule's
``algbw`` states for one schedule alone (the simulator reaches it within a few
percent on large messages, ``tests/sim/test_sim.py``), for several at once.

>>> from jaxccl.synth import all_gather
>>> from jaxccl.topology import rail
>>> topo = rail(hosts=2, gpus_per_host=2)
>>> groups = [[0, 2], [1, 3]]
>>> loads = [link_bytes(all_gather(topo, group=g), topo, g, 1e6) for g in groups]
>>> alone = fluid_time(topo, loads[:1])
>>> both = fluid_time(topo, loads)
>>> bool(alone < both)
True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Collective, Schedule
from jaxccl.synth.group import RELAY_PREFIX
from jaxccl.topology import Topology

__all__ = ["fluid_time", "link_bytes"]

Link = tuple[Hashable, Hashable]


def _node(name: Hashable, members: Sequence[int]) -> Hashable:
    """A node of a group's view (rank, relay or switch) as a node of the topology the group was synthesized on."""
    if isinstance(name, int):
        return int(members[name])
    if isinstance(name, str) and name.startswith(RELAY_PREFIX):
        return int(name[len(RELAY_PREFIX) :])
    return name


def link_bytes(schedule: Schedule, topo: Topology, members: Sequence[int], bytes_per_rank: float) -> dict[Link, float]:
    """Bytes that one call of a synthesized group collective puts on every link of ``topo``.

    Args:
        schedule: an AllGather or ReduceScatter of the tree packings
            (``info["link_chunks"]``, ``info["k"]``), synthesized on ``topo``
            with ``group=members`` or on ``topo`` itself (then ``members`` is
            every GPU, in order).
        topo: the topology the schedule was synthesized on.
        members: the GPUs of ``topo`` that hold the schedule's ranks, in rank order.
        bytes_per_rank: input bytes per rank of one call.

    Raises:
        ScheduleError: the schedule carries no per-link loads, or a load on a
            link that ``topo`` does not have.
    """
    info = schedule.info
    if "link_chunks" not in info or "k" not in info:
        raise ScheduleError(f"schedule {schedule.name!r} carries no per-link loads (info['link_chunks'], info['k'])")
    if len(members) != schedule.num_ranks:
        raise ScheduleError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks, not {len(members)}")
    reduce = schedule.collective is Collective.REDUCE_SCATTER
    shard = bytes_per_rank / schedule.num_ranks if reduce else bytes_per_rank
    chunk = shard / int(info["k"])
    out: dict[Link, float] = defaultdict(float)
    for u, v, chunks in info["link_chunks"]:
        a, b = _node(u, members), _node(v, members)
        if reduce:  # synthesized on the reversed topology: its link u -> v is the physical link v -> u
            a, b = b, a
        if not topo.graph.has_edge(a, b):
            raise ScheduleError(f"schedule {schedule.name!r} loads a link {a!r} -> {b!r} that {topo.name!r} lacks")
        out[(a, b)] += chunks * chunk
    return dict(out)


def fluid_time(topo: Topology, loads: Sequence[Mapping[Link, float]], fill_s: float = 0.0) -> float:
    """Seconds until the busiest link of ``topo`` has carried every load of ``loads``, plus ``fill_s``.

    Raises:
        ScheduleError: a load on a link of zero capacity.
    """
    total: dict[Link, float] = defaultdict(float)
    for load in loads:
        for link, nbytes in load.items():
            total[link] += nbytes
    busiest = 0.0
    for (u, v), nbytes in total.items():
        cap = float(topo.graph.edges[u, v]["capacity"])
        if nbytes > 0 and cap <= 0:
            raise ScheduleError(f"{nbytes:.4g} bytes on link {u!r} -> {v!r} of zero capacity")
        if nbytes > 0:
            busiest = max(busiest, nbytes / cap)
    return busiest + fill_s
