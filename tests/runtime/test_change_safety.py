"""What keeps results right while schedules change: message identities, checked tables, closed communicators.

* Every message carries the identity of the launch that posted it (table checksum, launch); a receiver refuses
  any other with an :class:`~jaxccl.ExecutorError` naming both (the test hook posts one stale message).
* A table enters the registry only as the compilation of the schedule it is staged with.
* A closed communicator raises :class:`~jaxccl.CommunicatorClosedError` from every method, and so do
  collectives of its programs that run after or race the close.

The A->B->A sequences themselves are in ``tests/runtime/test_swap_pairs.py`` and the model-based test of change in
``tests/runtime/test_stateful_change.py``.
"""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.errors import CommunicatorClosedError, ExecutorError, ScheduleError
from jaxccl.runtime import native
from jaxccl.runtime.failures import executor_errors
from jaxccl.schedule import Buffer, ScheduleBuilder
from jaxccl.schedule.ir import OpKind
from jaxccl.schedule.table import compile_table, seal
from jaxccl.synth import baselines

N = 8


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:N]), ("data",))


def _all_gather_step(comm: jaxccl.Communicator, mesh: Mesh):
    body = jax.shard_map(
        lambda v: jaxccl.all_gather(v, "data", axis=0, tiled=True), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )

    @jax.jit
    def step(x):
        with comm:
            return body(x)

    return step


def _check(step, rng: np.random.Generator, elems: int = 64) -> None:
    x = rng.standard_normal(N * elems).astype(np.float32) + 1.0
    np.testing.assert_array_equal(np.asarray(step(x)), np.tile(x, N))


def _receive_first_all_gather(n: int):
    """An AllGather whose ranks all receive before they send: it compiles, and deadlocks (validate() refuses it)."""
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1)
    for r in range(n):
        nxt, prv = (r + 1) % n, (r - 1) % n
        tb = b.threadblock(r, send_peer=nxt, recv_peer=prv)
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        for k in range(1, n):
            origin = (r - k) % n
            b.op(r, tb, OpKind.RECV, (Buffer.OUTPUT, origin), (Buffer.OUTPUT, origin))
            b.op(r, tb, OpKind.SEND, (Buffer.OUTPUT, (origin + 1) % n), (Buffer.OUTPUT, (origin + 1) % n))
    return b.build(name="receive_first")


# ------------------------------------------------------------------------------------------- identities
def test_a_stale_message_is_refused_naming_both_launches_and_the_communicator_stays_usable(mesh):
    comm = jaxccl.Communicator(mesh, "data", backend="cpu")
    try:
        comm.install("all_gather", baselines.ring_allgather(N))
        step = _all_gather_step(comm, mesh)
        rng = np.random.default_rng(0)
        _check(step, rng)
        native._inject_stale_message(comm.slot("all_gather"))
        x = rng.standard_normal(N * 64).astype(np.float32)
        with pytest.raises(ExecutorError, match="stale message") as e, comm:
            np.asarray(step(x))
        text = str(e.value)
        checksum = compile_table(baselines.ring_allgather(N))[14].view(np.uint32)
        assert text.count(f"table 0x{int(checksum):x}") == 2, text  # what it got and what it runs
        assert "launch" in text and "was refused" in text, text
        for _ in range(3):  # the failed launch left nothing behind
            _check(step, rng)
    finally:
        comm.close()


def test_identity_checks_are_on_by_default():
    assert native.identity_checks()


def test_swap_back_after_a_schedule_of_another_layout_is_bitwise(mesh):
    # The reliability review's reproducer: recursive doubling -> ring -> recursive doubling, 64 float32 per rank.
    # The ring's message descriptors sat where recursive doubling reads its `posted` flags (the region memory
    # is reused), and a pointer's high bits read as a tag newer than any launch.
    comm = jaxccl.Communicator(mesh, "data", backend="cpu")
    try:
        step = _all_gather_step(comm, mesh)
        rng = np.random.default_rng(1)
        for schedule in ("rd", "ring", "rd", "ring", "rd"):
            comm.install(
                "all_gather",
                baselines.recursive_doubling_allgather(N) if schedule == "rd" else baselines.ring_allgather(N),
            )
            for elems in (64, 1000, 4096):
                _check(step, rng, elems)
    finally:
        comm.close()


# ------------------------------------------------------------------------------------------- tables
@pytest.fixture()
def comm(mesh):
    c = jaxccl.Communicator(mesh, "data", backend="cpu")
    c.install("all_gather", baselines.ring_allgather(N))
    yield c
    c.close()


def _refused(comm, mesh, table, match: str) -> None:
    ring = comm.schedule("all_gather")
    versions = {k: v for k, v in comm.swap_state("all_gather").items() if k.endswith(("_version", "_checksum"))}
    with pytest.raises(ScheduleError, match=match):
        comm.stage_validated("all_gather", baselines.ring_allgather(N), table=table)
    assert comm.schedule("all_gather") is ring
    state = comm.swap_state("all_gather")
    assert {k: state[k] for k in versions} == versions  # nothing reached the registry
    _check(_all_gather_step(comm, mesh), np.random.default_rng(2))


def test_the_table_of_a_deadlocking_schedule_is_refused_at_staging(comm, mesh):
    bad = _receive_first_all_gather(N)
    with pytest.raises(ScheduleError):
        bad.validate()
    _refused(comm, mesh, compile_table(bad), "not the compilation of schedule ring_allgather.*digest")


def test_an_all_to_all_table_on_the_all_gather_slot_is_refused(comm, mesh):
    _refused(comm, mesh, compile_table(baselines.direct_alltoall(N)), "table of all_to_all over 8 ranks")


def test_a_changed_table_is_refused_even_with_its_checksum_recomputed(comm, mesh):
    good = compile_table(baselines.ring_allgather(N))
    rng = np.random.default_rng(3)
    tried = 0
    for word in rng.choice(np.arange(16, good.size), size=20, replace=False):
        bad = good.copy()
        bad[word] += 1
        with pytest.raises(ScheduleError, match=f"word {word} .*differ|differ, the first at word {word}"):
            comm.stage_validated("all_gather", baselines.ring_allgather(N), table=seal(bad))
        tried += 1
    assert tried == 20
    _refused(comm, mesh, seal(np.where(np.arange(good.size) == 20, good + 1, good).astype(np.int32)), "differ")


def test_the_right_table_is_accepted(comm, mesh):
    schedule = baselines.recursive_doubling_allgather(N).validate()
    assert comm.stage_validated("all_gather", schedule, table=compile_table(schedule)) > 0
    assert comm.schedule("all_gather") is schedule
    _check(_all_gather_step(comm, mesh), np.random.default_rng(4))


def test_native_stage_checks_a_table_against_the_schedule_it_names():
    slot = native.new_slot()
    try:
        ring = baselines.ring_allgather(N)
        with pytest.raises(ScheduleError, match="not the compilation"):
            native.stage(slot, compile_table(baselines.recursive_doubling_allgather(N)), schedule=ring)
        assert native.stage(slot, compile_table(ring), schedule=ring) == 1
    finally:
        native.remove(slot)


def test_record_staged_refuses_a_schedule_the_slot_does_not_hold(comm):
    other = baselines.recursive_doubling_allgather(N).validate()
    with pytest.raises(ScheduleError, match="registry slot holds"):
        comm.record_staged("all_gather", other)
    native.stage(comm.slot("all_gather"), other)
    comm.record_staged("all_gather", other)
    assert comm.schedule("all_gather") is other


# ------------------------------------------------------------------------------------------- closed
def test_every_method_of_a_closed_communicator_names_it(mesh):
    topo = jaxccl.topology.rail(hosts=2, gpus_per_host=4)
    from jaxccl.runtime.emulated import LinkEmulation

    comm = jaxccl.Communicator(mesh, "data", topology=topo, backend="cpu", link_emulation=LinkEmulation())
    comm.close()
    comm.close()  # idempotent
    calls = {
        "telemetry": lambda: comm.telemetry(),
        "inject": lambda: comm.inject(topo),
        "install": lambda: comm.install("all_gather", baselines.ring_allgather(N)),
        "stage_validated": lambda: comm.stage_validated("all_gather", baselines.ring_allgather(N)),
        "record_staged": lambda: comm.record_staged("all_gather", baselines.ring_allgather(N).validate()),
        "schedule": lambda: comm.schedule("all_gather"),
        "swap_state": lambda: comm.swap_state("all_gather"),
        "slot": lambda: comm.slot("all_gather"),
        "group_devices": lambda: comm.group_devices(),
        "with": lambda: comm.__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(CommunicatorClosedError, match=r"communicator Communicator\(.*\) is closed"):
            call()
        assert name


def test_a_program_of_a_closed_communicator_raises_a_named_error(mesh):
    comm = jaxccl.Communicator(mesh, "data", backend="cpu")
    step = _all_gather_step(comm, mesh)
    rng = np.random.default_rng(5)
    _check(step, rng)
    comm.close()
    x = rng.standard_normal(N * 64).astype(np.float32)
    with pytest.raises(CommunicatorClosedError, match=r"communicator Communicator\(.*\) is closed"), executor_errors():
        np.asarray(step(x))


def test_collectives_racing_close_either_finish_right_or_name_the_closed_communicator(mesh):
    # When close lands between ranks' arrivals, the ranks already waiting must learn it from the rank whose
    # call was refused (Rendezvous::Abandon), not wait out the deadline: a short one makes that a failure.
    # Eight rounds, each closing at a random moment: about half of them land between arrivals.
    timeout = native.get_timeout()
    native.set_timeout(5.0)
    try:
        for seed in range(8):
            _race_collectives_with_close(mesh, np.random.default_rng(seed))
    finally:
        native.set_timeout(timeout)


def _race_collectives_with_close(mesh: Mesh, rng: np.random.Generator) -> None:
    comm = jaxccl.Communicator(mesh, "data", backend="cpu")
    step = _all_gather_step(comm, mesh)
    _check(step, rng)
    outcomes: list[str] = []
    started = threading.Event()

    def run() -> None:
        local = np.random.default_rng(rng.integers(1 << 30))
        for _ in range(200):
            x = local.standard_normal(N * 64).astype(np.float32)
            try:
                with executor_errors():
                    y = np.asarray(step(x))
            except CommunicatorClosedError:
                outcomes.append("closed")
                continue
            except Exception as e:  # anything else is the bug this test is about
                outcomes.append(f"{type(e).__name__}: {e}")
                continue
            finally:
                started.set()
            outcomes.append("ok" if np.array_equal(y, np.tile(x, N)) else "WRONG")

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(60)
    time.sleep(rng.uniform(0.0, 0.02))
    comm.close()
    thread.join(120)
    assert not thread.is_alive()
    assert "closed" in outcomes, outcomes[-5:]
    assert set(outcomes) <= {"ok", "closed"}, [o for o in outcomes if o not in ("ok", "closed")][:3]
