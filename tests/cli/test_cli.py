"""The ``jaxccl`` command line: --version, one-line user errors with exit status 2, quick defaults, plain help."""

import json
import subprocess
import sys
import time

import pytest

import jaxccl
from jaxccl.cli import build_parser, main
from jaxccl.topology import rail


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxccl", *argv], capture_output=True, text=True, timeout=120, check=False
    )


def test_version_in_a_fresh_process():
    proc = _run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"jaxccl {jaxccl.__version__} (native: ")  # the modules: tests/cli/test_info.py


def test_a_user_error_in_a_fresh_process_is_one_line_without_traceback():
    proc = _run("synth", "allgather", "--topology", "rail:2x")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "rail:2x" in proc.stderr


def _bad_topology_files(tmp_path):
    truncated = tmp_path / "truncated.json"
    truncated.write_text('{"schema": ')
    wrong_schema = tmp_path / "schema.json"
    wrong_schema.write_text(json.dumps({"schema": "someone-else/1", "nodes": []}))
    edited = json.loads(rail(hosts=2, gpus_per_host=4).to_json())
    edited["edges"][0]["capacity"] = -1
    negative = tmp_path / "negative.json"
    negative.write_text(json.dumps(edited))
    return {"truncated": truncated, "schema": wrong_schema, "negative": negative}


USER_ERRORS = {
    "bad preset": (["synth", "allgather", "--topology", "rail:2x"], "rail:2x"),
    "bad preset sim": (["sim", "run", "--topology", "torus:4"], "torus:4"),
    "zero-sized preset": (["synth", "alltoall", "--topology", "rail:0x8"], "rail:0x8"),
    "missing file": (["synth", "allgather", "--topology", "no/such/topology.json"], "does not exist"),
    "bad number": (["demo", "--steps", "ten"], "ten"),
    "negative number": (["demo", "--time-scale", "-1"], "-1"),
    "bad size": (["sim", "run", "--bytes", "12Q"], "12Q"),
    "fail step outside the run": (["demo", "--steps", "10", "--fail-step", "9"], "--fail-step"),
    "bad host list": (["synth", "alltoall", "--hosts", "2,x"], "2,x"),
    "two hosts for one synthesis": (["synth", "allgather", "--hosts", "2,4", "--scenario", "fail1"], "one host"),
    "topology and hosts": (["synth", "alltoall", "--topology", "rail:2x4", "--hosts", "2"], "not both"),
    "scenario on a ring": (["synth", "allgather", "--topology", "ring:4", "--scenario", "fail1"], "rail"),
    "unknown state": (["synth", "allgather", "--benchmark", "--states", "fail9"], "fail9"),
    "missing previous": (["synth", "allgather", "--previous", "no/such/schedule.json"], "schedule.json"),
    "unknown subcommand": (["synth", "reduce"], "reduce"),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_every_user_error_is_one_line_and_exit_status_2(case, capsys):
    argv, needle = USER_ERRORS[case]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["truncated", "schema", "negative"])
def test_bad_topology_json_is_one_line_and_exit_status_2(kind, tmp_path, capsys):
    path = _bad_topology_files(tmp_path)[kind]
    assert main(["synth", "allgather", "--topology", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err, err


def test_bare_synth_allgather_is_one_quick_synthesis(tmp_path, capsys):
    out = tmp_path / "ag.json"
    t0 = time.perf_counter()
    assert main(["synth", "allgather", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    text = capsys.readouterr().out
    assert "rail 1x2x8" in text and "benchmark" not in text
    assert elapsed < 30, f"a bare `jaxccl synth allgather` took {elapsed:.1f} s"
    s = jaxccl.schedule.Schedule.from_json(out.read_text())
    s.validate()
    assert s.num_ranks == 16 and s.algbw == s.bound  # ForestColl reaches the max-flow bound


def test_hosts_means_the_same_in_both_synth_commands(tmp_path, capsys):
    for command in ("allgather", "alltoall"):
        out = tmp_path / f"{command}.json"
        assert main(["synth", command, "--hosts", "3", "--gpus-per-host", "2", "--json", str(out)]) == 0
        assert json.loads(out.read_text())["topology"] == "rail 1x3x2"
    capsys.readouterr()


def test_warm_start_from_a_written_schedule(tmp_path, capsys):
    first = tmp_path / "healthy.json"
    assert main(["synth", "alltoall", "--hosts", "2", "--gpus-per-host", "4", "--out", str(first)]) == 0
    out = tmp_path / "warm.json"
    argv = ["synth", "alltoall", "--hosts", "2", "--gpus-per-host", "4", "--scenario", "fail2"]
    assert main([*argv, "--previous", str(first), "--out", str(out)]) == 0
    warm = jaxccl.schedule.Schedule.from_json(out.read_text())
    warm.validate()
    assert warm.num_ranks == 8
    capsys.readouterr()


def test_old_benchmark_spelling_still_runs_the_benchmark_with_a_deprecation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["synth", "allgather", "--hosts", "2", "4", "--states", "base", "--methods", "forestcoll", "--runs", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "deprecated" in capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [16, 32] and all(r["optimal"] for r in rows)


def _parsers(parser):
    yield parser
    for action in parser._actions:
        for sub in getattr(action, "choices", None).values() if isinstance(action.choices, dict) else ():
            yield from _parsers(sub)


def test_help_texts_show_no_rest_markup():
    parsers = list(_parsers(build_parser()))
    assert len(parsers) >= 9  # jaxccl, demo, synth, synth x2, sim, sim x4
    for p in parsers:
        text = p.format_help()
        for markup in ("``", ":class:", ":mod:", ":func:", ":meth:"):
            assert markup not in text, f"{p.prog} --help shows {markup!r}"


def test_png_without_matplotlib_fails_before_any_work(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    t0 = time.perf_counter()
    png = str(tmp_path / "x.png")
    for argv in (["demo", "--png", png], ["sim", "fig1", "--quick", "--png", png], ["sim", "run", "--png", png]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "matplotlib" in err
    assert time.perf_counter() - t0 < 5  # nothing ran
