"""Communicator groups of a training job on a cluster: placements and sub-topologies.

A collective of a parallelism group (TP, DP, EP...) runs on a subset of the
cluster's GPUs. The simulator runs it *in place* (schedule rank ``i`` on
cluster GPU ``group[i]``, routes of the whole cluster); a synthesizer needs the
group as a topology of its own, :func:`subtopology`: the group's GPUs renumbered
``0..k-1`` (keeping their host/rail/segment attributes) with every switch that
still joins two of them. A group collective that may relay through GPUs
outside the group (``jaxccl.synth.all_gather(topo, group=...)``) gets the GPUs
of the hosts it touches, :func:`relay_domain`; the groups of the same kind
inside that domain, :func:`groups_within`, run at the same time and share its
links.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology import Topology

__all__ = ["group_of", "groups_within", "rail_swap", "relay_domain", "subtopology"]


def subtopology(topo: Topology, gpus: Sequence[int], *, name: str | None = None) -> Topology:
    """The topology seen by a communicator over ``gpus`` (their order gives the new ranks).

    Other GPUs are removed with their links; switches left with a single
    neighbor (dead ends, e.g. the NVSwitch of a host holding one group member)
    are pruned. Link capacities and latencies are unchanged, so a degraded
    link of the cluster stays degraded in the group.

    >>> from jaxccl.topology import rail
    >>> t = subtopology(rail(hosts=4), [0, 8, 16, 24])   # rail 0 of 4 hosts
    >>> t.num_gpus, sorted(t.switches)
    (4, ['tor:s0r0'])
    """
    gpus = [int(g) for g in gpus]
    if len(set(gpus)) != len(gpus):
        raise TopologyError("subtopology: a GPU appears twice in the group")
    for g in gpus:
        topo._check_gpu(g)  # noqa: SLF001 - shared validation helper
    g0 = topo.graph
    keep = set(gpus) | set(topo.switches)
    h = nx.DiGraph(g0.subgraph(keep))
    while True:
        dead = [
            n for n in h.nodes if not isinstance(n, int) and len(set(h.predecessors(n)) | set(h.successors(n))) <= 1
        ]
        if not dead:
            break
        h.remove_nodes_from(dead)
    relabel = {g: i for i, g in enumerate(gpus)}
    h = nx.relabel_nodes(h, relabel, copy=True)
    for old, new in relabel.items():
        h.nodes[new]["cluster_gpu"] = old
    meta = {**topo.meta, "subgroup_of": topo.name, "group_size": len(gpus)}
    return Topology(h, name=name or f"{topo.name} group[{len(gpus)}]", meta=meta)


def group_of(kind: str, gpu: int, num_gpus: int, size: int) -> list[int]:
    """The GPUs of the ``kind`` group of ``size`` that contains ``gpu`` (Megatron-style rank layout).

    - ``"inner"`` (TP, EP): consecutive ranks, ``[g0, g0 + size)``.
    - ``"outer"`` (DP over TP/EP groups): ranks congruent to ``gpu`` modulo
      ``num_gpus // size``, i.e. one per inner group.
    - ``"all"``: every GPU.

    >>> group_of("inner", 0, 64, 16)[:3], group_of("outer", 0, 64, 4)
    ([0, 1, 2], [0, 16, 32, 48])
    """
    if size < 1 or num_gpus % size:
        raise TopologyError(f"group size {size} does not divide {num_gpus} GPUs")
    if kind == "all":
        if size != num_gpus:
            raise TopologyError(f"an 'all' group has {num_gpus} GPUs, not {size}")
        return list(range(num_gpus))
    if kind == "inner":
        start = gpu - gpu % size
        return list(range(start, start + size))
    if kind == "outer":
        stride = num_gpus // size
        return list(range(gpu % stride, num_gpus, stride))
    raise TopologyError(f"unknown group kind {kind!r}; expected 'inner', 'outer' or 'all'")


def relay_domain(topo: Topology, gpus: Sequence[int]) -> list[int]:
    """Every GPU of the hosts that hold a GPU of ``gpus``: the GPUs a group collective may relay through.

    A GPU of a member's host is one NVSwitch hop away: through it, a member
    reaches that GPU's NIC and rail (as NCCL's PXN does). GPUs without a
    ``host`` attribute form a host of their own.

    >>> from jaxccl.topology import rail
    >>> relay_domain(rail(hosts=4, gpus_per_host=2), [0, 4])
    [0, 1, 4, 5]
    """
    nodes = topo.graph.nodes
    for g in gpus:
        topo._check_gpu(int(g))  # noqa: SLF001 - shared validation helper
    hosts = {nodes[int(g)].get("host", ("gpu", int(g))) for g in gpus}
    return [g for g in topo.gpus if nodes[g].get("host", ("gpu", g)) in hosts]


def groups_within(groups: Sequence[Sequence[int]], gpus: Sequence[int]) -> list[list[int]]:
    """The groups (of one partition of the cluster) whose GPUs all lie in ``gpus``, in the given order.

    >>> groups_within([[0, 4], [1, 5], [2, 6], [3, 7]], [0, 1, 4, 5])
    [[0, 4], [1, 5]]
    """
    inside = {int(g) for g in gpus}
    return [[int(g) for g in grp] for grp in groups if all(int(g) in inside for g in grp)]


def rail_swap(topo: Topology, a: int, b: int) -> dict[Hashable, Hashable] | None:
    """The node permutation that exchanges rails ``a`` and ``b``, if it maps ``topo`` onto itself; else ``None``.

    A node of rail ``a`` (a GPU, its ToR) goes to the node of rail ``b`` with
    the same other attributes (host, segment, kind) and back; other nodes
    stay. It is returned only when every link maps to a link of the same
    capacity and latency (an automorphism), so that whatever is computed for
    a group on rail ``a`` holds, mapped, for its twin on rail ``b``.

    >>> from jaxccl.topology import rail, scenario
    >>> swap = rail_swap(rail(hosts=2, gpus_per_host=4), 1, 2)
    >>> swap[1], swap[6], swap["tor:s0r1"]
    (2, 5, 'tor:s0r2')
    >>> rail_swap(scenario(rail(hosts=2, gpus_per_host=4), "fail2"), 0, 1) is None
    True
    """
    g = topo.graph

    def ident(n: Hashable) -> tuple:
        d = g.nodes[n]
        return tuple(sorted((k, repr(v)) for k, v in d.items() if k not in ("rail", "cluster_gpu")))

    by_rail: dict[int, dict[tuple, Hashable]] = {a: {}, b: {}}
    for n, d in g.nodes(data=True):
        if d.get("rail") in by_rail:
            key = ident(n)
            if key in by_rail[d["rail"]]:
                return None  # two nodes of one rail alike: no unique twin
            by_rail[d["rail"]][key] = n
    if by_rail[a].keys() != by_rail[b].keys():
        return None
    perm: dict[Hashable, Hashable] = {n: n for n in g.nodes}
    for key, n in by_rail[a].items():
        perm[n], perm[by_rail[b][key]] = by_rail[b][key], n
    for u, v, d in g.edges(data=True):
        x, y = perm[u], perm[v]
        if not g.has_edge(x, y):
            return None
        e = g.edges[x, y]
        if e.get("capacity") != d.get("capacity") or e.get("latency") != d.get("latency"):
            return None
    return perm
