"""Schedule synthesizers and baselines; each returns a :class:`jaxccl.schedule.Schedule`."""

from jaxccl.synth.baselines import (
    binary_tree_allreduce,
    direct_alltoall,
    direct_reduce_scatter,
    double_binary_tree_allreduce,
    ordered_allreduce,
    rail_ring_order,
    recursive_doubling_allgather,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)

__all__ = [
    "binary_tree_allreduce",
    "direct_alltoall",
    "direct_reduce_scatter",
    "double_binary_tree_allreduce",
    "ordered_allreduce",
    "rail_ring_order",
    "recursive_doubling_allgather",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
]
