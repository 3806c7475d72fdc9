"""``Communicator.measurement()`` and ``telemetry()`` on the CPU executor (link emulation), with real networks.

The CUDA side of the same API maps its module's dict with ``from_cuda_stats``
(``tests/telemetry/test_measurement_stats.py``); the GPU script runs it on a device.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from programs import all_gather_pair

import jaxccl
from jaxccl.errors import CommunicatorClosedError, ExecutorError
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.synth import baselines
from jaxccl.telemetry import MeasurementStats, from_cpu_stats
from jaxccl.telemetry.stats import CPU_STATS_KEYS
from jaxccl.topology import rail


def _comm(**emulation):
    topo = rail(hosts=2, gpus_per_host=1)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    emu = LinkEmulation(time_scale=1e-2, min_window_bytes=0, **emulation)
    comm = jaxccl.Communicator(mesh, "d", topology=topo, backend="cpu", link_emulation=emu)
    comm.install("all_gather", baselines.ring_allgather(2, channels=1))
    f, ref = all_gather_pair(mesh)
    return comm, f, ref


def _run(comm, f, ref, times):
    x = np.random.default_rng(0).standard_normal(2 << 12).astype(np.float32)
    with comm:
        for _ in range(times):
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))


def test_measurement_is_the_networks_counters_with_dropped_since_the_previous_call():
    comm, f, ref = _comm(slots_per_tb=1)  # one slot per threadblock: undrained runs drop records
    assert comm.measuring
    _run(comm, f, ref, 4)
    first = comm.measurement()
    raw = comm.network._native.measure_stats(comm.network.id)  # the network's own counters, as they are
    assert set(raw) == CPU_STATS_KEYS
    assert first == from_cpu_stats(raw)  # nothing ran in between
    assert (first.backend, first.scope) == ("cpu", "network")
    assert first.dropped == first.dropped_total > 0
    assert first.used == first.slots > 0 and first.pending == 0
    again = comm.measurement()
    assert (again.dropped, again.dropped_total) == (0, first.dropped_total)

    # telemetry() drains the records and does not move measurement()'s count of drops
    assert comm.telemetry().dropped == first.dropped_total
    drained = comm.measurement()
    assert drained.used == 0 and drained.dropped == 0
    _run(comm, f, ref, 4)
    later = comm.measurement()
    assert later.dropped == later.dropped_total - first.dropped_total > 0
    assert later.records > first.records

    comm.network.reset()  # counters restart: everything since the reset is new
    _run(comm, f, ref, 3)
    after = comm.measurement()
    assert after.dropped == after.dropped_total > 0


def test_each_communicator_counts_its_own_readings():
    a, f, ref = _comm(slots_per_tb=1)
    b, g, ref_b = _comm(slots_per_tb=1)
    _run(a, f, ref, 4)
    _run(b, g, ref_b, 4)
    assert a.measurement().dropped > 0
    assert b.measurement().dropped > 0  # a's reading took nothing from b's
    assert a.measurement().dropped == 0


def test_no_measurement_without_a_meter():
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    for backend in ("cpu", "ppermute"):
        comm = jaxccl.Communicator(mesh, "d", topology=rail(hosts=2, gpus_per_host=1), backend=backend)
        assert not comm.measuring
        for read in (comm.measurement, comm.telemetry):
            with pytest.raises(ExecutorError, match=r"needs link emulation .* or the cuda backend with a topology"):
                read()
    comm, _, _ = _comm()
    comm.close()
    with pytest.raises(CommunicatorClosedError):
        comm.measurement()


def test_the_old_network_stats_still_work_and_warn():
    comm, f, ref = _comm(slots_per_tb=1)
    _run(comm, f, ref, 2)
    with pytest.warns(DeprecationWarning, match=r"Communicator\.measurement\(\)"):
        old = comm.network.stats()
    new = comm.measurement()
    assert set(old) == CPU_STATS_KEYS
    assert {k: old[k] for k in ("windows", "records", "slots", "used", "buffer_bytes")} == {
        k: getattr(new, k) for k in ("windows", "records", "slots", "used", "buffer_bytes")
    }
    assert old["dropped"] == new.dropped_total


def test_measurement_stats_is_frozen_and_plain_data():
    comm, _, _ = _comm()
    m = comm.measurement()
    assert isinstance(m, MeasurementStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.dropped = 1
    assert dataclasses.asdict(m)["backend"] == "cpu"
