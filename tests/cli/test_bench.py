"""``jaxccl bench``: table and JSON, every dtype, #wrong catching wrong schedules, one-line errors, 2 processes."""

import importlib
import json
from pathlib import Path

import pytest

import jaxccl
from jaxccl.cli import main
from jaxccl.cli.bench_sweep import COLLECTIVES, REDOP, bus_factor, refusal, sweep
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.runtime.default_schedules import direct_allgather

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1", "--quiet"]
COLUMNS = ["size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "lax time", "lax busbw", "ratio"]
ROW_KEYS = {
    "collective",
    "size",
    "count",
    "type",
    "redop",
    "time_us",
    "algbw_GBs",
    "busbw_GBs",
    "wrong",
    "lax_time_us",
    "lax_algbw_GBs",
    "lax_busbw_GBs",
    "ratio",
}
TOP_KEYS = {
    "command",
    "num_devices",
    "num_processes",
    "backend",
    "dtype",
    "iters",
    "warmup",
    "interleaved",
    "in_place",
    "topology",
    "emulate_links",
    "time_scale",
    "scenario",
    "schedules",
    "validated",
    "rows",
    "skipped",
    "summary",
}


def _bench(tmp_path, *argv):
    path = tmp_path / "bench.json"
    rc = main(["bench", *QUICK, "--json", str(path), *argv])
    return rc, (json.loads(path.read_text()) if path.exists() else None)


def test_sweep_and_bus_factors_follow_nccl_tests():
    assert sweep(4 << 10, 64 << 20, 4) == [4 << 10 << (2 * i) for i in range(8)]
    assert sweep(1000, 7999, 2) == [1000, 2000, 4000]
    assert [bus_factor(c, 8) for c in COLLECTIVES] == [7 / 8] * 3 + [14 / 8] * 4


def test_table_columns_and_json_keys(tmp_path, capsys):
    rc, data = _bench(tmp_path)
    out = capsys.readouterr().out
    assert rc == 0, out
    headers = [line for line in out.splitlines() if line.startswith("#") and "busbw" in line and "size" in line]
    assert len(headers) == len(COLLECTIVES)
    positions = [headers[0].index(c) for c in COLUMNS]
    assert positions == sorted(positions), headers[0]
    assert "out-of-place only" in out and "# Avg bus bandwidth" in out and "# Out of bounds values : 0 OK" in out
    assert set(data) == TOP_KEYS
    assert data["num_devices"] == 8 and data["num_processes"] == 1 and data["in_place"] is False
    assert [r["collective"] for r in data["rows"]] == [c for c in COLLECTIVES for _ in range(2)]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        assert row["wrong"] == 0 and row["size"] in (4096, 16384) and row["count"] * 4 == row["size"]
        assert row["busbw_GBs"] == pytest.approx(row["algbw_GBs"] * bus_factor(row["collective"], 8))
        assert row["ratio"] == pytest.approx(row["time_us"] / row["lax_time_us"])
    table_rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert len(table_rows) == len(data["rows"]) and all(len(r) == len(COLUMNS) for r in table_rows)
    assert set(data["summary"]) == {"avg_busbw_GBs", "worst_ratio", "worst_at", "total_wrong"}
    assert data["summary"]["total_wrong"] == 0


def _swapped_allgather(tmp_path, num_ranks=8):
    """Direct AllGather whose rank 0 writes the blocks of ranks 1 and 2 into each other's place."""
    data = json.loads(direct_allgather(num_ranks).to_json())
    for tb in data["ranks"][0]:
        for op in tb["ops"]:
            if op[0] == "r" and op[4] in (1, 2):
                op[4] = 3 - op[4]
    path = tmp_path / "swapped.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_wrong_counts_the_elements_a_wrong_schedule_misplaces(tmp_path, capsys, backend):
    path = _swapped_allgather(tmp_path)
    rc, data = _bench(tmp_path, "--schedule", str(path), "--no-validate", "--backend", backend)
    out = capsys.readouterr().out
    assert rc == 1, out
    assert [r["collective"] for r in data["rows"]] == ["all_gather", "all_gather"]
    for row in data["rows"]:
        assert row["wrong"] == 2 * row["count"] // 8  # two blocks of one rank's output
    assert data["summary"]["total_wrong"] > 0 and data["validated"] is False
    assert "FAILED" in out


def test_a_wrong_schedule_is_refused_unless_no_validate(tmp_path, capsys):
    rc, _ = _bench(tmp_path, "--schedule", str(_swapped_allgather(tmp_path)))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "ScheduleError" in err


def test_synthesized_schedules_on_degraded_emulated_links_and_other_dtypes(tmp_path, capsys):
    rc, data = _bench(
        tmp_path,
        *("--topology", "rail:2x4", "--schedule", "synth", "--emulate-links", "--time-scale", "0.05"),
        *("--scenario", "fail2", "--dtype", "bfloat16", "--collectives", "all_gather,psum"),
    )
    assert rc == 0, capsys.readouterr().out
    assert data["emulate_links"] and data["schedules"]["psum"] == "reduce_scatter + all_gather"
    assert all(r["wrong"] == 0 and r["type"] == "bfloat16" for r in data["rows"])


DTYPE_CASES = ["int8", "uint16", "int64", "uint64", "float64", "complex64", "complex128", "bool"]


@pytest.mark.parametrize("dtype", DTYPE_CASES)
def test_every_dtype_runs_the_collectives_that_take_it_bitwise_equal_to_jax_lax(tmp_path, capsys, dtype):
    import jax
    import numpy as np

    x64_before = jax.config.jax_enable_x64
    rc, data = _bench(tmp_path, "-b", "1K", "-e", "1K", "--dtype", dtype)
    assert rc == 0, capsys.readouterr().out
    assert jax.config.jax_enable_x64 == x64_before  # the 64-bit types turn x64 on for the run only
    taking = [c for c in COLLECTIVES if refusal(c, dtype) is None]
    assert [r["collective"] for r in data["rows"]] == taking
    assert ("pmax" in taking) == (not dtype.startswith("complex")) and ("psum_scatter" in taking) == (dtype != "bool")
    itemsize = np.dtype(dtype).itemsize
    for row in data["rows"]:
        assert row["type"] == dtype and row["wrong"] == 0 and row["count"] * itemsize == row["size"] == 1024
        assert row["redop"] == REDOP.get(row["collective"], "none")


def test_the_reductions_check_catches_a_wrong_allreduce(tmp_path, capsys):
    """A ring AllReduce whose rank 0 leaves its term out of one block: #wrong counts it for every operator."""
    from jaxccl.synth.baselines import ring_allreduce

    data = json.loads(ring_allreduce(8).to_json())
    first = next(op for tb in data["ranks"][0] for op in tb["ops"] if op[0] == "rrs")
    first[:5] = ["rcs", "i", 6, "o", 6]  # rank 0 forwards block 6 without its own term
    path = tmp_path / "bad_allreduce.json"
    path.write_text(json.dumps(data))
    rc, data = _bench(tmp_path, "--schedule", str(path), "--no-validate", "--collectives", "psum,pmax,pmin,pmean")
    out = capsys.readouterr().out
    assert rc == 1, out
    assert [r["collective"] for r in data["rows"]] == ["psum", "psum", "pmax", "pmax", "pmin", "pmin", "pmean", "pmean"]
    assert all(r["wrong"] > 0 for r in data["rows"]), data["rows"]


@pytest.mark.skipif(jaxccl.has_cuda_support(), reason="this machine has CUDA")
def test_the_cuda_backend_without_cuda_is_one_line(capsys):
    assert main(["bench", *QUICK, "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "without CUDA" in err


BAD = [
    ["--collectives", "psum,allreduce"],
    ["--collectives", ","],
    ["-b", "1M", "-e", "4K"],
    ["-b", "4K", "-e", "1M", "-f", "1"],
    ["-b", "four"],
    ["-n", "0"],
    ["-w", "-1"],
    ["--dtype", "float8"],
    ["--dtype", "complex64", "--collectives", "psum,pmax"],
    ["--dtype", "bool", "--collectives", "psum_scatter"],
    ["--backend", "tpu"],
    ["--schedule", "fastest"],
    ["--topology", "rail:2x"],
    ["--topology", "rail:3x4"],
    ["--scenario", "fail2"],
    ["--emulate-links", "--scenario", "0,tor:s0r0"],
    ["--emulate-links", "--backend", "ppermute"],
    ["--emulate-links", "--time-scale", "2"],
    ["--no-validate"],
    ["--devices", "4"],
    ["--devices", "2", "--backend", "cuda"],
    ["--num-processes", "2"],
    ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0", "--backend", "ppermute"],
    ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2", "--backend", "ppermute"],
    ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0", "--backend", "cuda"],
    ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0", "--emulate-links"],
    ["--network", "netns"],
    ["--processes", "1"],
    ["--processes", "0"],
    ["--processes", "2", "--nic-rate-mbit", "100"],
    ["--processes", "2", "--network", "netns", "--nic-rate-mbit", "0"],
    ["--processes", "2", "--coordinator", "127.0.0.1:1"],
    ["--processes", "2", "--backend", "cuda"],
    ["--processes", "2", "--dtype", "complex64", "--collectives", "pmin"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_arguments_give_one_line_and_exit_status_2(capsys, argv):
    assert main(["bench", *QUICK, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxccl bench"), err


def test_a_missing_transport_or_lab_is_one_line_naming_what_to_install(monkeypatch, capsys):
    # The environment, not the bench, is replaced: a machine without the transport or without root.
    import jaxccl.distributed.transport
    import jaxccl.labs.netlab

    reason = "jaxccl's transport between processes was not built (install the 'multiprocess' extra)"
    monkeypatch.setattr(jaxccl.distributed.transport, "unavailable_reason", lambda: reason)
    assert main(["bench", *QUICK, "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'multiprocess' extra" in err and "--backend cpu" in err
    monkeypatch.setattr(jaxccl.labs.netlab, "unavailable_reason", lambda: "network namespaces need root (ip netns add)")
    assert main(["bench", *QUICK, "--processes", "2", "--backend", "ppermute", "--network", "netns"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "need root" in err


TRANSPORT_MISSING = transport_unavailable()
needs_transport = pytest.mark.skipif(TRANSPORT_MISSING is not None, reason=f"{TRANSPORT_MISSING}")


def _launched(tmp_path, capsys, *argv):
    out_json = tmp_path / "job.json"
    rc = main(["bench", *QUICK, "-e", "4K", "--processes", "2", "--devices", "2", "--json", str(out_json), *argv])
    captured = capsys.readouterr()
    assert rc == 0, captured.out[-3000:] + captured.err
    return captured.out, json.loads(out_json.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", [pytest.param("cpu", marks=needs_transport), "ppermute"])
def test_processes_launches_two_processes_of_two_devices_and_prints_process_0s_table(tmp_path, capsys, backend):
    out, data = _launched(tmp_path, capsys, "--backend", backend)
    assert out.startswith("# jaxccl bench: 4 devices in 2 process(es)")  # the table, not the libraries' logs
    assert out.count("# Avg bus bandwidth") == 1
    assert data["num_devices"] == 4 and data["num_processes"] == 2 and data["backend"] == backend
    assert [r["collective"] for r in data["rows"]] == list(COLLECTIVES)
    assert all(r["wrong"] == 0 and r["busbw_GBs"] > 0 for r in data["rows"])


@pytest.mark.multiprocess
@needs_transport
def test_the_native_backend_across_processes_catches_a_wrong_schedule(tmp_path, capsys):
    path = _swapped_allgather(tmp_path, num_ranks=4)
    out_json = tmp_path / "job.json"
    argv = ["--processes", "2", "--devices", "2", "--json", str(out_json), "--schedule", str(path), "--no-validate"]
    assert main(["bench", *QUICK, "-e", "4K", *argv]) == 1
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["collective"] == "all_gather" and row["wrong"] == 2 * row["count"] // 4


@pytest.mark.multiprocess
@needs_transport
@pytest.mark.skipif(
    importlib.import_module("jaxccl.labs.netlab").unavailable_reason() is not None,
    reason="network namespaces unavailable",
)
def test_processes_on_a_network_namespace_lab(tmp_path, capsys):
    out, data = _launched(tmp_path, capsys, "--network", "netns", "--nic-rate-mbit", "1000", "--collectives", "psum")
    assert data["num_processes"] == 2 and [r["wrong"] for r in data["rows"]] == [0]
