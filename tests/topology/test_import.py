"""Topologies from the machine: NCCL topology XML, ``nvidia-smi topo -m``, discovery, ``topology="auto"``.

Every shape's AllGather bound is worked out by hand in its test and compared with the max-flow
bound of :mod:`jaxccl.synth.allgather.bound`. Nominal figures used by hand (bytes/s, per direction):
PCIe Gen4 x16 ``G4 = 16e9 * 128/130 * 16 / 8`` (31.5 GB/s), Gen5 x16 ``G5 = 2 * G4``; one NVLink of
sm 80/90 and one ``NV#`` of nvidia-smi ``25e9``; 400 Gb/s NIC ``50e9``; CPU sockets ``64e9``.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
import stat

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxccl
from jaxccl.errors import OptionError, TopologyError
from jaxccl.synth.allgather.bound import optimal_rate
from jaxccl.synth.allgather.network import build_net
from jaxccl.topology import Discovery, discover, from_nccl_xml, from_nvidia_smi, load_nccl_xml

DATA = pathlib.Path(__file__).resolve().parents[1] / "data" / "topologies"
G4 = 16e9 * 128 / 130 * 16 / 8
G5 = 2 * G4
NVL = 25e9


def algbw(topo) -> float:
    net = build_net(topo)
    return optimal_rate(net).algbw(net)


def xml(name: str) -> str:
    return (DATA / name).read_text()


# ---------------------------------------------------------------------------------------------- NCCL XML
def test_dgx_h100_xml():
    t = load_nccl_xml(DATA / "dgx_h100.xml")
    assert t.num_gpus == 8 and t.hosts == (tuple(range(8)),)
    nvs = sorted(s for s in t.switches if s.startswith("nvs:"))
    assert len(nvs) == 4
    # 5 + 4 + 4 + 5 NVLinks of 25 GB/s to the four NVSwitches: 450 GB/s per GPU.
    assert sum(t.capacity(0, s) for s in nvs) == 18 * NVL
    assert [t.capacity(0, s) for s in nvs] == [5 * NVL, 4 * NVL, 4 * NVL, 5 * NVL]
    nics = [s for s in t.switches if s.startswith("nic:")]
    assert len(nics) == 8 and t.capacity("nic:h0:mlx5_0", "pci:h0:0000:10:00.0") == pytest.approx(G5)
    assert t.capacity("cpu:h0:n0", "cpu:h0:n1") == 64e9
    # One host, no network. A GPU receives the other 7 shards over 450 GB/s of NVLink plus its Gen5 x16
    # PCIe link; every other cut is wider (e.g. a PCIe switch's two GPUs: 2 * 450 + G5 for 6 senders).
    # x* = (450e9 + G5) / 7 per root, algbw = 8 x*.
    assert algbw(t) == pytest.approx(8 * (18 * NVL + G5) / 7, rel=1e-6)


def test_pcie_server_with_nvlink_bridge_pairs_xml():
    t = load_nccl_xml(DATA / "pcie_nvlink_pairs.xml")
    assert t.num_gpus == 4 and t.capacity(0, 1) == 12 * NVL and t.capacity(2, 3) == 12 * NVL
    assert not t.has_edge(0, 2)
    # The pairs meet through the CPUs. X = {GPU0, GPU1, both CPUs} sends only over CPU1's two Gen4 x16
    # links into GPU2 and GPU3: 2 * G4 for 2 GPUs; the socket link (64e9 for 2 GPUs) and each GPU's
    # in-cut (300e9 + G4 for 3) are wider. x* = G4, algbw = 4 * G4 = 126 GB/s.
    assert algbw(t) == pytest.approx(4 * G4, rel=1e-6)


def test_two_hosts_xml():
    t = load_nccl_xml(DATA / "two_hosts.xml")
    assert t.hosts == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert t.capacity("nic:h1:mlx5_2", "net") == 50e9
    assert t.capacity(5, "nvs:h1:fffffff:ffff:ff.0") == 18 * NVL
    # A host sends to the other only through its 4 NICs of 400 Gb/s: 200e9 for its 4 GPUs, less than
    # a GPU's in-cut ((450e9 + G5) / 7). x* = 50e9, algbw = 8 * 50e9 = 400 GB/s.
    assert algbw(t) == pytest.approx(8 * 50e9, rel=1e-6)


def test_xml_attribute_order_extra_attributes_and_host_hash_do_not_matter():
    text = xml("pcie_nvlink_pairs.xml")

    def shuffle(m: re.Match) -> str:
        attrs = re.findall(r'\S+="[^"]*"', m.group(2))
        return f"<{m.group(1)} " + " ".join(reversed(attrs)) + ' jaxccl-extra="1" keep="1"' + m.group(3)

    changed = re.sub(r"<(\w+) ([^>]*?)(/?>)", shuffle, text)
    changed = changed.replace("<cpu ", '<cpu host_hash="0xabc" ', 2)
    assert changed != text and 'link_width="16" link_speed' in changed
    assert from_nccl_xml(changed) == from_nccl_xml(text)


def test_xml_nested_pci_switches_and_ranks():
    # Two GPUs under two levels of PCIe switches (Gen4 x8 at the top), ranks given in reverse.
    def gpu(bus: str, dev: int, rank: int) -> str:
        return (
            f'<pci busid="{bus}" class="0x030200" link_width="16" link_speed="16.0 GT/s PCIe">'
            f'<gpu dev="{dev}" sm="90" rank="{rank}"/></pci>'
        )

    text = (
        '<system version="1"><cpu numaid="0" arch="x86_64">'
        '<pci busid="0000:01:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="8">'
        '<pci busid="0000:02:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">'
        '<pci busid="0000:03:00.0" class="0x060400" link_speed="16.0 GT/s PCIe" link_width="16">'
        + gpu("0000:04:00.0", 0, 1)
        + "</pci></pci></pci>"
        '<pci busid="0000:05:00.0" class="0x010802" link_speed="16.0 GT/s PCIe" link_width="4"/>'
        + gpu("0000:06:00.0", 1, 0)
        + "</cpu></system>"
    )
    t = from_nccl_xml(text)
    assert t.graph.nodes[1]["busid"] == "0000:04:00.0" and t.graph.nodes[0]["busid"] == "0000:06:00.0"
    assert [n for n in t.path(1, 0)] == [
        (1, "pci:h0:0000:03:00.0"),
        ("pci:h0:0000:03:00.0", "pci:h0:0000:02:00.0"),
        ("pci:h0:0000:02:00.0", "pci:h0:0000:01:00.0"),
        ("pci:h0:0000:01:00.0", "cpu:h0:n0"),
        ("cpu:h0:n0", 0),
    ]
    assert "pci:h0:0000:05:00.0" not in t.graph  # an NVMe drive: no GPU or NIC below
    # Everything between the GPUs crosses the Gen4 x8 link (G4 / 2) once: x* = G4 / 2, algbw = 2 x*.
    assert algbw(t) == pytest.approx(G4, rel=1e-6)


def _bad(text: str, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        from_nccl_xml(text)


def test_malformed_xml_is_a_named_error(tmp_path):
    pairs = xml("pcie_nvlink_pairs.xml")
    _bad(pairs[:-20], "malformed NCCL topology XML: .* at line")
    _bad("<topology/>", "root element must be <system>")
    _bad('<system version="1"><cpu numaid="0"/></system>', "lists no GPU")
    _bad(pairs.replace('numaid="1"', 'numaid="one"'), "numaid must be an integer")
    _bad(pairs.replace('count="12"', 'count="0"', 1), "count must be >= 1")
    _bad(pairs.replace('sm="80"', "", 1), "has no sm= attribute")
    _bad(pairs.replace('link_width="16"', 'link_width="x16"', 1), "link_width must be an integer")
    _bad(pairs.replace('link_speed="16.0 GT/s PCIe"', 'link_speed="Unknown"', 1), "link_speed must read like")
    _bad(pairs.replace('target="0000:81:00.0"', 'target="0000:99:00.0"', 1), "names GPU '0000:99:00.0'")
    _bad(pairs.replace('tclass="0x030200"', 'tclass="0x020000"', 1), "tclass='0x020000'")
    _bad(pairs.replace('sm="80"', 'sm="52"', 1), "sm=52 has no NVLink")
    two = xml("two_hosts.xml")
    _bad(two.replace('rank="5"', 'rank="4"'), "GPU ranks must be 0..7")
    _bad(two.replace(' rank="5"', ""), "some GPUs have a rank")
    _bad(two.replace("<net ", "<port ", 1), "has no <net>")
    _bad('<!DOCTYPE x [<!ENTITY a "b">]><system/>', "DOCTYPE")
    _bad("<system>" + "<pci>" * 200 + "</pci>" * 200 + "</system>", "nested too deeply")
    with pytest.raises(TopologyError, match="cannot read NCCL topology XML"):
        load_nccl_xml(tmp_path / "missing.xml")


# ------------------------------------------------------------------------------------------- nvidia-smi
def test_dgx_h100_nvidia_smi():
    t = from_nvidia_smi((DATA / "dgx_h100.txt").read_text())  # the header keeps the terminal's escape codes
    assert t.num_gpus == 8 and t.capacity(3, "nvs:h0") == 18 * NVL
    assert t.path(0, 4)[0] == (0, "nvs:h0")
    assert sorted(t.graph.successors("pcie:0"), key=str) == [0, 1, "cpu:0", "nic:mlx5_0", "nic:mlx5_1"]
    # NV18 to each of 7 peers adds up to 126 > 18 links: the GPUs sit on NVSwitches with 18 links each.
    # A GPU receives over 450 GB/s of NVLink plus its PCIe switch's G4: x* = (450e9 + G4) / 7, algbw = 8 x*.
    assert algbw(t) == pytest.approx(8 * (18 * NVL + G4) / 7, rel=1e-6)


def test_pcie_server_with_nvlink_bridge_pairs_nvidia_smi():
    t = from_nvidia_smi((DATA / "pcie_nvlink_pairs.txt").read_text())
    assert t.capacity(0, 1) == 12 * NVL and "nvs:h0" not in t.graph  # 12 links each: direct bridges
    # As the XML server: the pairs meet through CPU1's two G4 links into GPU2, GPU3. algbw = 4 * G4.
    assert algbw(t) == pytest.approx(4 * G4, rel=1e-6)


def test_pcie_box_without_nvlink_nvidia_smi():
    t = from_nvidia_smi((DATA / "pcie_4gpu.txt").read_text())
    assert sorted(t.graph.successors("pcie:0"), key=str) == [0, 1, "cpu:0", "nic:mlx5_0"]
    assert t.capacity("cpu:0", "cpu:1") == 64e9
    # Each GPU receives 3 shards over its one G4 link: x* = G4 / 3, algbw = 4 * G4 / 3 = 42 GB/s.
    assert algbw(t) == pytest.approx(4 * G4 / 3, rel=1e-6)


def test_malformed_nvidia_smi_is_a_named_error():
    text = (DATA / "pcie_4gpu.txt").read_text()
    cases = [
        ("No devices were found\n", "no header line"),
        (text.replace("GPU1\tPIX", "GPU1\tPIZ", 1), "GPU1/GPU0 is 'PIZ'"),
        (text.replace("GPU0\t X \tPIX", "GPU0\t X \tPXB", 1), "not symmetric"),
        (text.replace("GPU1\tPIX\t X ", "GPU1\tPIX\tPIX", 1), "X marks a device with itself only"),
        (re.sub(r"^GPU2\t.*\n", "", text, flags=re.M), r"no row for \['GPU2'\]"),
        (re.sub(r"^GPU3\t.*$", "GPU3\tSYS\tSYS\tPIX\t X ", text, flags=re.M), "has 4 columns"),
        (text.replace("\t16-31\t1\t", "\t16-31\t0\t"), "is SYS .* one socket"),
        (text.replace("PXB", "NV2"), "NVLink joins GPUs only"),
    ]
    for bad, match in cases:
        assert bad != text or match == "no header line"
        with pytest.raises(TopologyError, match=match):
            from_nvidia_smi(bad)


# ----------------------------------------------------------------------------- discovery, topology="auto"
def test_discover_prefers_nccl_topo_file(monkeypatch):
    monkeypatch.setenv("NCCL_TOPO_FILE", str(DATA / "two_hosts.xml"))
    found = discover(8)
    assert found.source == "NCCL_TOPO_FILE" and found.topology == load_nccl_xml(DATA / "two_hosts.xml")
    with pytest.raises(TopologyError, match="NCCL_TOPO_FILE.* has 8 GPUs, expected 4"):
        discover(4)
    monkeypatch.setenv("NCCL_TOPO_FILE", str(DATA / "pcie_4gpu.txt"))  # not XML: an error, not "none"
    with pytest.raises(TopologyError, match="malformed NCCL topology XML"):
        discover()


def _path_with(tmp_path: pathlib.Path, script: str | None, rest: str = "") -> str:
    """``PATH`` with ``tmp_path`` first, holding an ``nvidia-smi`` that runs ``script`` (without one: nothing else)."""
    if script is None:
        return str(tmp_path)
    exe = tmp_path / "nvidia-smi"
    exe.write_text(script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(tmp_path) + os.pathsep + rest


def test_discover_runs_nvidia_smi_else_none(monkeypatch, tmp_path):
    monkeypatch.delenv("NCCL_TOPO_FILE", raising=False)
    rest = os.environ.get("PATH", "")  # for sh and cat
    monkeypatch.setenv("PATH", _path_with(tmp_path, None))
    assert discover() == Discovery(None, "none", "NCCL_TOPO_FILE is not set and nvidia-smi is not on PATH")
    # An nvidia-smi that prints a saved matrix: the real command line, the real parser.
    saved = DATA / "pcie_4gpu.txt"
    script = f'#!/bin/sh\n[ "$1 $2" = "topo -m" ] && exec cat "{saved}"\n'
    monkeypatch.setenv("PATH", _path_with(tmp_path, script, rest))
    found = discover()
    assert found.source == "nvidia-smi" and found.topology == from_nvidia_smi(saved.read_text())
    monkeypatch.setenv("PATH", _path_with(tmp_path, "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n", rest))
    found = discover()
    assert found.topology is None and found.source == "none" and "exited with 9: NVIDIA-SMI has failed" in found.detail
    monkeypatch.setenv("PATH", _path_with(tmp_path, "#!/bin/sh\necho 'No devices were found'\n", rest))
    assert discover().detail == "nvidia-smi topo -m lists no GPU"


def test_communicator_topology_auto(monkeypatch, caplog):
    devices = jax.devices()
    assert len(devices) >= 8
    monkeypatch.setenv("NCCL_TOPO_FILE", str(DATA / "dgx_h100.xml"))
    mesh = Mesh(np.array(devices[:8]), ("d",))
    with caplog.at_level(logging.INFO, logger="jaxccl.runtime"):
        comm = jaxccl.Communicator(mesh, "d", topology="auto", backend="ppermute")
    assert comm.topology == load_nccl_xml(DATA / "dgx_h100.xml") and comm.topology_source == "NCCL_TOPO_FILE"
    assert any("NCCL_TOPO_FILE" in r.getMessage() and r.name == "jaxccl.runtime" for r in caplog.records)
    assert comm.schedule("all_reduce") is None  # with a topology, psum is ReduceScatter + AllGather
    comm.close()
    with pytest.raises(TopologyError, match=r"describes 8 GPUs but mesh axis 'd' has 4 devices"):
        jaxccl.Communicator(Mesh(np.array(devices[:4]), ("d",)), "d", topology="auto", backend="ppermute")
    with pytest.raises(OptionError, match="topology"):
        jaxccl.Communicator(mesh, "d", topology="automatic", backend="ppermute")
    monkeypatch.delenv("NCCL_TOPO_FILE")
    monkeypatch.setenv("PATH", "")
    comm = jaxccl.Communicator(mesh, "d", topology="auto", backend="ppermute")
    assert comm.topology is None and comm.topology_source == "none"
    comm.close()
    given = jaxccl.Communicator(mesh, "d", topology=jaxccl.topology.single_node(8), backend="ppermute")
    assert given.topology_source == "given"
    given.close()
