"""What a synthesized AllToAll schedule leaves for the next warm start, held in memory next to it.

A warm start reads the previous schedule's chunk routes (``info["paths"]``),
the plan they were compiled with (class ranges, scratch offsets) and its
program (to reuse identical ops and threadblocks). Reading them back from
the schedule means converting every route from JSON lists and checking every
op against the plan; so, for each schedule it returns, the synthesizer also
remembers the arrays it built them from, for as long as that schedule object
is alive (the controller keeps the deployed schedule). A schedule from
anywhere else, e.g. read back from JSON, is read the slow way; both ways
give the same result.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxccl.schedule import Schedule
from jaxccl.synth.alltoall.cg import Certificate
from jaxccl.synth.alltoall.emission import Emitted
from jaxccl.synth.alltoall.planning import Plan


@dataclasses.dataclass(frozen=True, eq=False)
class WarmState:
    """The arrays behind one schedule's ``info["paths"]`` and program.

    Attributes:
        paths: the ``info["paths"]`` mapping they describe (identity-checked on recall).
        plan: the plan the program was emitted from (its rows are the table's rows).
        emitted: the emission (layout and op objects), for incremental compilation.
        nodes, tail, head: the network the routes were found on (node names, arc endpoints).
        arcs: ``(R, L)`` each route's arcs on that network (-1 padded).
        link_chunks: ``(A,)`` chunks per arc of that network (all routes).
        certificate: prices on that network's arcs that bound its LP (the
            schedule's ``bound``), for any capacities (:class:`.cg.Certificate`).
        route, route_offset: the table's ``route`` and ``offset`` columns as arrays.
    """

    paths: Mapping[str, Any]
    plan: Plan
    emitted: Emitted
    nodes: tuple
    tail: np.ndarray
    head: np.ndarray
    arcs: np.ndarray
    link_chunks: np.ndarray
    certificate: Certificate | None = None
    route: np.ndarray | None = None
    route_offset: np.ndarray | None = None

    def arcs_on(self, nodes: tuple, tail: np.ndarray, head: np.ndarray) -> np.ndarray | None:
        """``arcs`` if a network has the same nodes and links (the same arc numbering), else None."""
        if nodes != self.nodes or not (np.array_equal(tail, self.tail) and np.array_equal(head, self.head)):
            return None
        return self.arcs


_LOCK = threading.Lock()
_STATES: dict[int, tuple[weakref.ref, WarmState]] = {}


def remember(schedule: Schedule, state: WarmState) -> None:
    """Keeps ``state`` for ``schedule`` until the schedule is garbage collected."""
    key = id(schedule)
    with _LOCK:
        _STATES[key] = (weakref.ref(schedule), state)
    weakref.finalize(schedule, _forget, key, state)


def recall(schedule: Schedule) -> WarmState | None:
    """The state remembered for this very schedule object (None if none, or if its ``info["paths"]`` changed)."""
    with _LOCK:
        entry = _STATES.get(id(schedule))
    if entry is None or entry[0]() is not schedule:
        return None
    state = entry[1]
    if schedule.info.get("paths") is not state.paths:
        return None
    return state


def _forget(key: int, state: WarmState) -> None:
    with _LOCK:
        entry = _STATES.get(key)
        if entry is not None and entry[1] is state:
            del _STATES[key]
