"""The closed loop across processes on the native backends: which communicators it takes, where each
measurement comes from, and which rows leave a process.

- In this process: ``ProcessLoop`` and ``stage_agreed`` take a ``cpu`` communicator (they get as far
  as asking for ``jax.distributed``) and refuse ``ppermute`` and an unresolved ``auto`` one, saying why;
  :func:`published_rows` picks the executor's meter inside a process and the transport's across.
- Jobs of real processes (tests/workers/loop_sources_worker.py): two processes with the transport
  attached publish transport rows only, each of its own ranks to the other process's, and process 0
  gathers both processes' rows; one process with link emulation publishes exactly the executor's
  samples, read through ``Communicator.telemetry()`` / ``measurement()``.
- With a GPU (skipped here): a ``cuda`` communicator with a topology is taken, its executor a source.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxccl
from jaxccl.control.process_loop import ProcessLoop, published_rows
from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import check_loop_backend, stage_agreed
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.errors import ArgumentError, ExecutorError
from jaxccl.runtime.communicator import default_communicator
from jaxccl.topology import rail, single_node

WORKER = Path(__file__).parents[1] / "workers" / "loop_sources_worker.py"
TRANSPORT = transport_unavailable()
nan = np.nan


def _comm(backend: str) -> jaxccl.Communicator:
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    return jaxccl.Communicator(mesh, "d", topology=rail(hosts=2, gpus_per_host=2), backend=backend)


# ------------------------------------------------------------------ which communicators
def test_cpu_communicators_are_taken():
    comm = _comm("cpu")
    check_loop_backend(comm, "ProcessLoop")
    with pytest.raises(ExecutorError, match="jax.distributed.initialize"):  # past the backend check
        ProcessLoop(comm)
    with pytest.raises(ExecutorError, match="jax.distributed.initialize"):
        stage_agreed(comm, "all_gather", comm.schedule("all_gather"), round_id=1)


def test_ppermute_is_refused_saying_why():
    comm = _comm("ppermute")
    why = r"ppermute backend, which lowers the schedule .* no meter .* not a hot-swap .* needs backend 'cpu' or 'cuda'"
    with pytest.raises(ArgumentError, match=f"ProcessLoop: .*{why}"):
        ProcessLoop(comm)
    with pytest.raises(ArgumentError, match=rf"stage_agreed\(\): .*{why}"):
        stage_agreed(comm, "all_gather", comm.schedule("all_gather"), round_id=1)


def test_a_default_communicator_is_refused_saying_why():
    comm = default_communicator("loop-backends", 4)
    with pytest.raises(ArgumentError, match=r"auto backend, chosen only when a program is lowered"):
        check_loop_backend(comm, "ProcessLoop")


@pytest.mark.skipif(not jaxccl.has_cuda_support(), reason="needs the CUDA executor and a GPU")
def test_a_cuda_communicator_is_taken_with_its_kernel_as_a_source():
    gpus = jax.devices("gpu")
    comm = jaxccl.Communicator(Mesh(np.array(gpus), ("d",)), "d", topology=single_node(len(gpus)), backend="cuda")
    check_loop_backend(comm, "ProcessLoop")
    with pytest.raises(ExecutorError, match="jax.distributed.initialize"):  # past the backend check
        ProcessLoop(comm)
    assert comm.measuring
    m = comm.measurement()
    assert (m.backend, m.scope) == ("cuda", "process")
    assert comm.telemetry().num_gpus == len(gpus)


# ------------------------------------------------------------------ which rows leave a process
def test_rows_inside_a_process_come_from_the_executor_across_from_the_transport():
    # ranks 0, 1 in process 0 on hosts 0, 1; ranks 2, 3 in process 1 on hosts 0, 1
    process_of_rank, host_of_rank = [0, 0, 1, 1], [0, 1, 0, 1]
    transport = np.full((4, 4), nan)
    transport[0, 3] = 30.0  # across processes and hosts: published
    transport[0, 2] = 20.0  # across processes, one host: no entry of the matrix
    transport[0, 1] = 10.0  # inside the process: the transport has no say
    executor = np.full((4, 4), nan)
    executor[0, 0], executor[1, 1] = 1.0, 2.0  # intra-host injection
    executor[0, 1] = 5.0  # inside the process, across hosts
    executor[0, 3] = 99.0  # across processes: the transport's
    executor[3, 3] = 7.0  # another process's rank
    rows = published_rows(transport, executor, process_of_rank=process_of_rank, host_of_rank=host_of_rank, process=0)
    assert rows == [[0, 0, 1.0], [0, 1, 5.0], [0, 3, 30.0], [1, 1, 2.0]]
    other = published_rows(transport, executor, process_of_rank=process_of_rank, host_of_rank=host_of_rank, process=1)
    assert other == [[3, 3, 7.0]]
    # without an executor source only the transport's pairs across processes leave
    assert published_rows(transport, None, process_of_rank=process_of_rank, host_of_rank=host_of_rank, process=0) == [
        [0, 3, 30.0]
    ]


# ------------------------------------------------------------------ real jobs
def _job(mode: str, processes: int, steps: int) -> list[ProcessResult]:
    results = launch(
        [sys.executable, str(WORKER), mode, str(steps)], processes, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=300
    )
    report = "\n----\n".join(f"process {r.process_id} (rc {r.returncode}):\n{r.output[-3000:]}" for r in results)
    assert all(r.returncode == 0 and "ALL OK" in r.output for r in results), report
    for r in results:
        assert "EVENT error" not in r.output, report
        refused = [line for line in r.output.splitlines() if line.startswith("REFUSED ")]
        assert [line.split(":")[0] for line in refused] == ["REFUSED ProcessLoop", "REFUSED stage_agreed"], report
        assert all("ppermute backend" in line for line in refused), report
    return results


def _lines(r: ProcessResult, prefix: str) -> list[str]:
    return [line[len(prefix) + 1 :] for line in r.output.splitlines() if line.startswith(prefix + " ")]


@pytest.mark.multiprocess
@pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")
def test_across_processes_each_publishes_its_transport_rows_and_process_0_gathers_both():
    results = _job("transport", 2, 4)
    report = "\n----\n".join(r.output[-2000:] for r in results)
    sources = set()
    for r in results:
        assert _lines(r, "SOURCES") == ["transport"], report
        assert not _lines(r, "MEASUREMENT"), report
        local = {int(x) for x in _lines(r, "LOCAL")[0].split(",")}
        rows = [row for line in _lines(r, "ROWS") for row in json.loads(line)]
        assert rows, report
        for src, dst, rate in rows:  # its own ranks, to ranks of the other process (the other host)
            assert src in local and dst not in local and rate > 0, report
        sources |= {src for src, _, _ in rows}
    gathered = {tuple(e) for e in json.loads(_lines(results[0], "GATHERED")[0])}
    assert {src for src, _ in gathered} == sources == {0, 1, 2, 3}, report


def test_in_one_process_the_executor_rows_are_published_through_the_one_api():
    (r,) = _job("executor", 1, 3)
    assert _lines(r, "SOURCES") == ["executor,transport"], r.output
    assert set(_lines(r, "MEASUREMENT")) == {"cpu network"}, r.output
    assert _lines(r, "EXECUTOR_MATCH") == ["ok"] * 3, r.output
    rows = [row for line in _lines(r, "ROWS") for row in json.loads(line)]
    host = [0, 0, 1, 1]
    assert any(src == dst for src, dst, _ in rows), r.output  # a rank's intra-host injection
    assert any(host[src] != host[dst] for src, dst, _ in rows), r.output  # a pair across the hosts
    assert all(src == dst or host[src] != host[dst] for src, dst, _ in rows), r.output
