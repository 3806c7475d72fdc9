"""A schedule that does not fit its communicator never reaches a training step, whichever path stages it."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from programs import all_gather_pair

import jaxccl
from jaxccl.control import Controller
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.synth import baselines
from jaxccl.topology import rail

TOPO = rail(hosts=2, gpus_per_host=4)
NIC = (0, "tor:s0r0")


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda: baselines.ring_allgather(4), "is for N=4 ranks but axis 'd' has 8"),
        (lambda: baselines.ring_reduce_scatter(8), "implements reduce_scatter, not all_gather"),
    ],
)
def test_controller_cannot_stage_a_schedule_that_does_not_fit(wrong, message):
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(mesh, "d", topology=TOPO, backend="cpu", link_emulation=LinkEmulation(time_scale=1e-3))
    ag = jaxccl.synth.all_gather(TOPO)
    comm.install("all_gather", ag)
    f, ref = all_gather_pair(mesh)
    ctl = Controller(comm, gamma=0.15, synthesizers={"all_gather": lambda topo, previous: wrong()})
    rng = np.random.default_rng(0)
    with comm:
        comm.inject(TOPO.degrade(*NIC, gbps=100))
        for _ in range(12):
            x = rng.standard_normal(8 * (1 << 14)).astype(np.float32) + 0.25
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
            ctl.step()
    assert any(e.kind == "synthesized" for e in ctl.events), [e.kind for e in ctl.events]
    assert not any(e.kind == "staged" for e in ctl.events)
    assert any(message in e.detail["error"] for e in ctl.errors), [e.detail for e in ctl.errors]
    assert comm.schedule("all_gather") is ag
