"""Warm starts of the AllToAll synthesis: what a previous schedule offers on a new topology, and its reuse.

:class:`PreviousRoutes` reads a previous schedule's chunk routes onto the
new network (their rate, the links they now overload, their trees for the
column generation, whether they are still optimal); :func:`keep_previous`
returns the previous program with the new topology's numbers;
:func:`kept_prefix`, :func:`merged_arcs` and :func:`routes_from` carry a
repaired plan's untouched rows over. :func:`~jaxccl.synth.alltoall.alltoall`
decides which of these a warm start takes (see :mod:`.driver`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from jaxccl.errors import SynthesisError
from jaxccl.schedule import Collective, Schedule
from jaxccl.synth.alltoall.cg import GAP_TOL, BestBound, Certificate, utilization_prices
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.planning import Plan
from jaxccl.synth.alltoall.pricing import shortest_path_trees
from jaxccl.synth.alltoall.repair import Repaired
from jaxccl.synth.alltoall.report import cut_info, gap_pct
from jaxccl.synth.alltoall.routes import route_arcs, route_nodes
from jaxccl.synth.alltoall.state import WarmState, remember


class PreviousRoutes:
    """What a previous schedule offers on a new topology: its chunk routes and their rate.

    Attributes:
        chunks: the previous ``K``.
        src, dst, count, arcs: its routes whose links all still exist (arcs -1 padded).
        all_routes: every route of the previous table is among them (in its order).
        hops: their GPU-to-GPU hops, when known without counting.
        complete: every commodity keeps all ``K`` chunks on existing links.
        overloaded: ``(A,)`` links the previous routes overload on the new capacities.
        rate: the previous integer solution's per-commodity rate on the new
            capacities (capacity units), when complete.
        link_chunks: its chunks per link, when complete.
        certificate: the previous schedule's :class:`~.cg.Certificate`, when
            its prices refer to this network's arcs.
        same_network_arcs: the remembered routes' arcs when the network is the
            one they were found on (same nodes and links), else None.
    """

    def __init__(self, net: Network) -> None:
        self.net = net
        self.chunks = 0
        self.src = self.dst = self.count = np.zeros(0, dtype=np.int64)
        self.arcs = np.zeros((0, 1), dtype=np.int32)
        self.complete = False
        self.rate = 0.0
        self.link_chunks = np.zeros(net.num_arcs)
        self.overloaded = np.zeros(net.num_arcs, dtype=bool)
        self.num_trees = 0
        self.all_routes = False
        self.hops: np.ndarray | None = None
        self.certificate: Certificate | None = None
        self.same_network_arcs: np.ndarray | None = None

    @classmethod
    def of(cls, previous: Schedule, net: Network, state: WarmState | None = None) -> PreviousRoutes:
        if not isinstance(previous, Schedule):
            raise SynthesisError(f"previous must be a jaxccl Schedule, got {type(previous).__name__}")
        if previous.collective is not Collective.ALL_TO_ALL:
            raise SynthesisError(f"previous is a {previous.collective.value} schedule, not all_to_all")
        if previous.num_ranks != net.num_gpus:
            raise SynthesisError(
                f"previous schedule has {previous.num_ranks} ranks but the topology has {net.num_gpus} GPUs"
            )
        w = cls(net)
        table = previous.info.get("paths")
        if not table:
            return w  # e.g. a baseline schedule: nothing to reuse
        n = net.num_gpus
        w.chunks = int(previous.info.get("chunks", previous.chunks_per_period))
        same = state.arcs_on(net.nodes, net.tail, net.head) if state is not None else None
        w.same_network_arcs = same
        if same is not None:  # the same network: the routes' arcs are those it was synthesized with
            src, dst, count = state.plan.src, state.plan.dst, state.plan.count
            arcs, ok = same, np.ones(src.size, dtype=bool)
        else:
            src, dst, count, arcs, ok = route_arcs(net, table)
        w.all_routes = bool(ok.all())
        if w.all_routes:  # read-only use: no copies
            w.src, w.dst, w.count, w.arcs = src, dst, count, arcs
        else:
            w.src, w.dst, w.count, w.arcs = src[ok], dst[ok], count[ok], arcs[ok]
        per_comm = np.bincount(w.src * n + w.dst, weights=w.count, minlength=n * n)
        off_diag = ~np.eye(n, dtype=bool).ravel()
        w.complete = bool(ok.all() and w.chunks >= 1 and np.all(per_comm[off_diag] == w.chunks))
        if same is not None:
            w.link_chunks, w.hops = state.link_chunks, state.plan.hops
            w.certificate = state.certificate
        else:
            valid = w.arcs >= 0
            weights = np.broadcast_to(w.count[:, None], w.arcs.shape)[valid]
            w.link_chunks = np.bincount(w.arcs[valid], weights=weights, minlength=net.num_arcs)
        if w.complete:
            w.rate = w.chunks / float(np.max(w.link_chunks / net.capacity))
            w.num_trees = n * w.chunks
        # Links the old routes now overload: more chunks per capacity than the old bottleneck had.
        old_rate = (previous.algbw or 0.0) / n / net.unit  # per-commodity rate, capacity units
        if old_rate > 0 and w.chunks >= 1:
            w.overloaded = w.link_chunks / net.capacity > (w.chunks / old_rate) * (1 + 1e-9)
        return w

    def still_optimal(self, m_s: int, pricing: str | None = None) -> tuple[float, Certificate | None] | None:
        """A Lagrangian bound proving the previous routes optimal on the new capacities, else None.

        Returns the bound and its certificate. The previous schedule's
        certificate is tried first (one dot product: a change away from the
        links it prices leaves its bound unchanged); then the utilization
        prices of the routes, each priced once.
        """
        if not self.complete:
            return None
        net = self.net
        hops = self.hops
        if hops is None:
            hops = np.where(self.arcs >= 0, net.advances[np.maximum(self.arcs, 0)], False).sum(axis=1)
        if hops.max() > m_s - 1:
            return None
        cert = self.certificate
        if cert is not None and cert.max_steps == m_s:
            upper = cert.bound(net.capacity)
            if np.isfinite(upper) and upper - self.rate <= GAP_TOL * upper:
                return max(upper, self.rate), cert
        best = BestBound(net, m_s)
        for prices in utilization_prices(net, self.link_chunks):
            best.offer(prices, shortest_path_trees(net, prices, max_steps=m_s, extract=False, method=pricing).cost)
            if best.closes(self.rate):
                return max(best.upper, self.rate), best.certificate
        return None

    def trees(self, m_s: int, fallback: tuple[np.ndarray, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The previous chunk routes as trees: tree ``j`` of source ``s`` takes chunk ``j``'s route to every GPU.

        Routes longer than ``m_s - 1`` hops, and routes over links they now
        overload (the previous routes put more chunks per capacity on them
        than on the previous bottleneck), are dropped; a destination left
        without a route in some chunk takes another chunk's route, else its
        path in the ``fallback`` trees (one per source). So the trees keep
        the previous structure wherever it still fits.
        """
        net, n, k = self.net, self.net.num_gpus, self.chunks
        if self.src.size == 0 or k < 1:
            return []
        safe = np.maximum(self.arcs, 0)
        hops = np.where(self.arcs >= 0, net.advances[safe], False).sum(axis=1)
        keep = (hops <= m_s - 1) & ~np.any((self.arcs >= 0) & self.overloaded[safe], axis=1)
        src, dst, cnt, arcs = self.src[keep], self.dst[keep], self.count[keep], self.arcs[keep]
        order = np.lexsort((dst, src))
        src, dst, cnt, arcs = src[order], dst[order], cnt[order], arcs[order]
        comm = src * n + dst
        c0 = np.cumsum(cnt) - cnt
        first = np.flatnonzero(np.r_[True, comm[1:] != comm[:-1]]) if comm.size else np.zeros(0, dtype=np.int64)
        c0 -= np.repeat(c0[first], np.diff(np.r_[first, comm.size]))
        f_src, f_paths = fallback
        width = max(arcs.shape[1], f_paths.shape[2])
        paths = np.full((n, k, n, width), -1, dtype=np.int32)
        filled = np.zeros((n, k, n), dtype=bool)
        rep = np.repeat(np.arange(src.size), cnt)
        cls = c0[rep] + (np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        inside = cls < k
        rep, cls = rep[inside], cls[inside]
        paths[src[rep], cls, dst[rep], : arcs.shape[1]] = arcs[rep]
        filled[src[rep], cls, dst[rep]] = True
        # A chunk without a route takes another chunk's route of its commodity, else the fallback's.
        any_filled = filled.any(axis=1)
        first_cls = filled.argmax(axis=1)
        s_i, j_i, d_i = np.nonzero(~filled)
        own = any_filled[s_i, d_i]
        paths[s_i[own], j_i[own], d_i[own]] = paths[s_i[own], first_cls[s_i[own], d_i[own]], d_i[own]]
        filled[s_i[own], j_i[own], d_i[own]] = True
        diag = np.arange(n)
        filled[diag, :, diag] = True
        s_i, j_i, d_i = np.nonzero(~filled)
        row = np.searchsorted(f_src, s_i)
        paths[s_i, j_i, d_i, : f_paths.shape[2]] = f_paths[row, d_i]
        has_route = np.zeros((n, k), dtype=bool)
        has_route[src[rep], cls] = True
        s_sel, j_sel = np.nonzero(has_route)
        return [(s_sel, paths[s_sel, j_sel])]


def keep_previous(
    previous: Schedule,
    warm: PreviousRoutes,
    kept: tuple[float, Certificate | None],
    name: str,
    m_s: int,
    timings: dict,
    t_start: float,
    state: WarmState | None,
    repaired: Repaired | None = None,
) -> Schedule:
    """The previous program with this topology's bound, rate and trigger data.

    ``kept`` is the certified bound and the certificate behind it.
    """
    upper, certificate = kept
    net, n = warm.net, warm.net.num_gpus
    rate = warm.rate
    info = dict(previous.info)
    info.update(
        {
            "lp_bound": n * upper * net.unit,
            "gap_pct": gap_pct(rate, upper),
            "lp_converged": True,
            "lp_gap_pct": gap_pct(rate, upper),
            "lp_value": n * rate * net.unit,
            "iterations": 0 if repaired is None else repaired.iterations,
            "columns_generated": 0 if repaired is None else repaired.columns_generated,
            "columns_total": warm.num_trees,
            "reused_columns": warm.num_trees,
            "reused_schedule": True,
            "warm_mode": "kept",
            "max_steps": m_s,
            "step_search": None,
            "per_chunk_algbw": {str(warm.chunks): n * rate * net.unit},
            "simplex_iterations": 0 if repaired is None else repaired.simplex_iterations,
            "topology": net.topo.fingerprint,
            "threadblocks_reused": previous.num_threadblocks,
            "ops_reused": previous.num_ops,
        }
    )
    info.update(cut_info(net, warm.link_chunks * rate / warm.chunks, warm.link_chunks))
    timings["total"] = time.perf_counter() - t_start
    info["timings"] = timings
    info["solve_time_s"] = timings["total"]
    sched = previous.replace(name=name, algbw=n * rate * net.unit, bound=n * upper * net.unit, info=info)
    if state is not None:
        if certificate is not state.certificate:
            state = dataclasses.replace(state, certificate=certificate)
        remember(sched, state)
    return sched


def kept_prefix(p: Plan) -> int:
    """How many rows a :func:`plan_delta` plan took over: they come first, in their previous order (checked)."""
    k = int(np.count_nonzero(p.prev_row >= 0))
    kept = p.prev_row[:k]
    if not (np.all(kept >= 0) and np.all(np.diff(kept) > 0)):  # pragma: no cover - plan_delta's order
        raise SynthesisError("internal: a delta plan must list its kept rows first, in order")
    return k


def merged_arcs(p: Plan, k: int, prev_arcs: np.ndarray, pool: ColumnPool) -> np.ndarray:
    """``(M, L)`` the arcs of every row of a :func:`plan_delta` plan: kept rows' previous, new rows' pool paths.

    ``k``: its kept rows, the first ones (:func:`kept_prefix`).
    """
    fresh = pool.paths[p.pid[k:]]
    out = np.full((p.src.size, max(prev_arcs.shape[1], fresh.shape[1])), -1, dtype=np.int32)
    out[:k, : prev_arcs.shape[1]] = np.take(prev_arcs, p.prev_row[:k], axis=0)
    out[k:, : fresh.shape[1]] = fresh
    return out


def routes_from(state: WarmState, p: Plan, k: int, net: Network, arcs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(route, offset)`` of a :func:`plan_delta` plan built from ``state``'s: kept rows keep their nodes.

    The ``k`` kept rows come first, in their previous order (:func:`kept_prefix`),
    so their nodes are the previous table's minus the dropped rows'.
    """
    kept = p.prev_row[:k]
    old_len = np.diff(state.route_offset)
    keep = np.zeros(old_len.size, dtype=bool)
    keep[kept] = True
    fresh, fresh_len = route_nodes(net, arcs[k:])
    route = np.concatenate([state.route[np.repeat(keep, old_len)], fresh])
    offset = np.r_[0, np.cumsum(np.concatenate([old_len[kept], fresh_len]))]
    return route, offset
