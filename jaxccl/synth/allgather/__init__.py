"""Throughput-optimal AllGather (and ReduceScatter) by spanning-tree packing.

ForestColl's three phases as MCCL Sec. 4.3 summarizes them, plus MCCL's
extensions:

1. :mod:`~jaxccl.synth.allgather.bound` -- the optimal throughput by
   max-flow from a super source to every GPU (exact rationals);
2. :mod:`~jaxccl.synth.allgather.switch_removal` (``method="forestcoll"``)
   or :mod:`~jaxccl.synth.allgather.latency` (``method="latency"``, MCCL
   App. C) -- switches replaced by logical GPU-to-GPU links that keep that
   throughput;
3. :mod:`~jaxccl.synth.allgather.packing` -- ``k`` spanning arborescences
   per root with integer chunk counts;

then :mod:`~jaxccl.synth.allgather.compile` turns the trees into the
Schedule IR. ``previous=`` warm-starts from an earlier schedule
(ForestColl-warm, MCCL Sec. 4.3): the rate from a few cuts (GPU in-cuts,
the previous critical cut, the cuts around every switch) instead of the
max-flow search, and the previous trees kept wherever they still fit with
only what they lost re-grown (:mod:`~jaxccl.synth.allgather.warm`,
:mod:`~jaxccl.synth.allgather.repair`), then lifted to shallower parents
(:mod:`~jaxccl.synth.allgather.shorten`); the complete trees certify the
rate. If that fails, the cold path runs. :mod:`~jaxccl.synth.allgather.driver`
runs the phases; this package re-exports its entry points.
"""

from jaxccl.synth.allgather.driver import DEFAULT_METHOD, METHODS, allgather, reduce_scatter, reversed_topology

__all__ = ["DEFAULT_METHOD", "METHODS", "allgather", "reduce_scatter", "reversed_topology"]
