"""Topology presets: MCCL's rail-optimized HPN cluster and a few simple shapes."""

from __future__ import annotations

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology.graph import Topology, gbps

NVSWITCH_LATENCY = 25e-9  # per GPU <-> NVSwitch link (MCCL Sec. 6.1)
SWITCH_HOP_LATENCY = 0.5e-6  # per ToR / aggregation hop (MCCL Sec. 6.1)
MAX_HOSTS_PER_SEGMENT = 32  # MCCL Sec. 6.1: segments hold up to 32 hosts


def nvswitch(host: int) -> str:
    return f"nvs:h{host}"


def tor(segment: int, rail: int) -> str:
    return f"tor:s{segment}r{rail}"


AGGREGATION = "agg"


def _duplex(g: nx.DiGraph, a, b, cap: float, lat: float, kind: str) -> None:
    g.add_edge(a, b, capacity=cap, latency=lat, kind=kind)
    g.add_edge(b, a, capacity=cap, latency=lat, kind=kind)


def rail(
    hosts: int = 2,
    gpus_per_host: int = 8,
    segments: int = 1,
    *,
    nvlink_gbps: float = 2880,
    nic_gbps: float = 400,
    uplink_gbps: float | None = None,
    max_hosts_per_segment: int | None = MAX_HOSTS_PER_SEGMENT,
) -> Topology:
    """MCCL's rail-optimized HPN topology, ``segments x hosts x gpus_per_host``.

    Follows MCCL Sec. 6.1 and App. A (Fig. 12): every host has one NVSwitch
    (``nvlink_gbps`` and 25 ns per GPU link); every GPU has its own NIC
    (``nic_gbps``, 0.5 us) to the ToR switch of its rail (GPU index within the
    host) in its segment; a segment has one ToR per rail and at most 32 hosts.
    With more than one segment, every ToR connects to a single-plane
    aggregation layer (node ``"agg"``). The paper gives the aggregation links
    as 400 Gbps links without saying how many; jaxccl provisions each ToR's
    uplink with ``hosts * nic_gbps`` (non-blocking, i.e. as many 400 Gbps links
    as the ToR has hosts) unless ``uplink_gbps`` is given.

    ``max_hosts_per_segment`` enforces the 32-host segments of Sec. 6.1; pass
    ``None`` for larger single segments such as the 1x64x8 rail of MCCL's
    Table 5 and solving-time experiments.

    GPU ``r`` sits on host ``r // gpus_per_host`` and rail ``r % gpus_per_host``;
    hosts ``[k*hosts, (k+1)*hosts)`` form segment ``k``.

    >>> t = rail(hosts=2, gpus_per_host=8)
    >>> t.num_gpus, [len(p) for p in (t.path(0, 1), t.path(0, 8))]
    (16, [2, 2])
    """
    for label, value in (("hosts", hosts), ("gpus_per_host", gpus_per_host), ("segments", segments)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"rail(): {label} must be a positive integer, got {value!r}")
    if max_hosts_per_segment is not None and hosts > max_hosts_per_segment:
        raise TopologyError(
            f"rail(): a segment holds at most {max_hosts_per_segment} hosts, got {hosts} "
            "(pass max_hosts_per_segment=None to lift the limit)"
        )
    for label, value in (("nvlink_gbps", nvlink_gbps), ("nic_gbps", nic_gbps)):
        if not value > 0:
            raise TopologyError(f"rail(): {label} must be positive, got {value!r}")
    g = nx.DiGraph()
    nv_cap, nic_cap = gbps(nvlink_gbps), gbps(nic_gbps)
    up_cap = gbps(uplink_gbps) if uplink_gbps is not None else hosts * nic_cap
    if not up_cap > 0:
        raise TopologyError(f"rail(): uplink_gbps must be positive, got {uplink_gbps!r}")
    total_hosts = hosts * segments
    for h in range(total_hosts):
        seg = h // hosts
        g.add_node(nvswitch(h), kind="switch", role="nvswitch", host=h)
        for i in range(gpus_per_host):
            r = h * gpus_per_host + i
            g.add_node(r, kind="gpu", host=h, rail=i, segment=seg)
            _duplex(g, r, nvswitch(h), nv_cap, NVSWITCH_LATENCY, "nvlink")
            t = tor(seg, i)
            if t not in g:
                g.add_node(t, kind="switch", role="tor", segment=seg, rail=i)
            _duplex(g, r, t, nic_cap, SWITCH_HOP_LATENCY, "nic")
    if segments > 1:
        g.add_node(AGGREGATION, kind="switch", role="aggregation")
        for seg in range(segments):
            for i in range(gpus_per_host):
                _duplex(g, tor(seg, i), AGGREGATION, up_cap, SWITCH_HOP_LATENCY, "uplink")
    meta = {
        "preset": "rail",
        "segments": segments,
        "hosts": hosts,
        "gpus_per_host": gpus_per_host,
        "nvlink_gbps": nvlink_gbps,
        "nic_gbps": nic_gbps,
        "uplink_gbps": up_cap * 8 / 1e9,
    }
    return Topology(g, name=f"rail {segments}x{hosts}x{gpus_per_host}", meta=meta)


def single_node(num_gpus: int = 8, *, nvlink_gbps: float = 2880) -> Topology:
    """One host: ``num_gpus`` GPUs on one NVSwitch (25 ns per link)."""
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise TopologyError(f"single_node(): num_gpus must be a positive integer, got {num_gpus!r}")
    g = nx.DiGraph()
    g.add_node(nvswitch(0), kind="switch", role="nvswitch", host=0)
    for r in range(num_gpus):
        g.add_node(r, kind="gpu", host=0, rail=r, segment=0)
        _duplex(g, r, nvswitch(0), gbps(nvlink_gbps), NVSWITCH_LATENCY, "nvlink")
    meta = {"preset": "single_node", "segments": 1, "hosts": 1, "gpus_per_host": num_gpus, "nvlink_gbps": nvlink_gbps}
    return Topology(g, name=f"single node x{num_gpus}", meta=meta)


def ring(
    num_gpus: int, *, link_gbps: float = 400, latency: float = SWITCH_HOP_LATENCY, bidirectional: bool = True
) -> Topology:
    """GPUs joined in a ring by direct links (``r -> r+1``, and back if bidirectional)."""
    if not isinstance(num_gpus, int) or num_gpus < 2:
        raise TopologyError(f"ring(): needs at least 2 GPUs, got {num_gpus!r}")
    g = nx.DiGraph()
    for r in range(num_gpus):
        g.add_node(r, kind="gpu", host=r)
    cap = gbps(link_gbps)
    for r in range(num_gpus):
        nxt = (r + 1) % num_gpus
        g.add_edge(r, nxt, capacity=cap, latency=latency, kind="link")
        if bidirectional:
            g.add_edge(nxt, r, capacity=cap, latency=latency, kind="link")
    meta = {"preset": "ring", "num_gpus": num_gpus, "link_gbps": link_gbps, "bidirectional": bidirectional}
    return Topology(g, name=f"ring x{num_gpus}", meta=meta)


def fat_tree(
    leaves: int = 4,
    gpus_per_leaf: int = 4,
    spines: int = 2,
    *,
    link_gbps: float = 400,
    uplink_gbps: float | None = None,
) -> Topology:
    """A two-level leaf-spine fabric: each GPU on one leaf, every leaf to every spine.

    Each GPU is its own host. Uplinks default to ``gpus_per_leaf * link_gbps / spines``
    (non-blocking).
    """
    for label, value in (("leaves", leaves), ("gpus_per_leaf", gpus_per_leaf), ("spines", spines)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"fat_tree(): {label} must be a positive integer, got {value!r}")
    g = nx.DiGraph()
    cap = gbps(link_gbps)
    up = gbps(uplink_gbps) if uplink_gbps is not None else cap * gpus_per_leaf / spines
    for s in range(spines):
        g.add_node(f"spine:{s}", kind="switch", role="spine")
    for leaf in range(leaves):
        name = f"leaf:{leaf}"
        g.add_node(name, kind="switch", role="leaf")
        for i in range(gpus_per_leaf):
            r = leaf * gpus_per_leaf + i
            g.add_node(r, kind="gpu", host=r, leaf=leaf)
            _duplex(g, r, name, cap, SWITCH_HOP_LATENCY, "nic")
        if leaves > 1:
            for s in range(spines):
                _duplex(g, name, f"spine:{s}", up, SWITCH_HOP_LATENCY, "uplink")
    meta = {"preset": "fat_tree", "leaves": leaves, "gpus_per_leaf": gpus_per_leaf, "spines": spines}
    return Topology(g, name=f"fat-tree {leaves}x{gpus_per_leaf}", meta=meta)


def torus(rows: int, cols: int, *, link_gbps: float = 400, latency: float = SWITCH_HOP_LATENCY) -> Topology:
    """A ``rows x cols`` 2-D torus of GPUs: duplex links to the four neighbours, no switches.

    GPU ``r * cols + c`` sits at row ``r``, column ``c``; a dimension of size
    2 has one link between its two GPUs (not two), and one of size 1 none.

    >>> t = torus(4, 4)
    >>> t.num_gpus, len(list(t.edges())), sorted(t.graph.successors(0))
    (16, 64, [1, 3, 4, 12])
    """
    for label, value in (("rows", rows), ("cols", cols)):
        if not isinstance(value, int) or value < 1:
            raise TopologyError(f"torus(): {label} must be a positive integer, got {value!r}")
    if rows * cols < 2:
        raise TopologyError(f"torus(): needs at least 2 GPUs, got {rows}x{cols}")
    if not link_gbps > 0:
        raise TopologyError(f"torus(): link_gbps must be positive, got {link_gbps!r}")
    g = nx.DiGraph()
    for r in range(rows):
        for c in range(cols):
            g.add_node(r * cols + c, kind="gpu", host=r * cols + c, row=r, col=c)
    cap = gbps(link_gbps)
    for r in range(rows):
        for c in range(cols):
            me = r * cols + c
            for nb in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if nb != me and not g.has_edge(me, nb):
                    _duplex(g, me, nb, cap, latency, "link")
    meta = {"preset": "torus", "rows": rows, "cols": cols, "link_gbps": link_gbps}
    return Topology(g, name=f"torus {rows}x{cols}", meta=meta)


def mixed_hosts(sizes: list[int], *, nvlink_gbps: float = 2880, nic_gbps: float = 400) -> Topology:
    """Hosts of different sizes: one NVSwitch per host, every GPU's NIC on one shared network switch ``"net"``.

    >>> t = mixed_hosts([1, 3, 4])
    >>> t.num_gpus, t.hosts
    (8, ((0,), (1, 2, 3), (4, 5, 6, 7)))
    """
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise TopologyError(f"mixed_hosts(): sizes must be positive integers, got {sizes!r}")
    if sum(sizes) < 2:
        raise TopologyError(f"mixed_hosts(): needs at least 2 GPUs, got {sizes!r}")
    for label, value in (("nvlink_gbps", nvlink_gbps), ("nic_gbps", nic_gbps)):
        if not value > 0:
            raise TopologyError(f"mixed_hosts(): {label} must be positive, got {value!r}")
    g = nx.DiGraph()
    g.add_node("net", kind="switch", role="network")
    rank = 0
    for h, size in enumerate(sizes):
        g.add_node(nvswitch(h), kind="switch", role="nvswitch", host=h)
        for i in range(size):
            g.add_node(rank, kind="gpu", host=h, rail=i, segment=0)
            _duplex(g, rank, nvswitch(h), gbps(nvlink_gbps), NVSWITCH_LATENCY, "nvlink")
            _duplex(g, rank, "net", gbps(nic_gbps), SWITCH_HOP_LATENCY, "nic")
            rank += 1
    meta = {"preset": "mixed_hosts", "sizes": list(sizes), "nvlink_gbps": nvlink_gbps, "nic_gbps": nic_gbps}
    return Topology(g, name=f"mixed hosts {list(sizes)}", meta=meta)
