"""Argument types and checks shared by the ``jaxccl`` subcommands.

Every function here turns user input into a value or raises
:class:`UsageError` with one line that names the problem; the entry point
(:func:`jaxccl.cli.main`) prints that line and exits with status 2. The same
functions serve as argparse ``type=`` callables, whose errors argparse reports
the same way.

Example:
    >>> positive_int("3")
    3
    >>> host_counts("2,4,8")
    (2, 4, 8)
    >>> parse_size("128M"), parse_size("1GiB")
    (134217728, 1073741824)
    >>> topology("rail:2x4").num_gpus
    8
    >>> topology("rail:2x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxccl.errors.UsageError: bad topology 'rail:2x': use rail:SxHxN, rail:HxN, ...
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from typing import Any

from jaxccl import topology as t
from jaxccl.errors import JaxcclError, UsageError
from jaxccl.topology import Topology

__all__ = [
    "TOPOLOGY_FORMS",
    "HostCountsAction",
    "UsageError",
    "host_counts",
    "parse_size",
    "positive_float",
    "positive_int",
    "require_matplotlib",
    "topology",
]

TOPOLOGY_FORMS = "rail:SxHxN, rail:HxN, single:N, ring:N, fattree:LxG or a topology JSON file"
_KINDS = ("rail", "single", "ring", "fattree")
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def positive_int(text: str) -> int:
    """An integer >= 1.

    >>> positive_int("0")
    Traceback (most recent call last):
    ...
    jaxccl.errors.UsageError: expected a positive integer, got '0'
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"expected a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0.

    >>> positive_float("3e-4")
    0.0003
    """
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise UsageError(f"expected a positive number, got {text!r}")
    return value


def host_counts(text: str) -> tuple[int, ...]:
    """``"4"`` or ``"2,4,8"``: hosts of rail topologies ``1 x H x N``."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise UsageError(f"expected host counts like 4 or 2,4,8, got {text!r}")
    try:
        return tuple(positive_int(p.strip()) for p in parts)
    except UsageError:
        raise UsageError(f"expected host counts like 4 or 2,4,8, got {text!r}") from None


class HostCountsAction(argparse.Action):
    """``--hosts 2,4,8`` or ``--hosts 2 4 8`` (``nargs="+"``, ``type=host_counts``): one flat tuple.

    >>> p = argparse.ArgumentParser()
    >>> _ = p.add_argument("--hosts", nargs="+", type=host_counts, action=HostCountsAction)
    >>> p.parse_args(["--hosts", "2,4", "8"]).hosts
    (2, 4, 8)
    """

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, tuple(h for group in values for h in group))


def parse_size(text: str) -> int:
    """``"128M"``, ``"1GiB"``, ``"4096"`` -> bytes (binary units, at least 1)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"not a size: {text!r} (e.g. 128M, 1G, 4096)")
    unit = (m.group(2) or "").lower().rstrip("b").rstrip("i")
    try:
        n = int(float(m.group(1)) * _UNITS[unit])
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"not a size: {text!r} (e.g. 128M, 1G, 4096)")
    return n


def _preset(kind: str, dims: list[int]) -> Any:
    if kind == "rail" and len(dims) == 3:
        return t.rail(hosts=dims[1], gpus_per_host=dims[2], segments=dims[0])
    if kind == "rail" and len(dims) == 2:
        return t.rail(hosts=dims[0], gpus_per_host=dims[1])
    if kind == "single" and len(dims) == 1:
        return t.single_node(dims[0])
    if kind == "ring" and len(dims) == 1:
        return t.ring(dims[0])
    if kind == "fattree" and len(dims) == 2:
        return t.fat_tree(dims[0], dims[1])
    return None


def read_text(path: str, what: str) -> str:
    """The text of the file at ``path``; ``UsageError`` naming ``what`` if it cannot be read."""
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {what}: {e}") from None


def topology(spec: str) -> Any:
    """A :class:`~jaxccl.topology.Topology` from a preset spec (``rail:1x2x8``) or a topology JSON file.

    Raises:
        UsageError: a malformed spec, a missing or unreadable file, or JSON
            that is not a valid topology.
    """
    kind, sep, arg = spec.partition(":")
    if sep and kind in _KINDS:
        try:
            dims = [int(x) for x in arg.lower().split("x")]
        except ValueError:
            dims = []
        try:
            topo = _preset(kind, dims)
        except JaxcclError as e:
            raise UsageError(f"bad topology {spec!r}: {e}") from None
        if topo is None:
            raise UsageError(f"bad topology {spec!r}: use {TOPOLOGY_FORMS}")
        return topo
    if not os.path.exists(spec):
        if sep:
            raise UsageError(f"bad topology {spec!r}: use {TOPOLOGY_FORMS}")
        raise UsageError(f"topology file {spec!r} does not exist (nor is it a preset such as rail:1x2x8)")
    text = read_text(spec, f"topology file {spec!r}")
    try:
        return Topology.from_json(text)
    except JaxcclError as e:
        raise UsageError(f"topology file {spec!r}: {e}") from None


def require_matplotlib(option: str = "--png") -> None:
    """Fails fast, before any work, when ``option`` needs matplotlib and it is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{option} needs matplotlib, which is not installed (pip install matplotlib)")
