"""``nvidia-smi topo -m`` import: the matrix of GPU and NIC pairs.

The output looks like this (tab-separated; a terminal gets the header underlined with escape codes)::

            GPU0    GPU1    NIC0    CPU Affinity    NUMA Affinity   GPU NUMA ID
    GPU0     X      NV12    PXB     0-31            0               N/A
    GPU1    NV12     X      SYS     32-63           1               N/A
    NIC0    PXB     SYS      X

    Legend:
      X    = Self
      SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
      NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
      PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
      PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
      PIX  = Connection traversing at most a single PCIe bridge
      NV#  = Connection traversing a bonded set of # NVLinks

    NIC Legend:
      NIC0: mlx5_0

The matrix names path types, not link speeds, so the topology it gives uses nominal figures:

- **GPUs** ``GPU0..GPU<N-1>`` are ranks ``0..N-1``; every other row is a NIC (``nic:<name>``, named
  by the NIC legend when there is one). NIC speeds are not in the matrix: a NIC has its PCIe link only.
- **NVLink**: ``NV#`` is ``#`` links of :data:`NVLINK_BYTES_PER_S` (25 GB/s per direction, NVLink 2
  to 4; the matrix does not say the generation). A GPU whose ``NV#`` add up to more than
  :data:`MAX_NVLINKS_PER_GPU` (18, the most any GPU has) reaches its peers through NVSwitches: all
  such GPUs then link to one switch ``nvs:h0`` with their largest ``#``; otherwise every ``NV#`` is
  a direct GPU-GPU link.
- **PCIe**: devices joined by ``PIX`` or ``PXB`` share a PCIe switch ``pcie:<i>``; devices joined
  by anything but ``SYS`` (or GPUs with the same ``NUMA Affinity``) share a CPU socket
  ``cpu:<i>``. Every device links to its PCIe switch, or to its CPU if it has none, and every
  switch to its CPU, at :data:`PCIE_BYTES_PER_S` (PCIe Gen4 x16, 31.5 GB/s). ``PHB`` and ``NODE``
  both go through the CPU. CPU sockets are joined pairwise at
  :data:`jaxccl.topology.nccl_xml.SYS_BYTES_PER_S` (64 GB/s).

A matrix that is not square, not symmetric, names an unknown path type, has ``X`` off the
diagonal, puts ``SYS`` inside one socket, or lists no GPU raises
:class:`~jaxccl.errors.TopologyError` naming the problem.

Example:
    >>> text = '''\\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity
    ... GPU0\\t X \\tNV4\\t0-7\\t0
    ... GPU1\\tNV4\\t X \\t0-7\\t0
    ... '''
    >>> t = from_nvidia_smi(text)
    >>> t.num_gpus, t.capacity(0, 1) / 1e9, round(t.capacity(0, "cpu:0") / 1e9, 2)
    (2, 100.0, 31.51)
"""

from __future__ import annotations

import re
from typing import Any

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology.graph import Topology
from jaxccl.topology.nccl_xml import (
    NVLINK_LATENCY,
    PCIE_LATENCY,
    SYS_BYTES_PER_S,
    SYS_LATENCY,
    pcie_bytes_per_s,
)

__all__ = ["MAX_NVLINKS_PER_GPU", "NVLINK_BYTES_PER_S", "PCIE_BYTES_PER_S", "from_nvidia_smi"]

NVLINK_BYTES_PER_S = 25e9
PCIE_BYTES_PER_S = pcie_bytes_per_s("16 GT/s", "16")  # Gen4 x16
MAX_NVLINKS_PER_GPU = 18
MAX_CHARS = 1 << 20
PATH_TYPES = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")
NVSWITCH = "nvs:h0"

_WHAT = "nvidia-smi topo -m output"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NV = re.compile(r"NV([0-9]{1,3})")
_LEGEND_NIC = re.compile(r"\s*(NIC[0-9]+)\s*:\s*(\S+)\s*$")
_GPU = re.compile(r"GPU([0-9]+)")


def _classes(sets: nx.utils.UnionFind) -> list[list[int]]:
    """The union-find's classes, each in ascending order, ordered by their smallest member."""
    return sorted(sorted(c) for c in sets.to_sets())


def _relation(token: str, row: str, col: str) -> str | int:
    """``"PIX"`` ... ``"SYS"``, ``"X"``, or the NVLink count of ``NV#`` (``SOC`` is the old name of ``SYS``)."""
    token = "SYS" if token == "SOC" else token
    if token in PATH_TYPES:
        return token
    m = _NV.fullmatch(token)
    if m and int(m.group(1)) > 0:
        return int(m.group(1))
    raise TopologyError(f"{_WHAT}: {row}/{col} is {token[:20]!r}; expected X, NV#, {', '.join(PATH_TYPES[1:])}")


def _table(text: str) -> tuple[list[str], list[list[str | int]], dict[str, str], dict[str, str]]:
    """Device names, the relation matrix, each GPU's NUMA affinity and the NIC legend."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if header_at is None:
        raise TopologyError(f"{_WHAT}: no header line starting with GPU0 (is there a GPU?)")
    words = lines[header_at].split()
    names = words[: next((i for i, w in enumerate(words) if w in ("CPU", "NUMA", "GPU") and i > 0), len(words))]
    has_numa = "NUMA Affinity" in " ".join(words)
    if len(set(names)) != len(names):
        raise TopologyError(f"{_WHAT}: the header names a device twice: {names}")
    rows: dict[str, list[str]] = {}
    numa: dict[str, str] = {}
    legend: dict[str, str] = {}
    in_legend = False
    for line in lines[header_at + 1 :]:
        words = line.split()
        if not words:
            continue
        if words[0].rstrip(":") in ("Legend", "NIC"):
            in_legend = True
        if in_legend:
            m = _LEGEND_NIC.fullmatch(line)
            if m:
                legend[m.group(1)] = m.group(2)
            continue
        if words[0] not in names:
            raise TopologyError(f"{_WHAT}: row {words[0][:20]!r} is not a device of the header {names}")
        if words[0] in rows:
            raise TopologyError(f"{_WHAT}: device {words[0]!r} has two rows")
        if len(words) < len(names) + 1:
            raise TopologyError(f"{_WHAT}: row {words[0]!r} has {len(words) - 1} columns; the header has {len(names)}")
        rows[words[0]] = words[1 : len(names) + 1]
        if has_numa and words[0].startswith("GPU") and len(words) >= len(names) + 3:
            numa[words[0]] = words[len(names) + 2]
    missing = [n for n in names if n not in rows]
    if missing:
        raise TopologyError(f"{_WHAT}: no row for {missing}")
    matrix = [[_relation(tok, a, b) for tok, b in zip(rows[a], names)] for a in names]
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if (matrix[i][j] == "X") != (i == j):
                raise TopologyError(f"{_WHAT}: {a}/{b} is {matrix[i][j]!r}; X marks a device with itself only")
            if matrix[i][j] != matrix[j][i]:
                raise TopologyError(f"{_WHAT}: not symmetric: {a}/{b} is {matrix[i][j]!r}, {b}/{a} {matrix[j][i]!r}")
    return names, matrix, numa, legend


def from_nvidia_smi(text: str) -> Topology:
    """Builds a :class:`~jaxccl.topology.Topology` from ``nvidia-smi topo -m`` output (see the module docstring)."""
    if not isinstance(text, str):
        raise TopologyError(f"{_WHAT} must be a string, got {type(text).__name__}")
    if len(text) > MAX_CHARS:
        raise TopologyError(f"{_WHAT} is {len(text)} characters; at most {MAX_CHARS} are read")
    names, matrix, numa, legend = _table(text)
    gpus = [n for n in names if _GPU.fullmatch(n)]
    if [int(_GPU.fullmatch(n).group(1)) for n in gpus] != list(range(len(gpus))):  # type: ignore[union-attr]
        raise TopologyError(f"{_WHAT}: GPU columns must be GPU0..GPU{len(gpus) - 1} in order, got {gpus}")
    n = len(names)
    index = {name: i for i, name in enumerate(names)}
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if isinstance(matrix[i][j], int) and not (a in gpus and b in gpus):
                raise TopologyError(f"{_WHAT}: {a}/{b} is NV{matrix[i][j]}; NVLink joins GPUs only")
    switches, sockets = nx.utils.UnionFind(range(n)), nx.utils.UnionFind(range(n))
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] in ("PIX", "PXB"):
                switches.union(i, j)
            if matrix[i][j] in ("PIX", "PXB", "PHB", "NODE"):
                sockets.union(i, j)
    by_numa: dict[str, int] = {}
    for name, value in numa.items():
        if value.isdigit():
            sockets.union(index[name], by_numa.setdefault(value, index[name]))
    for i in range(n):
        for j in range(i + 1, n):
            if matrix[i][j] == "SYS" and sockets[i] == sockets[j]:
                raise TopologyError(
                    f"{_WHAT}: {names[i]}/{names[j]} is SYS (different sockets), yet other entries or the NUMA "
                    "affinity put them on one socket"
                )

    def node(i: int) -> int | str:
        return i if names[i] in gpus else f"nic:{legend.get(names[i], names[i])}"

    g = nx.DiGraph()

    def duplex(u: Any, v: Any, cap: float, lat: float, kind: str) -> None:
        g.add_edge(u, v, capacity=cap, latency=lat, kind=kind)
        g.add_edge(v, u, capacity=cap, latency=lat, kind=kind)

    for i in range(n):
        g.add_node(node(i), kind="gpu" if names[i] in gpus else "nic", host=0)
    socket_of: dict[int, str] = {}
    for k, members in enumerate(_classes(sockets)):
        g.add_node(f"cpu:{k}", kind="switch", role="cpu", host=0)
        socket_of.update({i: f"cpu:{k}" for i in members})
    cpus = sorted({*socket_of.values()})
    for a in range(len(cpus)):
        for b in range(a + 1, len(cpus)):
            duplex(cpus[a], cpus[b], SYS_BYTES_PER_S, SYS_LATENCY, "sys")
    for k, members in enumerate(c for c in _classes(switches) if len(c) > 1):
        sw = f"pcie:{k}"
        g.add_node(sw, kind="switch", role="pcie", host=0)
        duplex(sw, socket_of[members[0]], PCIE_BYTES_PER_S, PCIE_LATENCY, "pcie")
        for i in members:
            duplex(node(i), sw, PCIE_BYTES_PER_S, PCIE_LATENCY, "pcie")
    for i in range(n):
        if not any(isinstance(u, str) and u.startswith("pcie:") for u in g.successors(node(i))):
            duplex(node(i), socket_of[i], PCIE_BYTES_PER_S, PCIE_LATENCY, "pcie")
    counts = [[c if isinstance(c, int) else 0 for c in matrix[i][: len(gpus)]] for i in range(len(gpus))]
    if any(sum(row) > MAX_NVLINKS_PER_GPU for row in counts):
        g.add_node(NVSWITCH, kind="switch", role="nvswitch", host=0)
        for r, row in enumerate(counts):
            if max(row, default=0) > 0:
                duplex(r, NVSWITCH, max(row) * NVLINK_BYTES_PER_S, NVLINK_LATENCY, "nvlink")
    else:
        for r, row in enumerate(counts):
            for s, c in enumerate(row):
                if c and r < s:
                    duplex(r, s, c * NVLINK_BYTES_PER_S, NVLINK_LATENCY, "nvlink")
    meta = {"source": "nvidia-smi", "hosts": 1}
    return Topology(g, name=f"nvidia-smi x{len(gpus)} GPUs", meta=meta)
