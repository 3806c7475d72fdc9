"""ProcessTuner: the online tuner across processes learns the same thing in every process and swaps together.

- Two processes x two CPU devices on the transport (tests/workers/process_tuner_worker.py): every
  process records the same arms and the same latencies, each the largest of the processes' own
  launch times; the arms it switches between run at agreed calls (every result bitwise ``jax.lax``'s).
- Processes whose selectors choose different schedules are refused with a TuneError before a swap.
- Following a ProcessLoop, every process takes the loop's re-synthesized schedule into its arms.
- In one process: a ``ppermute`` communicator and a job without ``jax.distributed`` are named errors.
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
from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.errors import ArgumentError, ExecutorError
from jaxccl.topology import rail
from jaxccl.tune import Selector
from jaxccl.tune.process_tuner import ProcessTuner

WORKER = Path(__file__).parents[1] / "workers" / "process_tuner_worker.py"
TRANSPORT = transport_unavailable()
needs_transport = pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")
STEPS = 8


def _lines(output: str, prefix: str) -> list[str]:
    return [line[len(prefix) + 1 :] for line in output.splitlines() if line.startswith(prefix + " ")]


@pytest.fixture(scope="module")
def tuned_job() -> list[ProcessResult]:
    results = launch([sys.executable, str(WORKER), "run", str(STEPS)], 2, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=240)
    for r in results:
        assert r.returncode == 0 and "ALL OK" in r.output, r.output[-3000:]  # every step bitwise jax.lax's
    return results


@pytest.mark.multiprocess
@needs_transport
def test_every_process_learns_the_slowest_launch_and_swaps_at_agreed_calls(tuned_job):
    histories = [json.loads(_lines(r.output, "HISTORY")[0]) for r in tuned_job]
    owns = [json.loads(_lines(r.output, "OWN")[0]) for r in tuned_job]
    assert histories[0] == histories[1]  # the same arms and the same latencies, in the same order
    assert len(histories[0]) >= STEPS
    for k, (_, _, latency) in enumerate(histories[0]):
        assert latency is None or latency == max(own[k] for own in owns)  # the slowest process's launch time
    arms = [arm for _, arm, _ in histories[0]]
    swaps = int(_lines(tuned_job[0].output, "SWAPS")[0])
    assert swaps >= 2 and len(set(arms)) >= 2  # UCB1 explored, each switch an agreed swap


@pytest.mark.multiprocess
@needs_transport
def test_every_process_takes_the_loops_resynthesis_into_its_arms(tuned_job):
    for r in tuned_job:
        assert json.loads(_lines(r.output, "ERRORS")[0]) == []
    resyntheses = [json.loads(_lines(r.output, "RESYNTHESES")[0]) for r in tuned_job]
    assert resyntheses[0] and resyntheses[0] == resyntheses[1]  # the same re-synthesis, in every process


@pytest.mark.multiprocess
@needs_transport
def test_processes_that_choose_different_schedules_are_refused_before_a_swap():
    results = launch([sys.executable, str(WORKER), "diverge", "1"], 2, env={"JAXCCL_TIMEOUT_S": "60"}, timeout_s=180)
    for r in results:
        assert r.returncode == 0, r.output[-3000:]
        refused = _lines(r.output, "REFUSED")
        assert refused and "chose different all_gather schedules" in refused[0], r.output[-3000:]


def _comm(backend: str) -> jaxccl.Communicator:
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    return jaxccl.Communicator(mesh, "d", topology=rail(hosts=2, gpus_per_host=2), backend=backend)


def test_a_ppermute_communicator_is_refused_saying_why():
    comm = _comm("ppermute")
    with pytest.raises(ArgumentError, match="ProcessTuner: .*ppermute"):
        ProcessTuner(comm, Selector.for_topology(comm.topology))


def test_a_job_without_jax_distributed_is_a_named_error():
    comm = _comm("cpu")
    with pytest.raises(ExecutorError, match=r"ProcessTuner needs jax.distributed.initialize"):
        ProcessTuner(comm, Selector.for_topology(comm.topology))
