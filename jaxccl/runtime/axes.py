"""Which devices a collective runs over: one mesh axis, several at once, or groups of an axis.

``jax.lax`` collectives take ``axis_name`` as one name or a tuple of names and
optionally ``axis_index_groups``. A collective over a tuple of axes runs over
the devices that share the coordinates of every *other* axis; its rank is the
linear index of the device's coordinates along the named axes **in the order
of the tuple** (``("y", "x")`` makes ``y`` the major one), as
``jax.lax.axis_index`` numbers them and as XLA's replica groups order them.
With ``axis_index_groups`` each listed group runs separately, and a device's
rank is its position within its group's list. Reductions also take groups of
different sizes (as ``jax.lax``); they run as one collective per size
(:func:`size_classes`), each over groups that cover part of the axis: a device
outside them is not a member (:func:`is_member`) and takes no part.

The primitives carry ``axis_name`` (a name, or a tuple of two or more) and
``axis_index_groups`` (``None`` or a tuple of tuples); :func:`grouped` turns
them into what the backends index and permute over, and :func:`axis_index`
and :func:`ppermute` work on either form.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    >>> g = grouped("i", ((0, 2), (3, 1)))
    >>> f = jax.shard_map(lambda x: axis_index(g)[None], mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    >>> f(np.zeros(4, np.int32)).tolist()  # device 3 is rank 0 of its group, device 1 rank 1
    [0, 1, 1, 0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxccl.errors import ArgumentError, UnsupportedTypeError

__all__ = [
    "GroupedAxis",
    "axis_index",
    "canonical_groups",
    "class_index",
    "group_id",
    "grouped",
    "is_member",
    "names",
    "num_groups",
    "partial",
    "ppermute",
    "size_classes",
]


def names(axis_name: Any) -> tuple[Hashable, ...]:
    """The mesh axis names of a primitive's ``axis_name`` (a name or a tuple of names), in order.

    >>> names("x"), names(("y", "x"))
    (('x',), ('y', 'x'))
    """
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


@dataclasses.dataclass(frozen=True)
class GroupedAxis:
    """An axis (or tuple of axes) split into ``groups``: lists of indices along it, all of one size.

    The groups cover the axis, or part of it (one size of uneven groups, :func:`size_classes`):
    a device in none of them is not a member and takes no part in the collective.

    Attributes:
        axis_name: a name or a tuple of names (their linear index is what ``groups`` lists).
        groups: each group's indices; a device's rank is its position in its group.
    """

    axis_name: Any
    groups: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Devices per group."""
        return len(self.groups[0])

    def _table(self, which: int) -> np.ndarray:
        """Per index along the axis: its rank (0), its group (1) or whether it is a member (2); 0 outside."""
        out = np.zeros(lax.axis_size(self.axis_name), np.int32)
        for gid, group in enumerate(self.groups):
            for pos, idx in enumerate(group):
                out[idx] = (pos, gid, 1)[which]
        return out

    def _lookup(self, which: int) -> jax.Array:
        idx = lax.axis_index(self.axis_name)
        return lax.dynamic_index_in_dim(jnp.asarray(self._table(which)), idx, keepdims=False)


def grouped(axis_name: Any, groups: Sequence[Sequence[int]] | None) -> Any:
    """``axis_name`` itself without groups, else a :class:`GroupedAxis` (what backends pass around)."""
    if groups is None:
        return axis_name
    return GroupedAxis(axis_name, tuple(tuple(int(i) for i in g) for g in groups))


def axis_index(axis: Any) -> jax.Array:
    """This device's rank along ``axis`` (a name, a tuple of names or a :class:`GroupedAxis`); int32."""
    if isinstance(axis, GroupedAxis):
        return axis._lookup(0)
    return lax.axis_index(axis).astype(jnp.int32)


def group_id(axis: Any) -> jax.Array:
    """Which group of ``axis`` this device is in (0 without groups); int32."""
    if isinstance(axis, GroupedAxis):
        return axis._lookup(1)
    return jnp.int32(0)


def num_groups(axis: Any) -> int:
    """How many groups ``axis`` has (1 without groups)."""
    return len(axis.groups) if isinstance(axis, GroupedAxis) else 1


def partial(axis: Any) -> bool:
    """Whether ``axis``'s groups leave some devices of the axis out (inside ``shard_map``: it reads the size)."""
    return isinstance(axis, GroupedAxis) and sum(map(len, axis.groups)) < lax.axis_size(axis.axis_name)


def is_member(axis: Any) -> jax.Array:
    """Whether this device is in one of ``axis``'s groups (always, without groups); bool."""
    if isinstance(axis, GroupedAxis):
        return axis._lookup(2).astype(bool)
    return jnp.bool_(True)


def size_classes(groups: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Uneven ``axis_index_groups`` split by size: one tuple of groups per size, smallest first.

    >>> size_classes(((2, 3, 4), (0, 1), (5, 6, 7)))
    (((0, 1),), ((2, 3, 4), (5, 6, 7)))
    """
    by_size: dict[int, list[tuple[int, ...]]] = {}
    for g in groups:
        by_size.setdefault(len(g), []).append(tuple(g))
    return tuple(tuple(by_size[k]) for k in sorted(by_size))


def class_index(axis_name: Any, classes: Sequence[Sequence[Sequence[int]]]) -> jax.Array:
    """Which of :func:`size_classes`'s classes this device's group is in; int32."""
    table = np.zeros(lax.axis_size(axis_name), np.int32)
    for k, groups in enumerate(classes):
        for g in groups:
            table[list(g)] = k
    return lax.dynamic_index_in_dim(jnp.asarray(table), lax.axis_index(axis_name), keepdims=False)


def ppermute(x: jax.Array, axis: Any, perm: Sequence[tuple[int, int]]) -> jax.Array:
    """``lax.ppermute`` with ``perm`` given in ranks of ``axis``; with groups, every group permutes alike.

    ``lax.ppermute`` over a tuple of axes numbers the devices in mesh order
    whatever the order of the tuple, unlike ``lax.axis_index`` and the other
    collectives; the pairs are translated so that rank ``r`` here is
    ``axis_index(axis) == r`` there.
    """
    axis_name = axis.axis_name if isinstance(axis, GroupedAxis) else axis
    pairs = [tuple(p) for p in perm]
    if isinstance(axis, GroupedAxis):
        pairs = [(g[src], g[dst]) for g in axis.groups for src, dst in pairs]
    to_mesh = _mesh_order(names(axis_name))
    if to_mesh is not None:
        pairs = [(to_mesh[src], to_mesh[dst]) for src, dst in pairs]
    return lax.ppermute(x, axis_name, perm=pairs)


def _mesh_order(axes: tuple[Hashable, ...]) -> list[int] | None:
    """Index along ``axes`` (tuple order) -> index along the same axes in mesh order; None if they agree."""
    if len(axes) < 2:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    in_mesh = sorted(axes, key=tuple(mesh.axis_names).index)
    if list(in_mesh) == list(axes):
        return None
    sizes = [int(mesh.shape[a]) for a in axes]
    coords = np.unravel_index(np.arange(int(np.prod(sizes))), sizes)
    by_name = dict(zip(axes, coords))
    return np.ravel_multi_index([by_name[a] for a in in_mesh], [int(mesh.shape[a]) for a in in_mesh]).tolist()


def canonical_groups(
    fn: str, groups: Any, axis_size: int, *, uneven: bool = False
) -> tuple[tuple[int, ...], ...] | None:
    """``axis_index_groups`` checked as ``jax.lax`` checks them and made hashable.

    ``uneven``: groups may differ in size (``jax.lax`` allows it for ``psum``, ``pmax``,
    ``pmin`` and ``pmean``, not for the collectives whose output shape depends on the size).

    Raises:
        ValueError: the groups are empty, of different sizes (unless ``uneven``), or do not
            cover ``0..axis_size-1`` exactly once.

    >>> canonical_groups("psum", [[0, 2], [3, 1]], 4)
    ((0, 2), (3, 1))
    >>> canonical_groups("psum", [[0, 1], [2, 3, 4]], 5, uneven=True)
    ((0, 1), (2, 3, 4))
    """
    if groups is None:
        return None
    try:
        out = tuple(tuple(int(i) for i in g) for g in groups)
    except TypeError:
        raise UnsupportedTypeError(
            f"jaxccl.{fn}: axis_index_groups must be a list of lists of ints, got {groups!r}"
        ) from None
    if not out or not all(out):
        raise ArgumentError(f"jaxccl.{fn}: axis_index_groups must not be empty, got {groups!r}")
    if not uneven and len({len(g) for g in out}) != 1:
        raise ArgumentError(
            f"jaxccl.{fn}: axis_index_groups must all be the same size (as jax.lax.{fn} requires; only the "
            f"reductions take groups of different sizes), got {groups!r}"
        )
    if sorted(i for g in out for i in g) != list(range(axis_size)):
        raise ArgumentError(
            f"jaxccl.{fn}: axis_index_groups must cover every index of the axis (size {axis_size}) exactly once, "
            f"got {groups!r}"
        )
    return out
