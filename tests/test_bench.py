"""``jaxccl bench``: table and JSON, a #wrong that catches a wrong schedule, one-line errors, 2 processes."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jaxccl
from jaxccl.cli import main
from jaxccl.cli.bench_sweep import COLLECTIVES, REDOP, bus_factor, refusal, sweep
from jaxccl.runtime.default_schedules import direct_allgather

ROOT = Path(__file__).resolve().parent.parent
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


def _swapped_allgather(tmp_path):
    """Direct AllGather on 8 ranks whose rank 0 writes the blocks of ranks 1 and 2 into each other's place."""
    data = json.loads(direct_allgather(8).to_json())
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
    ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_arguments_give_one_line_and_exit_status_2(capsys, argv):
    assert main(["bench", *QUICK, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxccl bench"), err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_of_two_devices_run_the_same_command(tmp_path):
    port, timeout_s = _free_port(), 150
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxccl", "bench", *QUICK, "-e", "4K", "--backend", "ppermute", "--devices", "2"]
            + ["--json", str(outs[i])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "JAXCCL_COORDINATOR": f"127.0.0.1:{port}", "JAXCCL_NUM_PROCESSES": "2"}
            | {"JAXCCL_PROCESS_ID": str(i)},
        )
        for i in range(2)
    ]
    deadline, logs = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            p.kill()  # nothing happens to a process that has exited
    report = "\n----\n".join(log[-3000:] for log in logs)
    assert [p.returncode for p in procs] == [0, 0], report
    assert "# Avg bus bandwidth" in logs[0] and "# Avg bus bandwidth" not in logs[1]  # process 0 prints
    assert not outs[1].exists()
    data = json.loads(outs[0].read_text())
    assert data["num_devices"] == 4 and data["num_processes"] == 2 and data["backend"] == "ppermute"
    assert [r["collective"] for r in data["rows"]] == list(COLLECTIVES)
    assert all(r["wrong"] == 0 and r["busbw_GBs"] > 0 for r in data["rows"])
