"""The layouts attached across processes: which native group index each collective's group has.

A *layout* is a mesh and the axes its collectives run over (``"model"``, ``("data", "model")``).
:func:`jaxccl.distributed.transport.attach` gives each attached layout its groups in the native
executor (one per coordinate of the other mesh axes), after those of the layouts attached before;
:func:`record` keeps where they start, and the lowering of a native collective across processes
adds :func:`first_group` to its group's linear index. So one program can run collectives over
several axes of a mesh, inside a process and across processes, each on its own groups. The index
is part of the compiled program: recording or clearing layouts makes jitted functions trace again
(as a schedule change does on the ``ppermute`` backend), so a program never runs with the groups of
an earlier attachment.

>>> import jax, numpy as np
>>> from jax.sharding import Mesh
>>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
>>> record(mesh, "y", first_group=0, number=0); record(mesh, ("x", "y"), first_group=2, number=1)
>>> first_group(("x", "y"), (2, 2), ("x", "y")), find(mesh, "y").number
(2, 0)
>>> clear()
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxccl.errors import ExecutorError

__all__ = ["Layout", "clear", "find", "first_group", "record"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """One attached layout.

    Attributes:
        first_group: the native group index of the layout's group 0.
        number: its number, in the order attached (what :class:`~jaxccl.distributed.transport.TransportMeter`
            filters by).
        devices: the mesh's device ids, in mesh order.
    """

    first_group: int
    number: int
    devices: tuple[int, ...]


_layouts: dict[tuple, Layout] = {}


def _key(mesh_axis_names: Any, mesh_shape: Any, axis_name: Any) -> tuple:
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return (tuple(mesh_axis_names), tuple(int(s) for s in mesh_shape), axes)


def _devices(mesh: Any) -> tuple[int, ...]:
    return tuple(int(d.id) for d in np.asarray(mesh.devices).flat)


def find(mesh: Any, axis_name: Any) -> Layout | None:
    """The attached layout of ``axis_name`` of ``mesh``, or None.

    Raises:
        ExecutorError: a mesh with the same axis names and shape on other devices is attached for these axes
            (a collective could not tell the two apart).
    """
    held = _layouts.get(_key(mesh.axis_names, np.shape(mesh.devices), axis_name))
    if held is not None and held.devices != _devices(mesh):
        raise ExecutorError(
            f"attach(): {axis_name!r} of a mesh with axes {tuple(mesh.axis_names)} and shape "
            f"{np.shape(mesh.devices)} is attached on other devices; detach() first"
        )
    return held


def record(mesh: Any, axis_name: Any, *, first_group: int, number: int) -> None:
    """Records that ``axis_name`` of ``mesh`` is attached, its groups starting at native index ``first_group``."""
    _layouts[_key(mesh.axis_names, np.shape(mesh.devices), axis_name)] = Layout(first_group, number, _devices(mesh))
    _retrace()


def first_group(mesh_axis_names: Any, mesh_shape: Any, axis_name: Any) -> int:
    """The native index of group 0 of the attached layout of ``axis_name`` on a mesh of that shape.

    Raises:
        ExecutorError: no layout is attached for those axes of such a mesh.
    """
    held = _layouts.get(_key(mesh_axis_names, mesh_shape, axis_name))
    if held is None:
        attached = sorted(f"{k[2]} of a mesh {dict(zip(k[0], k[1]))}" for k in _layouts)
        raise ExecutorError(
            f"jaxccl: a native collective over {axis_name!r} of a mesh {dict(zip(mesh_axis_names, mesh_shape))} "
            f"runs across processes, but no transport is attached for those axes (attached: {attached or 'none'}); "
            "call jaxccl.distributed.transport.attach(transport, mesh, axis_name) in every process first"
        )
    return held.first_group


def clear() -> None:
    """Forgets every layout (the transport was detached)."""
    _layouts.clear()
    _retrace()


def _retrace() -> None:
    """Makes jitted functions trace again (the layouts' group indices are part of compiled programs)."""
    from jaxccl.runtime.communicator import _bump_generation  # imports JAX: not at import time

    _bump_generation()
