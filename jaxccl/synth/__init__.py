"""Schedule synthesizers and baselines; each returns a :class:`jaxccl.schedule.Schedule`.

The synthesizers are named after the collective they synthesize, spelled as
:class:`~jaxccl.schedule.Collective` spells it: :func:`all_gather`,
:func:`reduce_scatter`, :func:`all_to_all` (MCCL's tree packing and column
generation); the baselines keep the names of their algorithms
(:func:`ring_allgather`, :func:`direct_alltoall`, ...).

Names kept for compatibility, and why. The old names ``allgather`` and
``alltoall`` are deprecated aliases of :func:`all_gather` and
:func:`all_to_all` (removed in the next release): calling them warns
(``DeprecationWarning``). They cannot warn on attribute access, because they are
also the names of the subpackages that hold the code
(:mod:`jaxccl.synth.allgather`, :mod:`jaxccl.synth.alltoall`), which keep
their names and their import paths: ``import jaxccl.synth.allgather.driver``
and ``from jaxccl.synth.alltoall import decode_paths`` work as before. As
before, the attribute ``jaxccl.synth.allgather`` is the function, not the
subpackage (so ``import jaxccl.synth.allgather as m`` binds the function; reach
the subpackage with ``importlib.import_module("jaxccl.synth.allgather")``).
Renaming the subpackages too would move every module path of the synthesizers
for a spelling; they stay.

>>> from jaxccl.topology import rail
>>> all_gather(rail(hosts=2, gpus_per_host=2)).collective.value
'all_gather'
"""

import functools
import warnings
from collections.abc import Callable
from typing import Any

from jaxccl.schedule import Schedule

# Importing a subpackage binds its name on this package; the deprecated aliases below
# rebind ``allgather``/``alltoall`` to functions (what callers of the old names expect).
from jaxccl.synth.allgather import allgather as all_gather
from jaxccl.synth.allgather import reduce_scatter
from jaxccl.synth.alltoall import alltoall as all_to_all
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
    "all_gather",
    "all_to_all",
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


def _deprecated_alias(old: str, new_name: str, new: Callable[..., Schedule]) -> Callable[..., Schedule]:
    """``new`` under its old name ``old``: the same function, warning at every call."""

    @functools.wraps(new)
    def alias(*args: Any, **kwargs: Any) -> Schedule:
        warnings.warn(
            f"jaxccl.synth.{old} is deprecated: use jaxccl.synth.{new_name} (the old name is removed in the next "
            "release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return new(*args, **kwargs)

    alias.__doc__ = f"Deprecated alias of :func:`{new_name}` (removed in the next release)."
    alias.__name__ = alias.__qualname__ = old
    return alias


allgather = _deprecated_alias("allgather", "all_gather", all_gather)
alltoall = _deprecated_alias("alltoall", "all_to_all", all_to_all)
