"""The cluster as an immutable directed graph of GPUs, switches and NICs.

GPU nodes are the integers ``0 .. num_gpus-1`` (the ranks); every other node is
a string (``"nvs:h0"``, ``"tor:s0r3"``, ``"agg"``, ...). Every edge carries
``capacity`` in bytes/s and ``latency`` in seconds, plus a free-form ``kind``
label (``"nvlink"``, ``"nic"``, ``"uplink"``, ...).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.util import strict

Node = int | str
Edge = tuple[Node, Node]

SCHEMA = "jaxccl.topology/1"
NODE_KINDS = ("gpu", "switch", "nic")


def gbps(value: float) -> float:
    """Converts gigabits per second to bytes per second.

    >>> gbps(400)
    50000000000.0
    """
    return float(value) * 1e9 / 8.0


class Topology:
    """An immutable cluster topology.

    Build one with a preset (:func:`jaxccl.topology.rail`, ``single_node``,
    ``ring``, ``fat_tree``) or :meth:`from_edges`; derive changed copies with
    :meth:`degrade`, :meth:`cut` and :meth:`with_edges`.

    Example:
        >>> from jaxccl.topology import Topology
        >>> t = Topology.from_edges(2, [(0, "sw", 100.0, 1e-6), ("sw", 1, 100.0, 1e-6),
        ...                             (1, "sw", 100.0, 1e-6), ("sw", 0, 100.0, 1e-6)])
        >>> t.num_gpus, t.path(0, 1)
        (2, ((0, 'sw'), ('sw', 1)))
    """

    def __init__(self, graph: nx.DiGraph, *, name: str = "", meta: Mapping[str, Any] | None = None):
        g = nx.DiGraph(graph)
        _validate(g)
        self._graph = nx.freeze(g)
        self._name = name
        self._meta = dict(meta or {})
        self._path_cache: dict[Edge, tuple[tuple[Edge, ...], ...]] = {}

    # ------------------------------------------------------------------ views
    @property
    def graph(self) -> nx.DiGraph:
        """The frozen ``networkx.DiGraph`` (read-only)."""
        return self._graph

    @property
    def name(self) -> str:
        return self._name

    @property
    def meta(self) -> dict[str, Any]:
        """Preset parameters (e.g. ``{"preset": "rail", "hosts": 2, ...}``); a copy."""
        return dict(self._meta)

    @functools.cached_property
    def num_gpus(self) -> int:
        return sum(1 for _, k in self._graph.nodes(data="kind") if k == "gpu")

    @property
    def gpus(self) -> range:
        return range(self.num_gpus)

    @functools.cached_property
    def switches(self) -> tuple[str, ...]:
        return tuple(n for n, k in self._graph.nodes(data="kind") if k != "gpu")

    def host_of(self, rank: int) -> int:
        """The host index of a GPU (0 when the topology has no host notion)."""
        self._check_gpu(rank)
        return int(self._graph.nodes[rank].get("host", 0))

    @functools.cached_property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """GPUs grouped by host, hosts in index order."""
        groups: dict[int, list[int]] = {}
        for r in self.gpus:
            groups.setdefault(self.host_of(r), []).append(r)
        return tuple(tuple(groups[h]) for h in sorted(groups))

    def edges(self) -> Iterator[tuple[Node, Node, float, float]]:
        """Yields ``(u, v, capacity, latency)`` for every directed link."""
        for u, v, d in self._graph.edges(data=True):
            yield u, v, d["capacity"], d["latency"]

    def capacity(self, u: Node, v: Node) -> float:
        return float(self._edge(u, v)["capacity"])

    def latency(self, u: Node, v: Node) -> float:
        return float(self._edge(u, v)["latency"])

    def has_edge(self, u: Node, v: Node) -> bool:
        return self._graph.has_edge(u, v)

    # ------------------------------------------------------------------ paths
    def paths(self, u: int, v: int) -> tuple[tuple[Edge, ...], ...]:
        """All minimum-latency routes from GPU ``u`` to GPU ``v``.

        Each route is the tuple of physical links it crosses. Routes through
        switches and NICs only are preferred; when none exists (e.g. two GPUs
        on different rails of different hosts in a rail-only fabric) routes may
        forward through other GPUs, as NCCL's PXN does. Ties are kept (ECMP);
        the first route is the primary one (:meth:`path`).
        """
        self._check_gpu(u)
        self._check_gpu(v)
        if u == v:
            return ((),)
        key = (u, v)
        cached = self._path_cache.get(key)
        if cached is not None:
            return cached
        try:
            found = nx.all_shortest_paths(self._switch_view(u, v), u, v, weight="latency")
            node_paths = sorted(found, key=lambda p: [str(n) for n in p])
        except nx.NetworkXNoPath:
            found = nx.all_shortest_paths(self._graph, u, v, weight="latency")
            node_paths = sorted(found, key=lambda p: [str(n) for n in p])
        routes = tuple(tuple(zip(p[:-1], p[1:])) for p in node_paths)
        self._path_cache[key] = routes
        return routes

    def path(self, u: int, v: int) -> tuple[Edge, ...]:
        """The primary route from GPU ``u`` to GPU ``v`` (see :meth:`paths`)."""
        return self.paths(u, v)[0]

    def path_latency(self, u: int, v: int) -> float:
        return sum(self.latency(a, b) for a, b in self.path(u, v))

    def path_capacity(self, u: int, v: int) -> float:
        """The bottleneck capacity of the primary route (inf for ``u == v``)."""
        route = self.path(u, v)
        return min((self.capacity(a, b) for a, b in route), default=float("inf"))

    def _switch_view(self, u: int, v: int) -> nx.DiGraph:
        kinds = self._graph.nodes

        def keep(n: Node) -> bool:
            return n in (u, v) or kinds[n]["kind"] != "gpu"

        return nx.subgraph_view(self._graph, filter_node=keep)

    # -------------------------------------------------------------- derivation
    def degrade(
        self,
        u: Node,
        v: Node,
        *,
        gbps: float | None = None,
        capacity: float | None = None,
        latency: float | None = None,
        both: bool = True,
    ) -> Topology:
        """A copy with the link ``u -> v`` (and ``v -> u`` if ``both``) changed.

        Give the new capacity either in Gbps (``gbps=``) or bytes/s
        (``capacity=``); ``latency=`` (seconds) replaces the latency. A value
        that is not a finite float (``10**400``, ``nan``, a string) raises
        ``TopologyError`` naming it; so does a capacity that is not positive.

        >>> from jaxccl.topology import rail
        >>> t = rail(hosts=2).degrade(0, "tor:s0r0", gbps=50)
        >>> t.capacity(0, "tor:s0r0")
        6250000000.0
        """
        if gbps is not None and capacity is not None:
            raise TopologyError("give either gbps= or capacity=, not both")
        if gbps is not None:
            gbps = strict.real(gbps, f"degrade {u!r} -> {v!r}: gbps", TopologyError)
        if capacity is not None:
            capacity = strict.real(capacity, f"degrade {u!r} -> {v!r}: capacity", TopologyError)
        if latency is not None:
            latency = strict.real(latency, f"degrade {u!r} -> {v!r}: latency", TopologyError)
        new_cap = globals()["gbps"](gbps) if gbps is not None else capacity
        changes: dict[Edge, dict[str, float]] = {}
        pairs = [(u, v), (v, u)] if both else [(u, v)]
        for a, b in pairs:
            self._edge(a, b)
            attrs: dict[str, float] = {}
            if new_cap is not None:
                attrs["capacity"] = float(new_cap)
            if latency is not None:
                attrs["latency"] = float(latency)
            changes[(a, b)] = attrs
        return self.with_edges(changes)

    def with_edges(
        self,
        changes: Mapping[Edge, Mapping[str, Any] | None],
        *,
        name: str | None = None,
    ) -> Topology:
        """A copy with edges updated, added (if absent) or removed (value ``None``).

        New nodes named in added edges must be strings (switches) and get kind
        ``"switch"``.
        """
        g = nx.DiGraph(self._graph)
        for (a, b), attrs in changes.items():
            if attrs is None:
                if not g.has_edge(a, b):
                    raise TopologyError(f"cannot remove missing link {a!r} -> {b!r}")
                g.remove_edge(a, b)
                continue
            for n in (a, b):
                if n not in g:
                    if not isinstance(n, str):
                        raise TopologyError(f"unknown GPU {n!r}: GPUs cannot be added by an edge change")
                    g.add_node(n, kind="switch")
            if g.has_edge(a, b):
                g.edges[a, b].update(attrs)
            else:
                missing = {"capacity", "latency"} - set(attrs)
                if missing:
                    raise TopologyError(f"new link {a!r} -> {b!r} needs {sorted(missing)}")
                g.add_edge(a, b, kind="link", **attrs)
        return Topology(g, name=self._name if name is None else name, meta=self._meta)

    def cut(self, u: Node, v: Node, *, both: bool = True) -> Topology:
        """A copy without the link ``u -> v`` (and ``v -> u``); must stay connected."""
        pairs = [(u, v), (v, u)] if both else [(u, v)]
        for a, b in pairs:
            self._edge(a, b)
        return self.with_edges({p: None for p in pairs})

    def scaled(self, factor: float) -> Topology:
        """A copy with every capacity multiplied by ``factor`` (> 0)."""
        if not factor > 0:
            raise TopologyError(f"scale factor must be positive, got {factor}")
        return self.with_edges({(u, v): {"capacity": c * factor} for u, v, c, _ in self.edges()})

    # ------------------------------------------------------------ (de)serialize
    def to_dict(self) -> dict[str, Any]:
        nodes = []
        for n, d in sorted(self._graph.nodes(data=True), key=lambda nd: _node_key(nd[0])):
            nodes.append({"id": n, **{k: d[k] for k in sorted(d)}})
        edges = []
        for u, v, d in sorted(self._graph.edges(data=True), key=lambda e: (_node_key(e[0]), _node_key(e[1]))):
            edges.append({"u": u, "v": v, **{k: d[k] for k in sorted(d)}})
        return {"schema": SCHEMA, "name": self._name, "meta": self._meta, "nodes": nodes, "edges": edges}

    def to_json(self, *, indent: int | None = None) -> str:
        """Serializes to JSON; :meth:`from_json` restores an equal Topology."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        if not isinstance(data, Mapping):
            raise TopologyError("topology JSON must be an object")
        if data.get("schema") != SCHEMA:
            raise TopologyError(f"unsupported topology schema {data.get('schema')!r}; expected {SCHEMA!r}")
        strict.nesting(data, "topology JSON", TopologyError)  # meta and attributes are free-form: to_json recurses
        g = nx.DiGraph()
        try:
            for nd in data["nodes"]:
                attrs = {k: v for k, v in nd.items() if k != "id"}
                g.add_node(nd["id"], **attrs)
            for ed in data["edges"]:
                u, v = ed["u"], ed["v"]
                for n in (u, v):
                    if n not in g:
                        raise TopologyError(f"edge {u!r} -> {v!r} names unknown node {n!r}")
                attrs = {k: val for k, val in ed.items() if k not in ("u", "v")}
                g.add_edge(u, v, **attrs)
        except (KeyError, TypeError, AttributeError, ValueError) as e:  # networkx: ValueError for a None node
            raise TopologyError(f"malformed topology JSON: missing or bad field ({type(e).__name__}: {e})") from e
        name, meta = data.get("name", ""), data.get("meta") or {}
        if not isinstance(name, str):
            raise TopologyError(f"topology JSON: 'name' must be a string, got {name!r}")
        if not isinstance(meta, Mapping):
            raise TopologyError(f"topology JSON: 'meta' must be an object, got {type(meta).__name__}")
        return cls(g, name=name, meta=meta)

    @classmethod
    def from_json(cls, text: str) -> Topology:
        """Parses :meth:`to_json` output; malformed input raises ``TopologyError``."""
        return cls.from_dict(strict.load_json(text, "topology JSON", TopologyError))

    @classmethod
    def from_edges(
        cls,
        num_gpus: int,
        edges: Iterable[tuple[Node, Node, float, float]],
        *,
        name: str = "",
        meta: Mapping[str, Any] | None = None,
    ) -> Topology:
        """Builds a topology from ``(u, v, capacity_bytes_per_s, latency_s)`` links.

        GPUs are ``0..num_gpus-1``; string nodes are switches. Links are
        directed: give both directions for a duplex link. A capacity or
        latency that is not a finite float raises ``TopologyError`` naming the link.
        """
        g = nx.DiGraph()
        for r in range(num_gpus):
            g.add_node(r, kind="gpu", host=r)
        for u, v, cap, lat in edges:
            for n in (u, v):
                if n not in g:
                    if not isinstance(n, str):
                        raise TopologyError(f"unknown GPU {n!r} (num_gpus={num_gpus})")
                    g.add_node(n, kind="switch")
            cap = strict.real(cap, f"link {u!r} -> {v!r}: capacity (bytes/s)", TopologyError)
            lat = strict.real(lat, f"link {u!r} -> {v!r}: latency (s)", TopologyError)
            g.add_edge(u, v, capacity=cap, latency=lat, kind="link")
        return cls(g, name=name, meta=meta)

    # ------------------------------------------------------------------ misc
    @functools.cached_property
    def fingerprint(self) -> str:
        """A content hash of nodes, links, capacities and latencies."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return (
            f"Topology({self._name or 'custom'}: {self.num_gpus} GPUs, "
            f"{len(self.switches)} switches, {self._graph.number_of_edges()} links)"
        )

    def _edge(self, u: Node, v: Node) -> dict[str, Any]:
        for n in (u, v):
            if n not in self._graph:
                raise TopologyError(f"unknown node {n!r}")
        if not self._graph.has_edge(u, v):
            raise TopologyError(f"no link {u!r} -> {v!r}")
        return self._graph.edges[u, v]

    def _check_gpu(self, r: object) -> None:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.num_gpus:
            raise TopologyError(f"unknown GPU {r!r}; GPUs are 0..{self.num_gpus - 1}")


def _node_key(n: Node) -> tuple[int, int | str]:
    return (0, n) if isinstance(n, int) else (1, n)


def _validate(g: nx.DiGraph) -> None:
    gpus = []
    for n, d in g.nodes(data=True):
        kind = d.get("kind")
        if kind not in NODE_KINDS:
            raise TopologyError(f"node {n!r} has kind {kind!r}; expected one of {NODE_KINDS}")
        if kind == "gpu":
            if not isinstance(n, int) or isinstance(n, bool):
                raise TopologyError(f"GPU nodes must be integer ranks, got {n!r}")
            if "host" in d:  # host_of() and hosts read it as an int
                strict.integer(d["host"], f"GPU {n}: host", TopologyError)
            gpus.append(n)
        elif not isinstance(n, str):
            raise TopologyError(f"non-GPU node {n!r} must be named by a string")
    if not gpus:
        raise TopologyError("topology has no GPUs")
    if sorted(gpus) != list(range(len(gpus))):
        raise TopologyError(f"GPU ranks must be 0..{len(gpus) - 1}, got {sorted(gpus)}")
    for u, v, d in g.edges(data=True):
        if u == v:
            raise TopologyError(f"self-loop on {u!r}")
        cap, lat = d.get("capacity"), d.get("latency")
        strict.real(cap, f"link {u!r} -> {v!r}: capacity (bytes/s)", TopologyError, positive=True)
        if strict.real(lat, f"link {u!r} -> {v!r}: latency (s)", TopologyError) < 0:
            raise TopologyError(f"link {u!r} -> {v!r}: latency (s) must be >= 0, got {lat!r}")
        d.setdefault("kind", "link")
    if len(gpus) > 1:
        # Every GPU must reach every other GPU: one strongly connected component holds them all.
        comp = next(c for c in nx.strongly_connected_components(g) if 0 in c)
        missing = [r for r in gpus if r not in comp]
        if missing:
            raise TopologyError(
                f"topology is disconnected: GPU(s) {missing[:8]}{'...' if len(missing) > 8 else ''} "
                "cannot exchange data with GPU 0 in both directions"
            )
