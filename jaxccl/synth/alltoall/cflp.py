"""The compact arc-based max-min concurrent-flow LP (CF-LP, MCCL App. G.3), an independent check.

The CF-LP is written directly on the time-expanded graph ``G~`` of Sec. 4.2
with ``m_s`` steps (node ``v_i`` = node ``v`` at step ``i``; a link into a
switch is instantaneous, ``u_i -> v_i``, every other link advances,
``u_i -> v_{i+1}``) and one super-sink ``sigma_d`` per GPU reached by exit
arcs ``d_i -> sigma_d``::

    max z
    s.t.  in(v_i) - out(v_i) = b_{v_i}(z)     per commodity, per node of G~  (17)
          sum_k sum_i f^k(a_i) <= c_a         per link a                     (18)
          f >= 0                                                           (19)

It is built from the :class:`~jaxccl.topology.Topology` graph alone (no code
shared with the column generation) and is meant for small topologies: it
has ``O(commodities * |A| * m_s)`` variables and ``O(commodities * |V| * m_s)``
rows, with ``m_s = |V| - 1`` by default, so ``O(N |A| |V|)`` for
``per="source"``: cubic in the fabric's size. An offline tool: at 64 GPUs (a
2 x 4 x 8 rail, 1.6 million variables) HiGHS runs for more than 15 minutes;
nothing on the synthesis or recovery path calls it.

``per="pair"`` is App. G.3 verbatim: one commodity per ordered pair
``(s, d)`` delivering ``z``. ``per="source"`` (the default) aggregates the
commodities of one source into one flow that supplies ``(N-1) z`` at ``s_0``
and delivers ``z`` to every ``sigma_d``; a single-source flow decomposes into
source-to-sink paths carrying exactly the sink demands, so both have the
same optimum (the tests check it) and the aggregated LP is ``N - 1`` times
smaller.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from jaxccl.errors import SynthesisError, TopologyError
from jaxccl.synth.alltoall.master import check_status, new_highs
from jaxccl.topology import Topology
from jaxccl.util.options import choose


def cflp_bound(topo: Topology, *, max_steps: int | None = None, per: str = "source") -> float:
    """The CF-LP optimum as algbw in bytes/s (``N * z``, the convention of :func:`alltoall`).

    Args:
        topo: the topology.
        max_steps: ``m_s`` (default ``|V| - 1`` as in MCCL, at least ``N``; see
            :attr:`~jaxccl.synth.alltoall.network.Network.default_steps`).
        per: ``"source"`` (aggregated commodities) or ``"pair"`` (App. G.3 verbatim).

    Raises:
        SynthesisError: if HiGHS does not report an optimum (e.g. ``m_s`` too small).

    >>> from jaxccl.topology import ring
    >>> round(cflp_bound(ring(4, link_gbps=8)) / 1e9, 6)  # 1 GB/s links: 16 pair-hops on 8 links
    2.0
    """
    if not isinstance(topo, Topology):
        raise TopologyError(f"expected a jaxccl.topology.Topology, got {type(topo).__name__}")
    choose("per", per, ("source", "pair"))
    n = topo.num_gpus
    if n < 2:
        raise TopologyError("AllToAll needs at least 2 GPUs")
    nodes = list(range(n)) + sorted((v for v in topo.graph.nodes if not isinstance(v, int)), key=str)
    idx = {v: i for i, v in enumerate(nodes)}
    v_count = len(nodes)
    m_s = max(v_count - 1, n) if max_steps is None else int(max_steps)
    if m_s < 1:
        raise SynthesisError(f"m_s must be >= 1, got {m_s}")
    links = [(idx[u], idx[v], c) for u, v, c, _ in topo.edges()]
    unit = max(c for _, _, c in links)
    # Time-expanded arcs: (link, tail node id, head node id) with node id = v * m_s + i.
    t_link, t_tail, t_head = [], [], []
    for li, (u, v, _) in enumerate(links):
        if v >= n:  # into a switch: instantaneous
            steps = np.arange(m_s)
            heads = v * m_s + steps
        else:
            steps = np.arange(m_s - 1)
            heads = v * m_s + steps + 1
        t_link.append(np.full(steps.size, li))
        t_tail.append(u * m_s + steps)
        t_head.append(heads)
    t_link = np.concatenate(t_link)
    t_tail = np.concatenate(t_tail)
    t_head = np.concatenate(t_head)
    node_rows = v_count * m_s
    # Exit arcs d_i -> sigma_d; sink rows follow the node rows.
    e_gpu = np.repeat(np.arange(n), m_s)
    e_tail = e_gpu * m_s + np.tile(np.arange(m_s), n)
    e_head = node_rows + e_gpu
    if per == "source":
        commodities = [(s, None) for s in range(n)]
    else:
        commodities = [(s, d) for s in range(n) for d in range(n) if d != s]
    rows_per = node_rows + n
    ta = t_link.size
    rows, cols, vals = [], [], []
    col = 1  # column 0 is z
    cap_rows_base = len(commodities) * rows_per
    for k, (s, d) in enumerate(commodities):
        base = k * rows_per
        keep = e_gpu != s if d is None else e_gpu == d
        et, eh = e_tail[keep], e_head[keep]
        ncols = ta + et.size
        c_ids = col + np.arange(ncols)
        # conservation: +1 at the head (inflow), -1 at the tail (outflow)
        rows += [base + t_head, base + t_tail, base + eh, base + et]
        cols += [c_ids[:ta], c_ids[:ta], c_ids[ta:], c_ids[ta:]]
        vals += [np.ones(ta), -np.ones(ta), np.ones(et.size), -np.ones(et.size)]
        # capacity rows
        rows.append(cap_rows_base + t_link)
        cols.append(c_ids[:ta])
        vals.append(np.ones(ta))
        # z's coefficient: in - out - b(z) = 0 with b = -supply at s_0, +z at the sinks
        sinks = np.arange(n)[np.arange(n) != s] if d is None else np.array([d])
        rows += [np.array([base + s * m_s]), base + node_rows + sinks]
        cols += [np.array([0]), np.zeros(sinks.size, dtype=np.int64)]
        vals += [np.array([float(sinks.size)]), -np.ones(sinks.size)]
        col += ncols
    num_rows = cap_rows_base + len(links)
    a = sp.csc_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(num_rows, col))
    a.sum_duplicates()
    lower = np.zeros(num_rows)
    upper = np.zeros(num_rows)
    lower[cap_rows_base:] = -np.inf
    upper[cap_rows_base:] = np.array([c for _, _, c in links]) / unit
    z = _solve(a, lower, upper)
    return n * z * unit


def _solve(a: sp.csc_matrix, lower: np.ndarray, upper: np.ndarray) -> float:
    import highspy

    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = a.shape[1], a.shape[0]
    cost = np.zeros(a.shape[1])
    cost[0] = -1.0
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(a.shape[1])
    lp.col_upper_ = np.full(a.shape[1], inf)
    lp.row_lower_ = np.where(np.isfinite(lower), lower, -inf)
    lp.row_upper_ = np.where(np.isfinite(upper), upper, inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = a.indptr.astype(np.int32)
    lp.a_matrix_.index_ = a.indices.astype(np.int32)
    lp.a_matrix_.value_ = a.data.astype(np.float64)
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = a.shape[1], a.shape[0]
    h = new_highs()
    # Interior point (with crossover) is 3-5x faster than simplex on this degenerate, time-expanded LP.
    h.setOptionValue("solver", "ipm")
    if h.passModel(lp) != highspy.HighsStatus.kOk:
        raise SynthesisError("HiGHS refused the CF-LP")
    h.run()
    check_status(h, "CF-LP")
    return float(h.getSolution().col_value[0])
