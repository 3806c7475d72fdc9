"""Link emulation refuses settings and links it cannot emulate, and a missed deadline leaves the communicator usable."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from programs import all_gather_pair

import jaxccl
from jaxccl.errors import TopologyError
from jaxccl.runtime import native
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.runtime.failures import executor_errors
from jaxccl.topology import rail

TOPO = rail(hosts=2, gpus_per_host=4)
NIC = (0, "tor:s0r0")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"slots_per_tb": 2**31 - 1}, "slots_per_tb must be <= 65536"),
        ({"time_scale": 1e-300}, r"time_scale must be in \[1e-09, 1\]"),
        ({"time_scale": 2.0}, r"time_scale must be in \[1e-09, 1\]"),
    ],
)
def test_link_emulation_settings_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinkEmulation(**kwargs)


def _comm(topology=TOPO, **kwargs):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    return mesh, jaxccl.Communicator(
        mesh, "d", topology=topology, backend="cpu", link_emulation=LinkEmulation(**kwargs)
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"capacity": 1e-6}, r"link 0 -> 'tor:s0r0' at 1e-06 bytes/s is 1e-09 real bytes/s .* below"),
        ({"latency": 1e9}, r"link 0 -> 'tor:s0r0' has latency 1e\+09 s, 1e\+12 real seconds .* above"),
    ],
)
def test_links_the_emulator_cannot_pace_are_refused(edit, match):
    bad = TOPO.with_edges({NIC: edit})
    with pytest.raises(TopologyError, match=match):
        _comm(bad)
    _, comm = _comm()
    with pytest.raises(TopologyError, match=match):
        comm.inject(bad)


def test_a_missed_deadline_leaves_the_communicator_usable():
    mesh, comm = _comm(time_scale=1e-3)
    f, ref = all_gather_pair(mesh)
    x = np.random.default_rng(0).standard_normal(8 * 4096).astype(np.float32) + 0.5
    timeout = native.get_timeout()
    native.set_timeout(2.0)
    try:
        with comm:
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
            comm.inject(TOPO.degrade(*NIC, capacity=1.0))  # 1 B/s: the next call cannot finish in 2 s
            with pytest.raises(jaxccl.DeadlineError, match="deadline exceeded") as e, executor_errors():
                np.asarray(f(x))
            assert isinstance(e.value, jaxccl.ExecutorError) and isinstance(e.value, TimeoutError)
            assert e.value.rank is not None and e.value.threadblock is not None and e.value.op is not None
            comm.inject(TOPO)
            for k in range(3):  # healed: the same schedule runs again, at once and later
                y = x + k
                np.testing.assert_array_equal(np.asarray(f(y)), np.asarray(ref(y)))
    finally:
        native.set_timeout(timeout)


def test_an_executor_failure_leaving_with_comm_is_an_executor_error():
    mesh, comm = _comm(time_scale=1e-3)
    f, _ = all_gather_pair(mesh)
    x = np.ones(8 * 1024, np.float32)
    timeout = native.get_timeout()
    native.set_timeout(1.0)
    try:
        with pytest.raises(jaxccl.DeadlineError) as e, comm:
            comm.inject(TOPO.degrade(*NIC, capacity=1.0))
            np.asarray(f(x))
        assert "jaxccl: deadline exceeded" in str(e.value) and e.value.__cause__ is not None
    finally:
        comm.inject(TOPO)
        native.set_timeout(timeout)
