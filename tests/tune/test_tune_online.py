"""The bandit selector driving a live communicator: choose between steps, learn from executor latencies."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from programs import all_gather_pair

import jaxccl
from jaxccl.runtime import native
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.topology import rail
from jaxccl.tune import OnlineTuner, Selector, TuneError

TOPO = rail(hosts=2, gpus_per_host=4)


def _setup():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    comm = jaxccl.Communicator(mesh, "d", topology=TOPO, backend="cpu", link_emulation=LinkEmulation(time_scale=1e-2))
    f, ref = all_gather_pair(mesh)
    return comm, f, ref


def _loop(comm, f, ref, tuner, steps, elems):
    nbytes = 8 * elems * 4  # one rank's AllGather output (nccl-tests convention)
    arms = []
    with comm:
        for k in range(steps):
            arm = tuner.prepare("all_gather", nbytes)
            x = np.random.default_rng(k).standard_normal(8 * elems).astype(np.float32) + 0.5
            np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(ref(x)))
            assert (
                comm.schedule("all_gather").digest == tuner.selector.schedules(("all_gather", 8, nbytes), arm)[0].digest
            )
            tuner.record("all_gather", nbytes, arm)
            arms.append(arm)
    return arms


def test_tuner_runs_the_chosen_arm_and_learns_from_executor_latency():
    comm, f, ref = _setup()
    sel = Selector.for_topology(TOPO, policy={"policy": "ucb1", "alpha": 0.5, "pseudo_count": 0.1})
    tuner = OnlineTuner(comm, sel)
    arms = _loop(comm, f, ref, tuner, 8, 1 << 12)
    latencies = [lat for _, _, lat in tuner.history]
    assert all(lat is not None and lat > 0 for lat in latencies)
    assert native.last_launch_seconds(comm.slot("all_gather")) == pytest.approx(latencies[-1])
    assert len(arms) == 8 and sel.contexts == ["all_gather/8/131072"]
    # deterministic: a replica fed the same observations chooses the same arm
    replica = Selector.for_topology(TOPO, policy={"policy": "ucb1", "alpha": 0.5, "pseudo_count": 0.1})
    replica.import_state(sel.export_state())
    ctx = ("all_gather", 8, 8 * (1 << 12) * 4)
    assert replica.choose(ctx) == sel.choose(ctx)


def test_tuner_bad_input():
    mesh = Mesh(np.array(jax.devices()), ("d",))
    with pytest.raises(TuneError, match="native backend"):
        OnlineTuner(jaxccl.Communicator(mesh, "d", backend="ppermute"), Selector.for_topology(TOPO))
