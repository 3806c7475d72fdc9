"""MSCCL XML: lossless round trip, MSCCL conventions, clear errors on corrupt input."""

from __future__ import annotations

import pathlib
import re
import xml.etree.ElementTree as ET

import pytest

from jaxccl.errors import ScheduleError
from jaxccl.schedule import Buffer, Collective, Op, OpKind, Schedule, Threadblock, from_msccl_xml, make_schedule
from jaxccl.schedule.msccl_xml import to_msccl_xml
from jaxccl.synth import (
    binary_tree_allreduce,
    direct_alltoall,
    direct_reduce_scatter,
    double_binary_tree_allreduce,
    ordered_allreduce,
    recursive_doubling_allgather,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)

DATA = pathlib.Path(__file__).parents[1] / "data"
I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH

BASELINES = [
    lambda n: ring_allgather(n, channels=2),
    lambda n: ring_allgather(n, channels=3, bidirectional=True),
    lambda n: recursive_doubling_allgather(1 << (n.bit_length() - 1)),
    direct_alltoall,
    ring_reduce_scatter,
    direct_reduce_scatter,
    lambda n: ring_allreduce(n, channels=2),
    ordered_allreduce,
    binary_tree_allreduce,
    double_binary_tree_allreduce,
]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("make", BASELINES)
def test_round_trip_every_baseline(make, n):
    s = make(n)
    text = to_msccl_xml(s)
    back = from_msccl_xml(text)
    assert back == s  # digest (the program) + name + algbw + bound + info
    assert back.digest == s.digest
    back.validate()


def test_round_trip_extras_and_multiple_deps():
    # An op with three deps, a real nop with two deps, absent buffers with offsets, scratch, floats, info.
    local = Threadblock(
        (
            Op(OpKind.COPY, I, 0, S, 0),
            Op(OpKind.COPY, I, 0, O, 0),
            Op(OpKind.NOP, None, 0, None, 0, 1, ((1, 0), (2, 0))),
        ),
        -1,
        -1,
        0,
    )
    a = Threadblock((Op(OpKind.NOP),), -1, -1, 1)
    b = Threadblock((Op(OpKind.NOP, None, 3, None, 7, 1, ()),), -1, -1, 2)
    c = Threadblock((Op(OpKind.COPY, S, 0, S, 0, 1, ((0, 0), (2, 0), (1, 0))),), -1, -1, 0)
    s = make_schedule(
        "all_gather",
        1,
        1,
        [[local, a, b, c]],
        scratch_chunks=2,
        name='odd "name" <&>',
        algbw=1.25e11,
        bound=3.0000000000000004e11,
        info={"note": "x -- y --> z", "nested": {"k": [1, 2.5, None, True]}},
    )
    text = to_msccl_xml(s, min_bytes=4096, max_bytes=1 << 30, proto="LL128")
    assert 'minBytes="4096"' in text and f'maxBytes="{1 << 30}"' in text and 'proto="LL128"' in text
    assert text.count('jaxccl:dep="1"') == 3  # 2 extra deps of c + 1 of the real nop
    back = from_msccl_xml(text)
    assert back == s
    assert back.ranks[0][3].ops[0].deps == ((0, 0), (2, 0), (1, 0))  # order kept
    back.validate()


def test_export_is_plain_msccl():
    s = ring_reduce_scatter(4, channels=2)
    text = to_msccl_xml(s)
    root = ET.fromstring(text)
    assert root.tag == "algo"
    for attr, want in (
        ("coll", "reducescatter"),
        ("ngpus", "4"),
        ("nchunksperloop", "8"),
        ("nchannels", "2"),
        ("inplace", "0"),
        ("outofplace", "1"),
        ("minBytes", "0"),
        ("maxBytes", str(2**63 - 1)),
        ("proto", "Simple"),
    ):
        assert root.get(attr) == want, attr
    gpus = root.findall("gpu")
    assert [g.get("id") for g in gpus] == ["0", "1", "2", "3"]
    assert {(g.get("i_chunks"), g.get("o_chunks"), g.get("s_chunks")) for g in gpus} == {("8", "2", "0")}
    required = {"s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep"}
    for step in root.iter("step"):
        assert required <= set(step.attrib)
    # Sends in a reduce-scatter have no local dst: MSCCL's "absent" convention.
    first = gpus[0].find("tb").find("step")
    assert (first.get("type"), first.get("dstbuf"), first.get("dstoff")) == ("s", "o", "-1")


def test_hasdep_marks_dependency_targets():
    text = to_msccl_xml(direct_reduce_scatter(3))
    root = ET.fromstring(text)
    for gpu in root.findall("gpu"):
        tbs = gpu.findall("tb")
        targets = set()
        for tb in tbs:
            for st in tb.findall("step"):
                if st.get("depid") != "-1":
                    targets.add((st.get("depid"), st.get("deps")))
        for tb in tbs:
            for st in tb.findall("step"):
                assert (st.get("hasdep") == "1") == ((tb.get("id"), st.get("s")) in targets)


def test_hand_written_ring_fixture_imports_and_validates():
    text = (DATA / "ring_allgather_8.xml").read_text()
    assert "jaxccl" not in text.split("-->", 1)[1]  # plain MSCCL: no jaxccl extras
    s = from_msccl_xml(text)
    assert s.collective is Collective.ALL_GATHER
    assert (s.num_ranks, s.chunks_per_period, s.scratch_chunks) == (8, 1, 0)
    assert s.name == "allgather_ring_8"
    assert s.validate(num_slots=2) is s
    # rcs needs its message and a free slot at once (as MSCCL's primitives): one slot deadlocks a ring.
    with pytest.raises(ScheduleError, match="deadlock with num_slots=1"):
        s.validate(num_slots=1)
    assert [len(tbs) for tbs in s.ranks] == [2] * 8
    assert from_msccl_xml(to_msccl_xml(s)) == s


def test_unmarked_nops_stay_and_marked_nops_fold():
    base = to_msccl_xml(ring_allgather(2))
    # A plain MSCCL nop (no jaxccl marker) before a step stays a nop op.
    plain = base.replace(
        '<step s="1" type="cpy"',
        '<step s="1" type="nop" srcbuf="i" srcoff="-1" dstbuf="o" dstoff="-1" cnt="0" depid="-1" deps="-1" '
        'hasdep="0"/>\n<step s="2" type="cpy"',
        1,
    )
    plain = _renumber(plain)
    s = from_msccl_xml(plain)
    assert [o.kind for o in s.ranks[0][0].ops][:3] == [OpKind.SEND, OpKind.NOP, OpKind.COPY]
    s.validate()


def _renumber(text: str) -> str:
    """Renumbers the s= attributes of every <tb> 0, 1, 2, ... (for hand-edited XML)."""
    out = []
    for block in re.split(r"(<tb [^>]*>)", text):
        counter = iter(range(10**6))
        out.append(re.sub(r'<step s="\d+"', lambda m, c=counter: f'<step s="{next(c)}"', block))
    return "".join(out)


def test_import_without_jaxccl_extras_uses_msccl_conventions():
    s = ring_allreduce(3, channels=2)
    text = to_msccl_xml(s)
    plain = re.sub(r' (xmlns:jaxccl|jaxccl:\w+)="[^"]*"', "", text)
    plain = re.sub(r"\s*<!-- jaxccl:info .*? -->", "", plain)
    assert "jaxccl" not in plain
    back = from_msccl_xml(plain)
    assert back.chunks_per_period == 6  # nchunksperloop for allreduce
    assert back.digest == s.digest
    assert back.info == {}
    back.validate()
    # reduce_scatter spelled the jaxccl way is accepted too.
    rs = to_msccl_xml(ring_reduce_scatter(3)).replace('coll="reducescatter"', 'coll="reduce_scatter"')
    assert from_msccl_xml(rs).collective is Collective.REDUCE_SCATTER


GOOD = to_msccl_xml(ordered_allreduce(2))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t[:-20], r"malformed MSCCL XML: .* at line \d+, column \d+"),
        (lambda t: t.replace("</tb>", "</tbx>", 1), r"malformed MSCCL XML: mismatched tag at line 7, column 7"),
        (lambda t: "", "malformed MSCCL XML"),
        (lambda t: t.replace('type="rrc"', 'type="xyz"', 1), "unknown step type 'xyz'"),
        (lambda t: t.replace(' cnt="1"', "", 1), 'step 0 of <tb id="0"> of <gpu id="0"> is missing attribute \'cnt\''),
        (lambda t: t.replace('srcoff="1"', 'srcoff="one"', 1), r"attribute srcoff of .* must be an integer .*'one'"),
        (lambda t: t.replace('cnt="1"', 'cnt="1_0"', 1), r"attribute cnt of .* must be an integer .*'1_0'"),
        (lambda t: t.replace('cnt="1"', 'cnt="\u0661"', 1), r"attribute cnt of .* must be an integer written in ASCII"),
        (lambda t: t.replace('ngpus="2"', 'ngpus="2.0"'), r"attribute ngpus of <algo> must be an integer"),
        (lambda t: t.replace('ngpus="2"', 'ngpus="3"'), r"ngpus=3 but found <gpu> ids \[0, 1\]"),
        (lambda t: t.replace('<gpu id="1"', '<gpu id="0"'), r'<gpu id="0"> appears twice'),
        (lambda t: t.replace('coll="allreduce"', 'coll="broadcast"'), "unsupported collective coll='broadcast'"),
        (lambda t: t.replace(' coll="allreduce"', ""), "missing attribute 'coll'"),
        (lambda t: t.replace('nchunksperloop="2"', 'nchunksperloop="0"'), "nchunksperloop=0 does not fit"),
        (lambda t: t.replace('i_chunks="2"', 'i_chunks="5"', 1), r'<gpu id="0"> has i_chunks=5, but allreduce'),
        (lambda t: t.replace('jaxccl:period="2"', 'jaxccl:period="4"'), "jaxccl:period=4 disagrees"),
        (lambda t: t.replace('srcbuf="i"', 'srcbuf="q"', 1), "unknown buffer srcbuf='q'"),
        (lambda t: t.replace('depid="-1" deps="-1"', 'depid="7" deps="0"', 1), "depends on threadblock 7"),
        (lambda t: t.replace('depid="-1" deps="-1"', 'depid="1" deps="9"', 1), "depends on step 9 of threadblock 1"),
        (lambda t: t.replace('depid="-1" deps="-1"', 'depid="0" deps="-1"', 1), "depid=0 but deps=-1"),
        (lambda t: t.replace('<step s="1"', '<step s="5"', 1), "has s=5; steps must be numbered"),
        (lambda t: t.replace('proto="Simple"', 'proto="Fast"'), "unknown protocol proto='Fast'"),
        (lambda t: t.replace('outofplace="1"', 'outofplace="0"'), 'outofplace="0" without inplace="1"'),
        (lambda t: t.replace('nchannels="2"', 'nchannels="1"'), "nchannels=1 but a threadblock uses channel 1"),
        (
            lambda t: t.replace("<algo ", "<algorithm ").replace("</algo>", "</algorithm>"),
            "root element must be <algo>",
        ),
        (lambda t: t.replace('<tb id="1"', '<tb id="0"', 1), r'<tb id="0"> of <gpu id="0"> appears twice'),
        (lambda t: t.replace("<tb ", "<bt ", 1).replace("</tb>", "</bt>", 1), "unexpected element <bt>"),
        (lambda t: t.replace('srcoff="0"', 'srcoff="-1"', 1), "needs a src buffer"),
        (lambda t: t.replace('cnt="1"', 'cnt="0"', 1), "count must be >= 1"),
        (lambda t: t.replace("<gpu", '<!DOCTYPE x [<!ENTITY a "b">]><gpu', 1), "DOCTYPE"),
        (lambda t: t.replace('jaxccl:period="2"', 'jaxccl:period="2" jaxccl:algbw="fast"'), "algbw .*got 'fast'"),
        (lambda t: t.replace('jaxccl:period="2"', 'jaxccl:period="2" jaxccl:algbw="inf"'), "algbw .*got 'inf'"),
        (lambda t: t.replace('jaxccl:period="2"', 'jaxccl:period="2" jaxccl:algbw="-1"'), "algbw .*must be positive"),
        (lambda t: t.replace('jaxccl:period="2"', 'jaxccl:period="2" jaxccl:bound="1e999"'), "bound .*must be finite"),
    ],
)
def test_corrupt_xml(edit, match):
    text = edit(GOOD)
    assert text != GOOD
    with pytest.raises(ScheduleError, match=match):
        from_msccl_xml(text)


def test_corrupt_info_comment():
    text = to_msccl_xml(ring_allgather(2))
    bad = text.replace('{"algorithm"', '{"algorithm"::', 1)
    with pytest.raises(ScheduleError, match="malformed jaxccl:info comment"):
        from_msccl_xml(bad)


def test_export_arguments():
    s = ring_allgather(2)
    with pytest.raises(ScheduleError, match="unknown MSCCL protocol"):
        to_msccl_xml(s, proto="TCP")
    with pytest.raises(ScheduleError, match="min_bytes <= max_bytes"):
        to_msccl_xml(s, min_bytes=10, max_bytes=5)
    with pytest.raises(ScheduleError, match="expected a Schedule"):
        to_msccl_xml("x")
    assert s.to_msccl_xml(proto="LL") == to_msccl_xml(s, proto="LL")


def test_bytes_input_and_schedule_method():
    s = direct_alltoall(3)
    assert from_msccl_xml(s.to_msccl_xml().encode()) == s
    assert isinstance(from_msccl_xml(to_msccl_xml(s)), Schedule)


@pytest.mark.parametrize(
    "schedule, match",
    [
        (ring_allgather(300), r"rank 0 threadblock 0 needs 301 steps .* allows 256"),
        (direct_alltoall(40), r"rank 0 has 39 threadblocks on channel 0; the MSCCL runtime allows 32"),
    ],
)
def test_export_refuses_what_the_msccl_runtime_cannot_load(schedule, match):
    with pytest.raises(ScheduleError, match=match):
        to_msccl_xml(schedule)
    assert from_msccl_xml(to_msccl_xml(schedule, runtime_limits=False)) == schedule
