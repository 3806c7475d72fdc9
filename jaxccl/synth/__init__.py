"""Schedule synthesizers and baselines; each returns a :class:`jaxccl.schedule.Schedule`."""

# Importing a subpackage binds its name on this package; the function imports below
# rebind ``allgather``/``alltoall`` to the synthesizers themselves (the API contract).
from jaxccl.synth.allgather import allgather, reduce_scatter
from jaxccl.synth.alltoall import alltoall
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
    "allgather",
    "alltoall",
    "reduce_scatter",
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
