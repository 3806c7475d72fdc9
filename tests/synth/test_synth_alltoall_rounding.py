"""AllToAll rounding internals: the support-only dive and the polish's restricted move scoring."""

from __future__ import annotations

import numpy as np
import pytest

from jaxccl.synth.alltoall import alltoall, decode_paths, rounding
from jaxccl.synth.alltoall.lp import solve_lp
from jaxccl.synth.alltoall.network import build_network
from jaxccl.topology import Topology, torus


def degraded_torus(rows: int, cols: int) -> Topology:
    t = torus(rows, cols)
    return t.degrade(0, 1, capacity=t.capacity(0, 1) / 4)


def stated_rate_is_reached(topo: Topology, s) -> None:
    """Every pair sends exactly K chunks, and the routes' link loads give the algbw the schedule states."""
    k, n = s.chunks_per_period, topo.num_gpus
    per_pair: dict = {}
    loads: dict = {}
    for src, dst, chunks, nodes in decode_paths(s.info["paths"]):
        per_pair[(src, dst)] = per_pair.get((src, dst), 0) + chunks
        for u, v in zip(nodes[:-1], nodes[1:]):
            loads[(u, v)] = loads.get((u, v), 0) + chunks
    assert per_pair == {(a, b): k for a in range(n) for b in range(n) if a != b}
    chi = max(c / topo.capacity(u, v) for (u, v), c in loads.items())
    assert n * k / chi == pytest.approx(s.algbw, rel=1e-9)


@pytest.mark.parametrize("topo", [torus(4, 4), degraded_torus(4, 4), degraded_torus(3, 5)], ids=repr)
def test_support_only_dive_keeps_k_chunks_and_validates(monkeypatch, topo):
    # Above FULL_DIVE_ROWS candidate rows the dive's LPs see the LP support only; force that path here.
    monkeypatch.setattr(rounding, "FULL_DIVE_ROWS", 0)
    s = alltoall(topo).validate()
    stated_rate_is_reached(topo, s)
    assert s.algbw <= s.bound * (1 + 1e-12)
    assert s.algbw >= s.bound * (1 - 2e-2)


def test_support_only_dive_is_used_above_the_row_limit(monkeypatch):
    net = build_network(degraded_torus(4, 4))
    res = solve_lp(net, net.default_steps, None, None, None)
    flows = rounding.path_flows(res.pool, res.x)
    monkeypatch.setattr(rounding, "FULL_DIVE_ROWS", 0)
    r = rounding._Rounding(net, res.pool, flows, target=res.z)
    assert r.lp.columns.sum() == (r.cand.frac > 0).sum() < r.cand.pid.size
    monkeypatch.setattr(rounding, "FULL_DIVE_ROWS", 10**9)
    assert rounding._Rounding(net, res.pool, flows, target=res.z).lp.columns.all()


def reference_polish(net, cand, count, loads, max_moves):
    """The polish's rule, scored move by move over every move of every candidate row."""
    count, loads = count.copy(), loads.astype(np.float64).copy()
    inc = cand.inc.toarray()
    cap = net.capacity
    moves = [(r, a) for r in range(cand.group.size) for a in np.flatnonzero(cand.group == cand.group[r]) if a != r]
    made = 0
    for _ in range(max_moves):
        ratio = loads / cap
        chi = ratio.max()
        level = chi * (1 - 1e-12)
        hot = ratio >= level
        best, best_score = None, 0
        for r, a in moves:
            delta = inc[a] - inc[r]
            if count[r] == 0 or not delta.any():
                continue
            new = (loads + delta) / cap
            changed = delta != 0
            if new[changed].max() > chi * (1 + 1e-12):
                continue
            score = int((hot & changed & (new < level)).sum()) - int((~hot & changed & (new >= level)).sum())
            if score > best_score:
                best, best_score = (r, a), score
        if best is None:
            break
        count[best[0]] -= 1
        count[best[1]] += 1
        loads += inc[best[1]] - inc[best[0]]
        made += 1
    return count, loads, made


@pytest.mark.parametrize(("rows", "cols", "k"), [(3, 5, 1), (3, 5, 2), (3, 5, 3), (4, 4, 3)])
def test_polish_makes_the_moves_of_the_unrestricted_rule(rows, cols, k):
    net = build_network(degraded_torus(rows, cols))
    res = solve_lp(net, net.default_steps, None, None, None)
    r = rounding._Rounding(net, res.pool, rounding.path_flows(res.pool, res.x), target=None)
    _, fixed, loads = r.dive(k)
    want_count, want_loads, made = reference_polish(net, r.cand, fixed, loads, r.budget)
    count, got_loads = rounding._polish(net, rounding._moves(r.cand), fixed, loads, r.budget)
    assert made > 0  # these cases do move chunks: a wrong move would show
    np.testing.assert_array_equal(count, want_count)
    np.testing.assert_allclose(got_loads, want_loads)
