"""Which links a synthesizer uses: links far slower than the fabric count as absent.

A link whose capacity is below :data:`DEAD_LINK_FRACTION` of the fabric's
largest link capacity is treated as absent by every synthesizer (a failed
link that measures a few bytes per second, say). Such a link adds at most
its own capacity to any cut, so leaving it out lowers the optimum by at
most that capacity per cut it crosses, while keeping it would put
capacities ten thousand times apart into the same LP or max-flow: solver
tolerances then decide the schedule (HiGHS rejects models whose
coefficients span that far, and rounding noise misplaces chunks). If
leaving the dead links out isolates a GPU, the synthesizers raise a
:class:`~jaxccl.errors.TopologyError` naming the link to restore.

>>> from jaxccl.topology import ring
>>> t = ring(4).degrade(0, 1, capacity=1.0)
>>> [(u, v) for u, v, _ in dead_links(t)]
[(0, 1), (1, 0)]
>>> usable_topology(t).has_edge(0, 1), usable_topology(ring(4)) == ring(4)
(False, True)
"""

from __future__ import annotations

from jaxccl.errors import TopologyError
from jaxccl.topology import Topology

DEAD_LINK_FRACTION = 1e-4


def dead_links(topo: Topology) -> list[tuple]:
    """``(u, v, capacity)`` of every link below :data:`DEAD_LINK_FRACTION` of the largest capacity."""
    caps = [cap for _, _, cap, _ in topo.edges()]
    if not caps:
        return []
    floor = DEAD_LINK_FRACTION * max(caps)
    return [(u, v, cap) for u, v, cap, _ in topo.edges() if cap < floor]


def usable_topology(topo: Topology) -> Topology:
    """``topo`` without its dead links (``topo`` itself when it has none).

    Raises:
        TopologyError: if without them some GPU cannot send to or receive
            from every other GPU; the message names the dead links to restore.
    """
    if not isinstance(topo, Topology):
        raise TopologyError(f"expected a jaxccl.topology.Topology, got {type(topo).__name__}")
    dead = dead_links(topo)
    if not dead:
        return topo
    try:
        kept = topo.with_edges({(u, v): None for u, v, _ in dead})
    except TopologyError as e:  # the topology itself refuses to be disconnected
        shown = ", ".join(f"{u!r}->{v!r} ({cap:.3g} B/s)" for u, v, cap in dead[:4])
        raise TopologyError(
            f"{e}, once the links below {DEAD_LINK_FRACTION:g} of the fastest link are left out as dead: "
            f"{shown}{' ...' if len(dead) > 4 else ''}; restore one of them (give it at least that capacity)"
        ) from None
    return kept
