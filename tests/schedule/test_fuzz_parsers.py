"""Property-based fuzzing of everything jaxccl reads from a user: MSCCL XML, schedule JSON, topology JSON.

The property is the same for each: whatever the input, parsing (and, when it
parses, validating) either succeeds or raises the format's named error
(:class:`jaxccl.ScheduleError` / :class:`jaxccl.TopologyError`); never another
exception, a hang or a huge allocation. What parses and validates round-trips.

Runs derandomized with a small budget in CI (well under a minute); set
``JAXCCL_FUZZ=long`` for a long campaign (``benchmarks/correctness/fuzz.py`` does).
"""

from __future__ import annotations

import copy
import json
import os
import re
import tracemalloc

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxccl.errors import ScheduleError, TopologyError  # noqa: E402
from jaxccl.schedule import Buffer, Schedule, ScheduleBuilder, from_msccl_xml  # noqa: E402
from jaxccl.schedule.msccl_xml import to_msccl_xml  # noqa: E402
from jaxccl.synth import baselines  # noqa: E402
from jaxccl.topology import Topology, fat_tree, rail, ring  # noqa: E402

settings.register_profile(
    "ci", max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=5_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROFILE = os.environ.get("JAXCCL_FUZZ", "ci")

SCHEDULES = [
    baselines.ring_allgather(3),
    baselines.ordered_allreduce(3),
    baselines.direct_alltoall(3),
    baselines.ring_reduce_scatter(4),
    baselines.recursive_doubling_allgather(4),
]
XMLS = [to_msccl_xml(s) for s in SCHEDULES]
TOPOLOGIES = [rail(hosts=2, gpus_per_host=2), ring(4), fat_tree(4)]

# Values a hostile or sloppy file may hold where a number belongs.
NUMBER_TEXTS = st.one_of(
    st.integers(-5, 40).map(str),
    st.sampled_from(["1_0", "\u0661", "٣", "1e3", "2.0", "inf", "nan", "-0", " 3 ", "", "0x10", "+7", "1" * 30, "-1"]),
    st.text(max_size=6),
)
JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)


def _xml_attr_edit(draw_xml: str, which: int, value: str) -> str:
    attrs = list(re.finditer(r'(\w[\w:]*)="([^"]*)"', draw_xml))
    m = attrs[which % len(attrs)]
    return draw_xml[: m.start(2)] + value.replace('"', "&quot;").replace("<", "&lt;") + draw_xml[m.end(2) :]


def _parse_and_check(text: str) -> None:
    try:
        s = from_msccl_xml(text)
    except ScheduleError:
        return
    try:
        s.validate()
    except ScheduleError:
        return
    assert from_msccl_xml(to_msccl_xml(s, runtime_limits=False)) == s


@settings.get_profile(PROFILE)
@given(st.sampled_from(XMLS), st.lists(st.tuples(st.integers(0, 10_000), NUMBER_TEXTS), min_size=1, max_size=3))
def test_xml_attribute_values(xml, edits):
    for which, value in edits:
        xml = _xml_attr_edit(xml, which, value)
    _parse_and_check(xml)


@settings.get_profile(PROFILE)
@given(st.sampled_from(XMLS), st.data())
def test_xml_structure(xml, data):
    op = data.draw(st.sampled_from(["truncate", "delete_line", "duplicate_line", "insert", "swap_lines"]))
    lines = xml.splitlines()
    k = data.draw(st.integers(0, len(lines) - 1))
    if op == "truncate":
        xml = xml[: data.draw(st.integers(0, len(xml)))]
    elif op == "delete_line":
        xml = "\n".join(lines[:k] + lines[k + 1 :])
    elif op == "duplicate_line":
        xml = "\n".join(lines[: k + 1] + lines[k:])
    elif op == "swap_lines":
        j = data.draw(st.integers(0, len(lines) - 1))
        lines[k], lines[j] = lines[j], lines[k]
        xml = "\n".join(lines)
    else:
        pos = data.draw(st.integers(0, len(xml)))
        xml = xml[:pos] + data.draw(st.text(max_size=12)) + xml[pos:]
    _parse_and_check(xml)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _set(obj, path, value):
    if not path:
        return value
    target = obj
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return obj


def _mutated_json(doc: dict, data) -> str | None:
    """``doc`` with one to three values replaced by random JSON, as text (``None`` if not representable)."""
    paths = list(_paths(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        try:
            doc = _set(copy.deepcopy(doc), path, data.draw(JSON_VALUES))
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed the path
    try:
        return json.dumps(doc)
    except ValueError:
        return None


@settings.get_profile(PROFILE)
@given(st.sampled_from(SCHEDULES), st.data())
def test_schedule_json_values(schedule, data):
    text = _mutated_json(schedule.to_dict(), data)
    try:
        s = Schedule.from_json(text)
        s.validate()
    except ScheduleError:
        return
    assert Schedule.from_json(s.to_json()) == s


@settings.get_profile(PROFILE)
@given(st.sampled_from(TOPOLOGIES), st.data())
def test_topology_json_values(topology, data):
    text = _mutated_json(topology.to_dict(), data)
    try:
        t = Topology.from_json(text)
    except TopologyError:
        return
    assert Topology.from_json(t.to_json()) == t


@pytest.mark.parametrize(
    "text",
    [
        '{"schema": "jaxccl.schedule/1", "ranks": ' + "[" * 5000 + "]" * 5000 + "}",
        "[" * 100_000,
    ],
)
def test_deeply_nested_json_is_a_named_error(text):
    with pytest.raises(ScheduleError):
        Schedule.from_json(text)
    with pytest.raises(TopologyError):
        Topology.from_json(text)


def test_small_files_cannot_ask_for_huge_memory():
    big_scratch = XMLS[0].replace('s_chunks="0"', 's_chunks="100000000"')
    tracemalloc.start()
    try:
        from_msccl_xml(big_scratch).validate()  # unused scratch is never allocated
        assert tracemalloc.get_traced_memory()[1] < 50 << 20
    finally:
        tracemalloc.stop()
    # A period of 10^8 chunks on 3 ranks: refused by its size before anything per chunk is allocated.
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=100_000_000)
    for r in range(3):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r * 100_000_000), 100_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(ScheduleError, match="too large to check"):
            b.build().validate()
        assert tracemalloc.get_traced_memory()[1] < 50 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_ranks", "3"),
        ("num_ranks", 3.7),
        ("num_ranks", True),
        ("chunks_per_period", 1.0),
        ("scratch_chunks", False),
        ("algbw", float("inf")),
        ("algbw", -1.0),
        ("algbw", True),
        ("bound", float("nan")),
    ],
)
def test_schedule_json_numbers_are_strict(key, value):
    doc = SCHEDULES[0].to_dict()
    doc[key] = value
    with pytest.raises(ScheduleError, match=key):
        Schedule.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "key, value", [("capacity", True), ("capacity", "5e10"), ("capacity", float("inf")), ("latency", -1.0)]
)
def test_topology_json_numbers_are_strict(key, value):
    doc = TOPOLOGIES[0].to_dict()
    doc["edges"][0][key] = value
    with pytest.raises(TopologyError, match=key):
        Topology.from_json(json.dumps(doc))
