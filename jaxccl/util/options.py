"""Keywords that pick a variant: one check for a bad value, one way to rename a keyword.

The rule (``docs/architecture.md``, "Named errors"): a keyword that chooses
*the* variant of a function is spelled ``method=``
(``synth.all_gather(topo, method="latency")``, ``synth.all_to_all(topo,
method="dag")``, ``nccl_allreduce(topo, method="tree")``); a function with
several independent choices keeps a name for each (``sim.run(routing=,
execution=, sharing=)``), and so does a keyword that mirrors ``jax.lax``
(``all_gather(..., to=)``) or names a component (``Communicator(backend=)``). Every such keyword checks its
value with :func:`choose`, so a bad value is always an
:class:`~jaxccl.errors.OptionError` (a ``ValueError``) whose message names the
keyword, the value and every valid choice. A renamed keyword stays for one
release as a deprecated alias through :func:`renamed`.

>>> choose("method", "latency", ("forestcoll", "latency"))
'latency'
>>> choose("method", "magic", ("forestcoll", "latency"))
Traceback (most recent call last):
...
jaxccl.errors.OptionError: method='magic' is not one of 'forestcoll', 'latency'
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Any, TypeVar

from jaxccl.errors import ArgumentError, OptionError

_T = TypeVar("_T")

__all__ = ["choose", "renamed"]


def choose(option: str, value: _T, choices: Collection[str], *, allow_none: bool = False) -> _T:
    """Returns ``value`` if it is one of ``choices`` (or None with ``allow_none``), else raises.

    Args:
        option: the keyword's name, for the message.
        value: what the caller passed.
        choices: the valid values, in the order the message lists them.
        allow_none: None is valid too (it picks a documented default).

    Raises:
        OptionError: ``value`` is not a valid choice (also for a value of another type, unhashable ones included).

    >>> choose("pricing", None, ("dag", "dijkstra"), allow_none=True) is None
    True
    >>> choose("routing", 3, ("primary", "ecmp"))
    Traceback (most recent call last):
    ...
    jaxccl.errors.OptionError: routing=3 is not one of 'primary', 'ecmp'
    """
    if (value is None and allow_none) or (isinstance(value, str) and value in choices):
        return value
    valid = ", ".join(repr(c) for c in choices) + (" or None" if allow_none else "")
    raise OptionError(f"{option}={value!r} is not one of {valid}")


def renamed(function: str, old: str, old_value: Any, new: str, new_value: _T, default: _T) -> _T:
    """The value of keyword ``new`` of ``function``, taken from its deprecated old name ``old`` when that was given.

    The function keeps ``old`` as a keyword defaulting to None and calls this first; passing ``old`` warns
    (``DeprecationWarning``; the old name is removed in the next release).

    Args:
        function: the function's name, for the messages.
        old: the deprecated keyword.
        old_value: what the caller passed as ``old`` (None: not given).
        new: the keyword that replaces it.
        new_value: what the caller passed as ``new``.
        default: ``new``'s default (a caller who gave both names gets an error).

    Raises:
        ArgumentError: both ``old`` and ``new`` were given.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     renamed("nccl_allreduce", "algorithm", "tree", "method", "ring", "ring")
    'tree'
    >>> str(caught[0].message)
    'nccl_allreduce(algorithm=...) is deprecated: use method=...; algorithm= is removed in the next release'
    >>> renamed("nccl_allreduce", "algorithm", None, "method", "tree", "ring")
    'tree'
    """
    if old_value is None:
        return new_value
    warnings.warn(
        f"{function}({old}=...) is deprecated: use {new}=...; {old}= is removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    if new_value != default:
        raise ArgumentError(f"{function}: give {new}= or its deprecated name {old}=, not both")
    return old_value
