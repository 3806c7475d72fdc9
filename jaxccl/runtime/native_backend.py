"""The native backends: the flat collective as one XLA FFI custom call into the jaxccl executor.

The call is ``jaxccl_cpu_collective`` (``jaxccl_cuda_collective`` on GPUs)
with operands ``x`` (this rank's flat input) and ``coords = [rank, group]``
(int32): ``rank`` the device's rank along the collective's axis, axes or
axis-index group (:mod:`jaxccl.runtime.axes`) and ``group`` the linear index
of its coordinates along the other manual mesh axes (times the number of
axis-index groups, plus its group), so that the independent groups of a
collective rendezvous separately. Attributes (compile-time): ``slot`` (the communicator's registry
slot of that collective, whose table the executor reads at run time, which is
what makes hot-swap recompile-free), ``site`` (a unique id of the lowered call
site, part of the rendezvous key), ``axis_size`` and ``reduce_op`` (the
operator of a reducing table, :class:`~jaxccl.schedule.reduction.ReduceOp`:
one table serves sum, max and min). In a job of several
processes the call is ``jaxccl_cpu_mp_collective`` (``jaxccl_cuda_mp_collective``),
which runs this process's ranks and reaches the others through the transport
attached with :func:`jaxccl.distributed.transport.attach` (:func:`target`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxccl.runtime import axes as _axes
from jaxccl.schedule.ir import Collective

__all__ = ["MULTIPROCESS_TARGETS", "TARGETS", "auto_backend", "flat_collective", "output_elems", "target"]

TARGETS = {"cpu": "jaxccl_cpu_collective", "cuda": "jaxccl_cuda_collective"}
MULTIPROCESS_TARGETS = {"cpu": "jaxccl_cpu_mp_collective", "cuda": "jaxccl_cuda_mp_collective"}


def target(backend: str, process_count: int) -> str:
    """The FFI target of ``backend`` ("cpu" or "cuda") in a job of ``process_count`` processes.

    Across processes the call is the one that runs this process's ranks and reaches the others through
    the attached transport; it is taken for every collective then, also one whose ranks all run here.

    >>> target("cuda", 1), target("cuda", 2)
    ('jaxccl_cuda_collective', 'jaxccl_cuda_mp_collective')
    """
    return (MULTIPROCESS_TARGETS if process_count > 1 else TARGETS)[backend]


def auto_backend(platform: str, *, process_count: int, native: bool, cuda: bool, transport: bool) -> str:
    """What ``backend="auto"`` runs on ``platform``: the native executor of the platform where it can run,
    else ``"ppermute"``.

    ``native``: ``jaxccl._native`` loads; ``cuda``: the CUDA executor loads and sees a GPU; ``transport``: a
    transport's process groups are attached (across processes the native backends need one).

    >>> auto_backend("cuda", process_count=2, native=True, cuda=True, transport=True)
    'cuda'
    >>> auto_backend("cpu", process_count=2, native=True, cuda=False, transport=False)
    'ppermute'
    """
    if not native or (process_count > 1 and not transport):
        return "ppermute"
    if platform == "cpu":
        return "cpu"
    if platform == "cuda" and cuda:
        return "cuda"
    return "ppermute"


def output_elems(coll: Collective, input_elems: int, n: int) -> int:
    """Elements of a rank's flat output for a flat input of ``input_elems``."""
    if coll is Collective.ALL_GATHER:
        return n * input_elems
    if coll is Collective.REDUCE_SCATTER:
        return input_elems // n
    return input_elems


def _group(group_axes: tuple[tuple[object, int], ...]) -> jax.Array:
    g = jnp.int32(0)
    for name, size in group_axes:
        g = g * size + lax.axis_index(name).astype(jnp.int32)
    return g


def flat_collective(
    coll: Collective,
    flat: jax.Array,
    *,
    axis_name,
    axis_size: int,
    group_axes: tuple[tuple[object, int], ...],
    slot: int,
    site: int,
    backend: str = "cpu",
    dep: jax.Array | None = None,
    reduce_op: int = 0,
    first_group: int = 0,
) -> jax.Array:
    """Runs collective ``coll`` of the table in registry ``slot`` on this rank's flat buffer.

    ``dep``, an int32 zero computed from an earlier collective's result, is
    added to ``coords`` so that XLA runs this call after that one. ``reduce_op``
    is the code of the reduction operator (ignored by tables that do not reduce).
    ``first_group`` is where the groups of the collective's attached layout start
    across processes (:mod:`jaxccl.runtime.process_layouts`; 0 in one process).
    """
    from jaxccl.runtime import native  # registers the FFI targets on import

    del native
    n = int(axis_size)
    rank = _axes.axis_index(axis_name) if n > 1 else jnp.int32(0)
    group = first_group + _group(group_axes) * _axes.num_groups(axis_name) + _axes.group_id(axis_name)
    coords = jnp.stack([rank, group]).astype(jnp.int32)
    if dep is not None:
        coords = coords + dep
    out = jax.ShapeDtypeStruct((output_elems(coll, int(flat.shape[0]), n),), flat.dtype)
    call = jax.ffi.ffi_call(target(backend, jax.process_count()), out, has_side_effect=True)
    return call(
        flat, coords, slot=np.int64(slot), site=np.int64(site), axis_size=np.int64(n), reduce_op=np.int64(reduce_op)
    )
