"""NCCL topology XML import: the file ``NCCL_TOPO_DUMP_FILE`` writes and ``NCCL_TOPO_FILE`` reads.

The format (NCCL's ``src/graph/xml.cc``)::

    <system version="1">
      <cpu numaid="0" affinity="..." arch="x86_64" vendor="GenuineIntel" host_hash="0x5e1f...">
        <pci busid="0000:10:00.0" class="0x060400" link_speed="32.0 GT/s PCIe" link_width="16">
          <pci busid="0000:15:00.0" class="0x030200" link_speed="32.0 GT/s PCIe" link_width="16">
            <gpu dev="0" sm="90" rank="0" gdr="1">
              <nvlink target="0000:a1:00.0" count="5" tclass="0x068000"/>
            </gpu>
          </pci>
          <pci busid="0000:19:00.0" class="0x020700" link_speed="32.0 GT/s PCIe" link_width="16">
            <nic><net name="mlx5_0" dev="0" speed="400000" port="1" guid="0x..." maxconn="131072" gdr="1"/></nic>
          </pci>
        </pci>
      </cpu>
    </system>

What becomes of it (node names as in :mod:`jaxccl.topology.presets`: GPU ranks are ints, the rest strings):

- **GPUs** are ranked by their ``rank`` attribute when every GPU has one (a permutation of
  ``0..N-1``), else in document order. A GPU's ``<gpu>`` sits inside the ``<pci>`` of the GPU
  itself, which links it to its parent.
- **NVLink**: an ``<nvlink>`` to another GPU's bus id (``tclass`` ``0x030000``/``0x030200``) is a
  direct link of ``count`` links; one to an NVSwitch (``tclass`` ``0x068000``) links the GPU to the
  switch node ``nvs:h<host>:<target>`` (NCCL writes one ``<nvlink>`` per switch, or one with the
  pseudo bus id ``fffffff:ffff:ff.0`` for all of a host's switches); one to a PCI bridge
  (``0x060400``, IBM POWER) links the GPU to its CPU. Capacity is ``count`` times the nominal
  per-direction bandwidth of one link of the GPU's generation (:data:`NVLINK_BYTES_PER_S`, by ``sm``).
- **PCIe**: every ``<pci>`` above a GPU or NIC becomes a link to its parent (the parent ``<pci>``
  switch ``pci:h<host>:<busid>``, nested to any depth, or the CPU ``cpu:h<host>:n<numaid>``) of
  ``link_speed`` (GT/s per lane) x ``link_width`` (lanes) x the line-code efficiency
  (8b/10b up to 5 GT/s, 128b/130b for 8 to 32 GT/s, 242/256 FLIT mode from 64 GT/s) / 8 bytes/s:
  Gen4 x16 is 31.5 GB/s, Gen5 x16 63.0 GB/s. PCI devices with neither GPU nor NIC below are left out.
- **CPUs** of one host (the sockets) are joined pairwise by :data:`SYS_BYTES_PER_S` (64 GB/s, a
  nominal UPI/xGMI figure; the XML gives none).
- **NICs**: a ``<nic>`` becomes ``nic:h<host>:<name of its first <net>>``; its speed is the sum
  of its ``<net speed=...>`` ports (Mb/s). With several hosts (``host_hash`` on ``<cpu>``, hosts in
  order of first appearance) every NIC links to one network switch ``"net"`` at that speed.

Every attribute order parses; attributes jaxccl does not read are ignored, and so are elements
other than ``cpu``, ``pci``, ``gpu``, ``nic``, ``net`` and ``nvlink``. A file with a DOCTYPE,
nested more than :data:`jaxccl.util.strict.MAX_NESTING` deep, larger than :data:`MAX_BYTES`, or
missing or misspelling what is read raises :class:`~jaxccl.errors.TopologyError` naming the problem.

Example:
    >>> xml = '''<system version="1"><cpu numaid="0">
    ...   <pci busid="0000:01:00.0" link_speed="16.0 GT/s PCIe" link_width="16">
    ...     <gpu dev="0" sm="80"><nvlink target="0000:02:00.0" count="12" tclass="0x030200"/></gpu></pci>
    ...   <pci busid="0000:02:00.0" link_speed="16.0 GT/s PCIe" link_width="16">
    ...     <gpu dev="1" sm="80"><nvlink target="0000:01:00.0" count="12" tclass="0x030200"/></gpu></pci>
    ... </cpu></system>'''
    >>> t = from_nccl_xml(xml)
    >>> t.num_gpus, t.capacity(0, 1) / 1e9, round(t.capacity(0, "cpu:h0:n0") / 1e9, 2)
    (2, 300.0, 31.51)
"""

from __future__ import annotations

import dataclasses
import os
import re
import xml.etree.ElementTree as ET
from typing import Any

import networkx as nx

from jaxccl.errors import TopologyError
from jaxccl.topology.graph import Topology
from jaxccl.util import safe_xml, strict

__all__ = [
    "MAX_BYTES",
    "NVLINK_BYTES_PER_S",
    "SYS_BYTES_PER_S",
    "from_nccl_xml",
    "load_nccl_xml",
    "nvlink_bytes_per_s",
    "pcie_bytes_per_s",
]

MAX_BYTES = 16 << 20  # a dump of a large multi-host system is well under a megabyte
# Nominal bandwidth of one NVLink, per direction, by the first SM version of its generation.
NVLINK_BYTES_PER_S = {
    60: 20e9,  # NVLink 1 (P100)
    70: 25e9,  # NVLink 2 (V100)
    80: 25e9,  # NVLink 3 (A100)
    86: 14.0625e9,  # NVLink 3 bridges of GA10x boards (4 links: 56.25 GB/s)
    90: 25e9,  # NVLink 4 (H100, H200)
    100: 50e9,  # NVLink 5 (B200)
}
SYS_BYTES_PER_S = 64e9  # between two CPU sockets of a host (nominal UPI / xGMI)
NVLINK_LATENCY = 25e-9  # as the presets' NVSwitch links
PCIE_LATENCY = 0.1e-6
SYS_LATENCY = 0.2e-6
NET_LATENCY = 0.5e-6  # as the presets' switch hops
NETWORK = "net"

_GPU_CLASSES = ("0x030000", "0x030200")
_NVSWITCH_CLASS = "0x068000"
_BRIDGE_CLASS = "0x060400"
_SPEED = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s", re.I)
_WHAT = "NCCL topology XML"


def nvlink_bytes_per_s(sm: int) -> float:
    """Nominal per-direction bandwidth of one NVLink of a GPU with compute capability ``sm``.

    >>> nvlink_bytes_per_s(90), nvlink_bytes_per_s(89)
    (25000000000.0, 14062500000.0)
    """
    known = [k for k in NVLINK_BYTES_PER_S if k <= sm]
    if not known:
        raise TopologyError(f"{_WHAT}: a GPU with sm={sm} has no NVLink (NVLink starts at sm 60)")
    return NVLINK_BYTES_PER_S[max(known)]


def pcie_bytes_per_s(link_speed: str, link_width: str, where: str = "pci") -> float:
    """Bytes/s of a PCIe link from NCCL's ``link_speed`` ("16.0 GT/s PCIe") and ``link_width`` ("16").

    >>> round(pcie_bytes_per_s("16.0 GT/s PCIe", "16") / 1e9, 3), pcie_bytes_per_s("5 GT/s", "8") / 1e9
    (31.508, 4.0)
    """
    m = _SPEED.match(link_speed)
    if m is None:
        raise TopologyError(f"{_WHAT}: {where}: link_speed must read like '16.0 GT/s', got {link_speed[:40]!r}")
    gts = float(m.group(1))
    lanes = strict.integer_text(link_width, f"{_WHAT}: {where}: link_width", TopologyError, minimum=1)
    if not gts > 0:
        raise TopologyError(f"{_WHAT}: {where}: link_speed must be positive, got {link_speed!r}")
    efficiency = 8 / 10 if gts <= 5 else (128 / 130 if gts < 64 else 242 / 256)
    return gts * 1e9 * efficiency * lanes / 8


@dataclasses.dataclass
class _Gpu:
    busid: str
    host: int
    cpu: str
    dev: int
    sm: int
    rank: int | None
    element: ET.Element
    parent: str
    pcie: float


@dataclasses.dataclass
class _Build:
    nodes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    links: list[tuple[str, str, float, float, str]] = dataclasses.field(default_factory=list)  # duplex
    gpus: list[_Gpu] = dataclasses.field(default_factory=list)
    nics: list[tuple[str, float]] = dataclasses.field(default_factory=list)


def _parse(text: str | bytes) -> ET.Element:
    root = safe_xml.parse(text, what=_WHAT, error=TopologyError, max_chars=MAX_BYTES)
    if root.tag != "system":
        raise TopologyError(f"{_WHAT}: the root element must be <system>, got <{root.tag}>")
    return root


def _attr(el: ET.Element, name: str, where: str) -> str:
    value = el.get(name)
    if value is None or not value.strip():
        raise TopologyError(f"{_WHAT}: {where} has no {name}= attribute")
    return value.strip()


def _int(el: ET.Element, name: str, where: str, *, minimum: int | None = None) -> int:
    return strict.integer_text(_attr(el, name, where), f"{_WHAT}: {where}: {name}", TopologyError, minimum=minimum)


def _walk(el: ET.Element, parent: str, host: int, cpu: str, b: _Build) -> bool:
    """Adds the GPUs, NICs and PCI switches below ``el`` (linked to ``parent``); whether any was found."""
    found = False
    for child in el:
        if child.tag == "pci":
            found |= _pci(child, parent, host, cpu, b)
        elif child.tag == "nic":
            _nic(child, parent, host, None, b, where=f"<nic> under {parent}")
            found = True
        elif child.tag == "gpu":
            raise TopologyError(f"{_WHAT}: <gpu> under {parent} must sit inside the <pci> element of the GPU")
    return found


def _pci(el: ET.Element, parent: str, host: int, cpu: str, b: _Build) -> bool:
    busid = _attr(el, "busid", "<pci>").lower()
    where = f"<pci busid={busid!r}>"
    gpus = [c for c in el if c.tag == "gpu"]
    nics = [c for c in el if c.tag == "nic"]
    if len(gpus) + len(nics) > 1:
        raise TopologyError(f"{_WHAT}: {where} holds {len(gpus)} <gpu> and {len(nics)} <nic>; a device holds one")

    def capacity() -> float:
        return pcie_bytes_per_s(_attr(el, "link_speed", where), _attr(el, "link_width", where), where)

    if gpus:
        g = gpus[0]
        gw = f"<gpu> of {where}"
        rank = _int(g, "rank", gw, minimum=0) if g.get("rank") is not None else None
        b.gpus.append(
            _Gpu(
                busid,
                host,
                cpu,
                _int(g, "dev", gw, minimum=0),
                _int(g, "sm", gw, minimum=0),
                rank,
                g,
                parent,
                capacity(),
            )
        )
        return True
    if nics:
        _nic(nics[0], parent, host, capacity(), b, where=f"<nic> of {where}")
        return True
    name = f"pci:h{host}:{busid}"
    if name in b.nodes:
        raise TopologyError(f"{_WHAT}: bus id {busid!r} appears twice on host {host}")
    if not _walk(el, name, host, cpu, b):
        return False
    b.nodes[name] = {"kind": "switch", "role": "pcie", "host": host, "busid": busid}
    b.links.append((name, parent, capacity(), PCIE_LATENCY, "pcie"))
    return True


def _nic(el: ET.Element, parent: str, host: int, pcie: float | None, b: _Build, *, where: str) -> None:
    nets = [c for c in el if c.tag == "net"]
    if not nets:
        raise TopologyError(f"{_WHAT}: {where} has no <net> (its ports and their speed)")
    speed = 0.0
    for net in nets:
        nw = f"<net> of {where}"
        speed += _int(net, "speed", nw, minimum=1) * 1e6 / 8
    name = f"nic:h{host}:{_attr(nets[0], 'name', f'<net> of {where}')}"
    if name in b.nodes:
        raise TopologyError(f"{_WHAT}: NIC {name!r} appears twice")
    b.nodes[name] = {"kind": "nic", "host": host}
    b.links.append((name, parent, speed if pcie is None else pcie, PCIE_LATENCY, "pcie"))
    b.nics.append((name, speed))


def from_nccl_xml(text: str | bytes) -> Topology:
    """Builds a :class:`~jaxccl.topology.Topology` from NCCL topology XML (see the module docstring).

    Raises:
        TopologyError: malformed XML, a missing or non-numeric attribute, an NVLink to an unknown
            device, GPU ranks that are not ``0..N-1``, no GPU, or a disconnected result.
    """
    root = _parse(text)
    b = _Build()
    hosts: dict[str, int] = {}
    cpus_of: dict[int, list[str]] = {}
    for cpu_el in root.iter("cpu"):
        key = cpu_el.get("host_hash", "").strip().lower()
        host = hosts.setdefault(key, len(hosts))
        numa = _int(cpu_el, "numaid", "<cpu>")
        cpu = f"cpu:h{host}:n{numa}"
        if cpu in b.nodes:
            raise TopologyError(f"{_WHAT}: two <cpu numaid={numa}> on host {host}")
        b.nodes[cpu] = {"kind": "switch", "role": "cpu", "host": host}
        cpus_of.setdefault(host, []).append(cpu)
        _walk(cpu_el, cpu, host, cpu, b)
    if not b.gpus:
        raise TopologyError(f"{_WHAT} lists no GPU (<gpu> inside a <pci> inside a <cpu>)")
    ranks = [g.rank for g in b.gpus]
    if all(r is not None for r in ranks):
        if sorted(ranks) != list(range(len(ranks))):  # type: ignore[type-var]
            raise TopologyError(f"{_WHAT}: GPU ranks must be 0..{len(ranks) - 1}, got {ranks}")
        order = {g.busid + f"@{g.host}": g.rank for g in b.gpus}
    elif any(r is not None for r in ranks):
        raise TopologyError(f"{_WHAT}: some GPUs have a rank= attribute and some do not")
    else:
        order = {g.busid + f"@{g.host}": i for i, g in enumerate(b.gpus)}
    if len(order) != len(b.gpus):
        raise TopologyError(f"{_WHAT}: a GPU bus id appears twice on one host")
    by_bus = {(g.host, g.busid): order[g.busid + f"@{g.host}"] for g in b.gpus}

    g = nx.DiGraph()
    for g_ in b.gpus:
        g.add_node(by_bus[(g_.host, g_.busid)], kind="gpu", host=g_.host, busid=g_.busid, dev=g_.dev, sm=g_.sm)
    for name, attrs in b.nodes.items():
        g.add_node(name, **attrs)

    def duplex(u: Any, v: Any, cap: float, lat: float, kind: str) -> None:
        for a, c in ((u, v), (v, u)):
            if g.has_edge(a, c):  # two <nvlink> entries to one target: the links add up
                g.edges[a, c]["capacity"] += cap
            else:
                g.add_edge(a, c, capacity=cap, latency=lat, kind=kind)

    for u, v, cap, lat, kind in b.links:
        duplex(u, v, cap, lat, kind)
    for gpu in b.gpus:
        duplex(by_bus[(gpu.host, gpu.busid)], gpu.parent, gpu.pcie, PCIE_LATENCY, "pcie")
    for cpus in cpus_of.values():
        for i, a in enumerate(cpus):
            for c in cpus[i + 1 :]:
                duplex(a, c, SYS_BYTES_PER_S, SYS_LATENCY, "sys")
    _nvlinks(g, b, by_bus)
    if len(hosts) > 1:
        g.add_node(NETWORK, kind="switch", role="network")
        for name, speed in b.nics:
            duplex(name, NETWORK, speed, NET_LATENCY, "nic")
    meta = {"source": "nccl_xml", "hosts": len(hosts), "version": root.get("version", "")}
    return Topology(g, name=f"nccl-xml {len(hosts)} host(s) x{len(b.gpus)} GPUs", meta=meta)


def _nvlinks(g: nx.DiGraph, b: _Build, by_bus: dict[tuple[int, str], int]) -> None:
    caps: dict[tuple[Any, Any], float] = {}  # every <nvlink> entry adds its links to its edge(s)
    for gpu in b.gpus:
        me = by_bus[(gpu.host, gpu.busid)]
        for link in gpu.element:
            if link.tag != "nvlink":
                continue
            where = f"<nvlink> of GPU {gpu.busid!r}"
            target = _attr(link, "target", where).lower()
            cap = _int(link, "count", where, minimum=1) * nvlink_bytes_per_s(gpu.sm)
            tclass = link.get("tclass", "").strip().lower()
            if tclass in _GPU_CLASSES or (not tclass and (gpu.host, target) in by_bus):
                peer = by_bus.get((gpu.host, target))
                if peer is None:
                    raise TopologyError(f"{_WHAT}: {where} names GPU {target!r}, which is not on its host")
                if peer == me:
                    raise TopologyError(f"{_WHAT}: {where} links the GPU to itself")
                ends: list[tuple[Any, Any]] = [(me, peer)]
            elif tclass in (_NVSWITCH_CLASS, _BRIDGE_CLASS):
                other = f"nvs:h{gpu.host}:{target}" if tclass == _NVSWITCH_CLASS else gpu.cpu
                if other not in g:
                    g.add_node(other, kind="switch", role="nvswitch", host=gpu.host)
                ends = [(me, other), (other, me)]
            else:
                raise TopologyError(
                    f"{_WHAT}: {where} has tclass={tclass!r}; expected a GPU ({', '.join(_GPU_CLASSES)}), "
                    f"an NVSwitch ({_NVSWITCH_CLASS}) or a bridge ({_BRIDGE_CLASS})"
                )
            for e in ends:
                caps[e] = caps.get(e, 0.0) + cap
    for (u, v), cap in caps.items():  # a direct NVLink listed by one GPU only is still duplex
        if isinstance(v, int) and (v, u) not in caps:
            g.add_edge(v, u, capacity=cap, latency=NVLINK_LATENCY, kind="nvlink")
        if g.has_edge(u, v):  # the POWER bridge: NVLink and PCIe to the CPU add up
            g.edges[u, v]["capacity"] += cap
        else:
            g.add_edge(u, v, capacity=cap, latency=NVLINK_LATENCY, kind="nvlink")


def load_nccl_xml(path: str | os.PathLike[str]) -> Topology:
    """Reads an NCCL topology XML file (at most :data:`MAX_BYTES`) with :func:`from_nccl_xml`."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise TopologyError(f"cannot read {_WHAT} {os.fspath(path)!r}: {e.strerror or e}") from None
    try:
        return from_nccl_xml(data)
    except TopologyError as e:
        raise TopologyError(f"{os.fspath(path)}: {e}") from None
