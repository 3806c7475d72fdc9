"""The bitvector safety check of REACT App. A.3.

Every device starts with a one-hot bitvector (bit ``d`` for device ``d``); the
pattern is executed step by step on these vectors, flow by flow, with the
semantics of :mod:`jaxccl.tune.react.pattern` (a flow carries what its sender
holds at its step). A ``REDUCE`` adds the message to the receiver's vector --
jaxccl requires the two to be disjoint, because a contribution counted twice
is a wrong sum (the paper's bitvectors only ask for all bits to be set); a
``COPY`` replaces the receiver's vector; a ``GATHER`` ORs it in. The pattern
is correct when every device ends with all bits set, in every chunk graph
(AllReduce: the sum of every device's chunk; AllGather: every device's block).

The run costs ``O(|V| + |E|)`` per chunk graph, as in the paper. It also
yields what every flow carries, which :mod:`jaxccl.tune.react.compile` needs
(for an AllGather only the blocks the receiver does not hold yet are sent).

Example:
    >>> from jaxccl.tune.react.pattern import ring_allreduce_pattern
    >>> simulate(ring_allreduce_pattern(4)).valid
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxccl.tune.react.pattern import FlowKind

__all__ = ["Semantics", "check_chunk_graph", "simulate"]

_REDUCE, _COPY, _GATHER = 0, 1, 2
_KIND_CODE = {FlowKind.REDUCE: _REDUCE, FlowKind.COPY: _COPY, FlowKind.GATHER: _GATHER}


@dataclasses.dataclass(frozen=True)
class Semantics:
    """Outcome of :func:`simulate`.

    Attributes:
        valid: every device ends with every contribution exactly once (AllReduce)
            or every block (AllGather), in every chunk graph.
        reason: why not (empty when valid).
        message: per flow, the bitmask of devices whose data it carries (AllReduce:
            the contributions summed in it; AllGather: the blocks new to its receiver).
        size: per flow, chunks carried (AllReduce: 1; AllGather: ``popcount(message)``).
    """

    valid: bool
    reason: str
    message: tuple[int, ...]
    size: np.ndarray


def _run_graph(
    n: int, kinds: Sequence[int], steps: Sequence[int], src: Sequence[int], dst: Sequence[int], graph: int
) -> tuple[str, list[int]]:
    """Runs one chunk graph (flows sorted by step); returns ``(reason or "", message per flow)``."""
    state = [1 << d for d in range(n)]
    msgs = [0] * len(kinds)
    i, m = 0, len(kinds)
    while i < m:
        t = steps[i]
        j = i
        while j < m and steps[j] == t:
            j += 1
        snap = [state[src[k]] for k in range(i, j)]
        for k in range(i, j):
            v, msg, kind = dst[k], snap[k - i], kinds[k]
            if kind == _REDUCE:
                if msg & state[v]:
                    both = msg & state[v]
                    who = [d for d in range(n) if both >> d & 1]
                    return (
                        f"chunk graph {graph}: device {v} adds the contribution of device(s) {who} twice "
                        f"(flow from device {src[k]} at step {t})",
                        msgs,
                    )
                state[v] |= msg
                msgs[k] = msg
            elif kind == _COPY:
                state[v] = msg
                msgs[k] = msg
            else:
                msgs[k] = msg & ~state[v]
                state[v] |= msg
        i = j
    full = (1 << n) - 1
    for d, s in enumerate(state):
        if s != full:
            missing = [e for e in range(n) if not s >> e & 1]
            what = "contributions" if kinds and kinds[0] != _GATHER else "blocks"
            return f"chunk graph {graph}: device {d} ends without the {what} of device(s) {missing}", msgs
    return "", msgs


def _graph_arrays(pattern: Any, graph: int, placement: np.ndarray | None = None) -> tuple:
    idx = pattern.graph_flows(graph)
    pl = pattern.placement[graph] if placement is None else placement
    steps = pattern.steps[idx]
    src = pl[steps, pattern.src_position[idx]]
    dst = pl[steps + 1, pattern.dst_position[idx]]
    kinds = [_KIND_CODE[pattern.flows[i].kind] for i in idx.tolist()]
    return idx, kinds, steps.tolist(), src.tolist(), dst.tolist()


def check_chunk_graph(pattern: Any, graph: int, placement: np.ndarray | None = None) -> str:
    """Runs chunk graph ``graph`` of ``pattern`` (with ``placement[T + 1, N]`` for it, if given).

    Returns:
        ``""`` if the chunk graph is correct, else the reason.
    """
    _, kinds, steps, src, dst = _graph_arrays(pattern, graph, placement)
    return _run_graph(pattern.num_ranks, kinds, steps, src, dst, graph)[0]


def simulate(pattern: Any) -> Semantics:
    """Runs the bitvector check on every chunk graph of ``pattern``.

    >>> from jaxccl.tune.react.pattern import recursive_doubling_pattern
    >>> s = simulate(recursive_doubling_pattern(4))
    >>> s.valid, s.size.tolist()
    (True, [1, 1, 1, 1, 2, 2, 2, 2])
    """
    msgs = [0] * pattern.num_flows
    reasons = []
    for g in range(pattern.num_chunk_graphs):
        idx, kinds, steps, src, dst = _graph_arrays(pattern, g)
        reason, out = _run_graph(pattern.num_ranks, kinds, steps, src, dst, g)
        if reason:
            reasons.append(reason)
        for i, v in zip(idx.tolist(), out):
            msgs[i] = v
    if pattern.collective.reduces:
        size = np.ones(pattern.num_flows, dtype=np.int64)
    else:
        size = np.fromiter((bin(v).count("1") for v in msgs), np.int64, len(msgs))
    return Semantics(not reasons, "; ".join(reasons), tuple(msgs), size)
