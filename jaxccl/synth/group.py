"""Group collectives: a communicator over some of the topology's GPUs, relaying through the others.

A group (one axis of a 2-D mesh, a data-parallel group, ...) is a list of
cluster GPUs whose order gives the group's ranks, as in
:func:`jaxccl.topology.groups.subtopology`, which is the one definition of a
group's own view: the group's GPUs renumbered ``0..k-1`` with the switches
that join them. :func:`relay_topology` is the other view: every GPU outside
the group stays, as a *relay* -- a node that forwards what it receives
(like a switch, without copies) -- so that trees may cross GPUs and links
the group does not own (the next GPU of a torus row, the NVSwitch of a host
with one group member and the NICs of its other GPUs).

The AllGather / ReduceScatter synthesizers (``group=``) synthesize on both
views and keep the faster schedule (``info["group"]`` says which, and which
relays it uses). A relay forwards without holding a shard of its own: on a
fabric that routes through chips (a TPU torus) that is the hardware's job;
elsewhere the relay GPU's runtime must forward the data.

>>> from jaxccl.topology import fat_tree
>>> view = relay_topology(fat_tree(2, 2, 1), [0, 2])
>>> view.num_gpus, sorted(view.switches)
(2, ['leaf:0', 'leaf:1', 'relay:1', 'relay:3', 'spine:0'])
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology import Topology
from jaxccl.topology.groups import subtopology

RELAY_PREFIX = "relay:"


def relay_name(gpu: int) -> str:
    """The node name of cluster GPU ``gpu`` when it relays for a group."""
    return f"{RELAY_PREFIX}{gpu}"


def group_view(topo: Topology, group: Sequence[int]) -> Topology:
    """The group's own view (:func:`jaxccl.topology.groups.subtopology`), after checking ``group``."""
    return subtopology(topo, _checked(topo, group))


def relay_topology(topo: Topology, group: Sequence[int]) -> Topology:
    """``topo`` with the group's GPUs renumbered ``0..k-1`` (in ``group`` order) and every other GPU a relay.

    Raises:
        TopologyError: if ``group`` repeats a GPU, names one ``topo`` lacks, or has fewer than 2 GPUs.
    """
    group = _checked(topo, group)
    members = {g: i for i, g in enumerate(group)}
    relabel = {g: members.get(g, relay_name(g)) for g in topo.gpus}
    h = nx.relabel_nodes(nx.DiGraph(topo.graph), relabel, copy=True)
    for old, new in relabel.items():
        h.nodes[new]["cluster_gpu"] = old
        if old not in members:
            h.nodes[new]["kind"] = "switch"
            h.nodes[new]["role"] = "relay"
    meta = {**topo.meta, "subgroup_of": topo.name, "group_size": len(group)}
    return Topology(h, name=f"{topo.name} group[{len(group)}] with relays", meta=meta)


def _checked(topo: Topology, group: Sequence[int]) -> list[int]:
    try:
        gpus = [int(g) for g in group]
    except (TypeError, ValueError):
        raise TopologyError(f"group must be a sequence of GPU ranks, got {group!r}") from None
    if len(set(gpus)) != len(gpus):
        raise TopologyError(f"group {gpus} names a GPU twice")
    bad = [g for g in gpus if not 0 <= g < topo.num_gpus]
    if bad:
        where = topo.name or "the topology"
        raise TopologyError(f"group names GPU {bad[0]}, but {where} has GPUs 0..{topo.num_gpus - 1}")
    if len(gpus) < 2:
        raise TopologyError(f"a group collective needs at least 2 GPUs, got {gpus}")
    return gpus
