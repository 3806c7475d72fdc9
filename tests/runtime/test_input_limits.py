"""Input too large for the machine or for Python: refused up front with the named error, exit status 2 from the CLI.

- ``jaxccl bench`` estimates the memory of a run before JAX starts and refuses sizes and device counts it
  cannot hold (:mod:`jaxccl.cli.bench_memory`) instead of growing until the OOM killer ends it.
- A number in a topology, schedule JSON or MSCCL XML that does not fit a float (``10**400``) or 64 bits,
  or a JSON integer of more than 4300 digits, is a ``TopologyError`` / ``ScheduleError`` naming the field
  (:mod:`jaxccl.util.strict`), never ``OverflowError``, ``ValueError`` or ``MemoryError``.
- Nesting deeper than the parsers (or later JSON encoding) can recurse through is a named error too.

The subprocesses run under a 4 GiB address-space limit, so a bench that does not refuse cannot take the
machine down with it: it fails the test by its exit status instead.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxccl.cli import bench_memory, main
from jaxccl.cli.args import UsageError
from jaxccl.errors import ScheduleError, TopologyError
from jaxccl.schedule import Schedule, from_msccl_xml
from jaxccl.schedule.msccl_xml import to_msccl_xml
from jaxccl.synth.baselines import ordered_allreduce
from jaxccl.topology import Topology, rail

ADDRESS_SPACE = 4 << 30
SUBPROCESS_TIMEOUT_S = 90
BIG = 10**400  # fits no float (and no int64)
DEEP = 100_000
LIMITED = (
    "import resource, runpy, sys; "
    f"resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE}, {ADDRESS_SPACE})); "
    "sys.argv = ['jaxccl', *sys.argv[1:]]; runpy.run_module('jaxccl', run_name='__main__')"
)


def _jaxccl(*argv: str) -> subprocess.CompletedProcess:
    """``jaxccl ARGV`` in a fresh process that cannot map more than ``ADDRESS_SPACE`` bytes."""
    return subprocess.run(
        [sys.executable, "-c", LIMITED, *argv],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )


# ---------------------------------------------------------------------------------------- jaxccl bench memory
@pytest.mark.parametrize(
    "argv, needles",
    [
        (["-b", "4K", "-e", "1T"], ["needs about", "TiB of memory", "available", "-e/--max-bytes"]),
        (["--devices", "100000"], ["--devices 100000", "at most 1024 devices"]),
    ],
    ids=["sizes", "devices"],
)
def test_bench_refuses_what_it_cannot_allocate_before_allocating(argv, needles):
    proc = _jaxccl("bench", *argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(n in proc.stderr for n in needles), proc.stderr
    assert "# jaxccl bench" not in proc.stdout  # refused before JAX started, not after a few rows


def test_bench_memory_estimate_names_what_fits(monkeypatch, capsys):
    available = 24 << 30  # the machine of the finding
    monkeypatch.setattr(bench_memory, "available_bytes", lambda path=bench_memory.MEMINFO: available)
    # The refusal comes before JAX starts: nothing of the sweep runs in this (8-device) test process.
    assert main(["bench", "-b", "4K", "-e", "1T", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "24 GiB is available" in err, err
    fits = int(err.split("lower -e/--max-bytes to ")[1].split()[0])
    assert fits >= 64 << 20  # the default sweep (to 16M) and a bit more stay allowed
    sizes = [4 << 10 << (2 * i) for i in range(15)]
    kept = [s for s in sizes if s <= fits]
    args = {"local_devices": 8, "num_ranks": 8, "available": available}
    bench_memory.check_memory(("all_to_all", "psum"), kept, "float32", **args)  # what it names does fit
    with pytest.raises(UsageError, match="lower -e"):
        bench_memory.check_memory(("all_to_all", "psum"), [*kept, fits * 4], "float32", **args)
    # Hundreds of devices: the runtime alone (schedules grow with the square of the rank count) does not fit.
    assert main(["bench", "--devices", "600", "-e", "4K", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "of memory (600 devices:" in err and "fewer devices" in err, err
    # --processes P starts every process here: P times one process's memory.
    with pytest.raises(UsageError, match="4 processes of 8 devices: .* each"):
        bench_memory.check_memory(("psum",), [1 << 30], "float32", **args, processes_here=4)


def test_bench_memory_estimate_counts_every_buffer():
    one = bench_memory.point_bytes("psum", 1 << 20, dtype="float32", local_devices=1, num_ranks=8)
    eight = bench_memory.point_bytes("psum", 1 << 20, dtype="float32", local_devices=8, num_ranks=8)
    assert eight - one == 7 * 5 * (1 << 20)  # per device: input twice, jaxccl's and jax.lax's outputs, temporaries
    half = bench_memory.point_bytes("psum", 1 << 20, dtype="bfloat16", local_devices=8, num_ranks=8)
    assert half > eight  # float16/bfloat16 are computed in float32
    assert bench_memory.point_bytes("psum", 4, dtype="float32", local_devices=8, num_ranks=8) == 0  # skipped size
    assert bench_memory.available_bytes("/no/such/file") is None


# ----------------------------------------------------------------------------------- numbers that do not fit
def _topology_json(edit) -> str:
    doc = json.loads(rail(hosts=1, gpus_per_host=2).to_json())
    edit(doc)
    return json.dumps(doc)


def test_cli_topology_with_a_400_digit_capacity_exits_2_naming_the_field(tmp_path):
    path = tmp_path / "topology.json"
    path.write_text(_topology_json(lambda d: d["edges"][0].update(capacity=BIG)))
    proc = _jaxccl("synth", "allgather", "--topology", str(path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "capacity" in proc.stderr and "fit a float" in proc.stderr and str(path) in proc.stderr


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Topology.from_json(_topology_json(lambda d: d["edges"][0].update(capacity=BIG))), "capacity"),
        (lambda: Topology.from_json(_topology_json(lambda d: d["edges"][0].update(latency=BIG))), "latency"),
        (lambda: Topology.from_json(_topology_json(lambda d: d["nodes"][0].update(host=float("inf")))), "host"),
        (
            lambda: Topology.from_json(
                _topology_json(lambda d: d["edges"][0].update(capacity=7)).replace(": 7,", ": 1" + "0" * 5000 + ",", 1)
            ),
            "4300 digits",
        ),
        (lambda: Topology.from_edges(2, [(0, 1, BIG, 0.0), (1, 0, 1e9, 0.0)]), "capacity"),
        (lambda: Topology.from_edges(2, [(0, 1, 1e9, "soon"), (1, 0, 1e9, 0.0)]), "latency"),
        (lambda: rail(hosts=2).degrade(0, "nvs:h0", gbps=BIG), "gbps"),
        (lambda: rail(hosts=2).degrade(0, "nvs:h0", capacity=BIG), "capacity"),
        (lambda: rail(hosts=2).degrade(0, "nvs:h0", latency=BIG), "latency"),
    ],
    ids=["json capacity", "json latency", "json host", "json 5000 digits", "edges", "edges str", "gbps", "cap", "lat"],
)
def test_topology_numbers_that_do_not_fit_are_topology_errors(make, match):
    with pytest.raises(TopologyError, match=match):
        make()


SCHEDULE = ordered_allreduce(4)
XML = to_msccl_xml(SCHEDULE)


def _schedule_json(key: str, value: object) -> str:
    return json.dumps({**SCHEDULE.to_dict(), key: value})


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: Schedule.from_json(_schedule_json("algbw", BIG)), "algbw .*fit a float"),
        (lambda: Schedule.from_json(_schedule_json("bound", -BIG)), "bound .*fit a float"),
        (lambda: Schedule.from_json(_schedule_json("num_ranks", BIG)), "num_ranks does not fit 64 bits"),
        (lambda: Schedule.from_json(_schedule_json("scratch_chunks", 1 << 64)), "scratch_chunks does not fit 64"),
        (
            lambda: Schedule.from_json(_schedule_json("num_ranks", 7).replace(": 7", ": 1" + "0" * 5000, 1)),
            "malformed schedule JSON.*4300 digits",
        ),
        (lambda: from_msccl_xml(XML.replace("jaxccl:period", f'jaxccl:algbw="{BIG}" jaxccl:period')), "algbw .*fit"),
        (lambda: from_msccl_xml(XML.replace('ngpus="4"', f'ngpus="{BIG}"')), "ngpus of <algo> does not fit 64"),
        (lambda: from_msccl_xml(XML.replace('cnt="1"', 'cnt="1' + "0" * 5000 + '"', 1)), "cnt of .* does not fit 64"),
        (lambda: from_msccl_xml(XML.replace('ngpus="4"', 'ngpus="1000000000000"')), "ngpus=1000000000000 but"),
        (
            lambda: from_msccl_xml(XML.replace("</algo>", '<!-- jaxccl:info {"a": 1' + "0" * 5000 + "} --></algo>")),
            "jaxccl:info comment.*4300 digits",
        ),
    ],
    ids=[
        "algbw",
        "bound",
        "num_ranks",
        "scratch",
        "5000 digits",
        "xml algbw",
        "xml ngpus",
        "xml cnt",
        "xml 1e12",
        "xml info",
    ],
)
def test_schedule_numbers_that_do_not_fit_are_schedule_errors(make, match):
    with pytest.raises(ScheduleError, match=match):
        make()


# --------------------------------------------------------------------------------------------- deep nesting
DEEP_ELEMENTS = "<a>" * DEEP + "</a>" * DEEP


@pytest.mark.parametrize(
    "text",
    [
        DEEP_ELEMENTS,
        XML.replace("</algo>", DEEP_ELEMENTS + "</algo>"),
        XML.replace("/>", ">" + "<a><!-- c -->" * DEEP + "</a>" * DEEP + "</step>", 1),  # ignored before: kept
        XML.replace("</algo>", '<!-- jaxccl:info {"a": ' + "[" * DEEP + "]" * DEEP + "} --></algo>"),
        XML.replace("</algo>", '<!-- jaxccl:info {"a": ' + "[" * 500 + "]" * 500 + "} --></algo>"),
    ],
    ids=["elements", "elements in algo", "elements in a step", "info comment", "info comment 500"],
)
def test_deep_msccl_xml_is_a_schedule_error_naming_the_nesting(text):
    with pytest.raises(ScheduleError, match="nest"):
        from_msccl_xml(text)


def test_nested_comment_openers_are_a_schedule_error():
    with pytest.raises(ScheduleError, match="malformed MSCCL XML"):
        from_msccl_xml("<!--" * DEEP + "-->" * DEEP)


def test_deep_json_is_a_named_error_at_parse_time():
    nested = "[" * DEEP + "]" * DEEP
    with pytest.raises(ScheduleError, match="nested too deeply"):
        Schedule.from_json(nested)
    with pytest.raises(TopologyError, match="nested too deeply"):
        Topology.from_json(nested)
    # Shallow enough for json.loads, too deep for what comes later (to_json, fingerprint): refused now.
    deep_info = json.dumps({**SCHEDULE.to_dict(), "info": {"a": json.loads("[" * 500 + "]" * 500)}})
    with pytest.raises(ScheduleError, match="info.*nests"):
        Schedule.from_json(deep_info)
    deep_meta = _topology_json(lambda d: d.update(meta={"a": json.loads("[" * 500 + "]" * 500)}))
    with pytest.raises(TopologyError, match="nests"):
        Topology.from_json(deep_meta)
    ok = _topology_json(lambda d: d.update(meta={"a": [[[1]]]}))
    assert Topology.from_json(ok).meta == {"a": [[[1]]]}
