"""Link indexing and fast GPU-to-GPU routes for the simulator.

:meth:`jaxccl.topology.Topology.path` enumerates every minimum-latency route of
one pair with networkx (about a millisecond each on a 2048-GPU cluster), which is
too slow for an AllToAll of a few hundred GPUs. :class:`Router` computes the
same primary route for all destinations of a source at once: a Dijkstra on the
latencies, then the tie-break of :meth:`Topology.paths` (routes through switches
only first; among equal-latency routes, the smallest sequence of ``str(node)``)
as a dynamic program over the shortest-path DAG. ``method="topology"`` asks
the topology itself (and ``"ecmp"`` picks one of its equal-cost routes per
message by a stable hash), e.g. to cross-check.
"""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Hashable

import numpy as np

from jaxccl.topology import Topology
from jaxccl.util.options import choose

__all__ = ["ROUTING_METHODS", "Router"]

ROUTING_METHODS = ("primary", "topology", "ecmp")
_TABLE_THRESHOLD = 8  # destinations per source above which a whole table is cheaper


class Router:
    """Indexes the links of a topology and returns routes as arrays of link ids.

    Attributes:
        links: ``(u, v)`` of every directed link, in index order.
        capacity: bytes/s per link.
        latency: seconds per link.

    Example:
        >>> from jaxccl.topology import rail
        >>> r = Router(rail(hosts=2))
        >>> [r.links[i] for i in r.route(0, 8)]
        [(0, 'tor:s0r0'), ('tor:s0r0', 8)]
    """

    def __init__(self, topo: Topology, method: str = "primary"):
        choose("routing", method, ROUTING_METHODS)
        self.topo = topo
        self.method = method
        self.links: list[tuple[Hashable, Hashable]] = []
        cap, lat = [], []
        self.index: dict[tuple[Hashable, Hashable], int] = {}
        for u, v, c, latency in topo.edges():
            self.index[(u, v)] = len(self.links)
            self.links.append((u, v))
            cap.append(c)
            lat.append(latency)
        self.capacity = np.asarray(cap, dtype=np.float64)
        self.latency = np.asarray(lat, dtype=np.float64)
        g = topo.graph
        self._is_gpu = {n: d["kind"] == "gpu" for n, d in g.nodes(data=True)}
        self._adj = {n: [(v, float(d["latency"])) for v, d in g.adj[n].items()] for n in g.nodes}
        self._key = {n: str(n) for n in g.nodes}
        self._positive = bool((self.latency > 0).all())
        self._by_source: dict[int, dict[int, tuple[int, ...]]] = {}
        self._cache: dict[tuple[int, int, int], tuple[int, ...]] = {}

    # ------------------------------------------------------------------ routes
    def route(self, u: int, v: int, salt: int = 0) -> tuple[int, ...]:
        """Link ids of the route from GPU ``u`` to GPU ``v`` (``salt`` picks an ECMP route)."""
        if self.method == "primary":
            table = self._by_source.get(u)
            if table is not None:
                return table[v]
            key = (u, v, 0)
            cached = self._cache.get(key)
            if cached is None:
                self.topo._check_gpu(u)  # noqa: SLF001 - raises a clear TopologyError
                self.topo._check_gpu(v)  # noqa: SLF001
                cached = self._single(u, v)
                self._cache[key] = cached
            return cached
        key = (u, v, salt if self.method == "ecmp" else 0)
        cached = self._cache.get(key)
        if cached is None:
            routes = self.topo.paths(u, v)
            pick = 0
            if self.method == "ecmp" and len(routes) > 1:
                pick = zlib.crc32(f"{u},{v},{salt}".encode()) % len(routes)
            cached = tuple(self.index[e] for e in routes[pick])
            self._cache[key] = cached
        return cached

    def prepare(self, sources: dict[int, int]) -> None:
        """Precomputes whole route tables for sources with many destinations (``{source: count}``)."""
        if self.method != "primary":
            return
        for u, count in sources.items():
            if count > _TABLE_THRESHOLD and u not in self._by_source:
                self._by_source[u] = self._from_source(u)

    def route_latency(self, links: tuple[int, ...]) -> float:
        return float(self.latency[list(links)].sum()) if links else 0.0

    def _from_source(self, u: int) -> dict[int, tuple[int, ...]]:
        self.topo._check_gpu(u)  # noqa: SLF001
        n = self.topo.num_gpus
        best = self._dag_best(u, switches_only=True)
        missing = [v for v in range(n) if v != u and v not in best]
        if missing:
            full = self._dag_best(u, switches_only=False)
            for v in missing:
                best[v] = full[v]
        out: dict[int, tuple[int, ...]] = {u: ()}
        for v in range(n):
            if v != u:
                out[v] = self._links_of(best[v][1])
        return out

    def _single(self, u: int, v: int) -> tuple[int, ...]:
        if u == v:
            return ()
        best = self._dag_best(u, switches_only=True, target=v)
        if v not in best:
            best = self._dag_best(u, switches_only=False, target=v)
        return self._links_of(best[v][1])

    def _links_of(self, nodes: tuple) -> tuple[int, ...]:
        return tuple(self.index[(a, b)] for a, b in zip(nodes[:-1], nodes[1:]))

    def _dag_best(self, src: int, *, switches_only: bool, target: int | None = None) -> dict:
        """``{node: (key, node path)}`` of the tie-broken shortest route from ``src`` to every node.

        With ``target`` the search stops once the target is settled (valid with
        positive latencies: every predecessor of a settled node is settled).
        """
        if target is not None and not self._positive:
            target = None
        dist = {src: 0.0}
        preds: dict = {src: []}
        order = []
        heap = [(0.0, 0, src)]
        counter = 1
        done = set()
        while heap:
            d, _, x = heapq.heappop(heap)
            if x in done:
                continue
            done.add(x)
            order.append(x)
            if x == target:
                break
            if switches_only and x != src and self._is_gpu[x]:
                continue  # a GPU other than the source never relays here
            for y, w in self._adj[x]:
                nd = d + w
                old = dist.get(y)
                if old is None or nd < old:
                    dist[y] = nd
                    preds[y] = [x]
                    heapq.heappush(heap, (nd, counter, y))
                    counter += 1
                elif nd == old and y not in done:
                    preds[y].append(x)
        best: dict = {src: ((self._key[src],), (src,))}
        for x in order[1:]:
            cands = [(best[p][0] + (self._key[x],), best[p][1] + (x,)) for p in preds[x] if p in best]
            if cands:
                best[x] = min(cands)
        return best
