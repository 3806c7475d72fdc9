"""The executor core through the CPU executor: dataflow order, tiles and the default schedules.

Every result is compared bitwise with jax.lax on random data.
"""

from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from test_native_executor import AXIS, assert_bitwise, ffi_collective, lax_ref, mesh_of, random, run, sharded

import jaxccl
from jaxccl.runtime import native
from jaxccl.runtime.default_schedules import direct_allgather, direct_allreduce
from jaxccl.runtime.emulated import EmulatedNetwork, LinkEmulation
from jaxccl.schedule import Buffer, ScheduleBuilder
from jaxccl.schedule.table import compile_table
from jaxccl.topology import rail, single_node

I, O = Buffer.INPUT, Buffer.OUTPUT


def overtaking_all_gather():
    """3-rank AllGather in which rank 0 relays rank 2's block to rank 1 before sending its own block.

    In program order rank 0's send of its own block (ready at once) waits behind the relay, which waits
    for rank 2's message; in dataflow order it goes first.
    """
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=1)
    for r in range(3):
        b.copy(r, (I, 0), (O, r))
    from_2 = b.transfer(2, 0, (I, 0), (O, 2))
    b.transfer(0, 1, (O, 2), (O, 2), after=[from_2])
    b.transfer(0, 1, (I, 0), (O, 0))
    b.transfer(0, 2, (I, 0), (O, 0))
    b.transfer(1, 0, (I, 0), (O, 1))
    b.transfer(1, 2, (I, 0), (O, 1))
    return b.build(name="overtaking")


def _run_on_network(schedule, x, network):
    n = schedule.num_ranks
    slot = native.new_slot()
    try:
        native.install(slot, compile_table(schedule))
        network.attach(slot)
        body = lambda v: ffi_collective(v, slot=slot, n=n, coll=schedule.collective.value)  # noqa: E731
        f = jax.jit(jax.shard_map(body, mesh=mesh_of(n), in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)))
        return np.asarray(f(sharded(mesh_of(n), x)))
    finally:
        native.remove(slot)


@pytest.mark.parametrize("program_order", [False, True])
def test_a_ready_send_overtakes_one_that_waits(program_order):
    s = overtaking_all_gather().validate()
    # GPU 2's links are slow: its message to rank 0 arrives long after rank 0 could send its own block.
    topo = single_node(3).degrade(2, "nvs:h0", gbps=1)
    net = EmulatedNetwork(topo, LinkEmulation(time_scale=1e-2, trace=True, measure=False))
    native.set_program_order(program_order)
    try:
        x = random((3 * 4096,), np.float32)
        got = _run_on_network(s, x, net)
        assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 3, x))
        trace = net.take_trace()
    finally:
        native.set_program_order(False)
        net.close()
    to_1 = trace[(trace["src"] == 0) & (trace["dst"] == 1)]
    posted = {int(r["src_op"]): int(r["post_ns"]) for r in to_1}
    assert set(posted) == {0, 1}
    if program_order:  # the comparison executor shows the head-of-line blocking the default avoids
        assert posted[0] < posted[1]
    else:
        assert posted[1] < posted[0], "rank 0's own block waited behind the relay (head-of-line blocking)"


def test_tiled_synthesized_all_gather_on_emulated_links():
    topo = rail(hosts=2, gpus_per_host=4)
    s = jaxccl.synth.all_gather(jaxccl.topology.scenario(topo, "fail2")).validate()
    net = EmulatedNetwork(topo, LinkEmulation(time_scale=1e-2, trace=True, measure=False))
    try:
        x = random((8 * (1 << 16),), np.float32)  # 256 KiB per rank: several tiles
        got = _run_on_network(s, x, net)
        messages = len(net.take_trace())
    finally:
        net.close()
    assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 8, x))
    sends = sum(op.kind.value in ("s", "rcs", "rrs", "rrcs") for rank in s.ranks for tb in rank for op in tb.ops)
    assert messages > sends and messages % sends == 0, "the relays did not run in tiles"


def test_the_simulator_models_the_executors_tiling_rule():
    """The simulator's tile cap and smallest tile are the values the executor core was built with."""
    from jaxccl.sim import model

    assert (model.MAX_TILES, model.MIN_TILE_BYTES) == (native.module().MAX_TILES, native.module().MIN_TILE_BYTES)


@pytest.mark.parametrize("cap", [None, 16])
def test_large_relayed_messages_run_in_more_than_32_tiles(cap):
    """A 4 MiB relayed message moves in 64 KiB tiles (64 of them), the count the simulator assumes; a
    comparison cap (``native.set_tile_cap``) cuts it into fewer, larger tiles."""
    from jaxccl.sim.model import tiles_of

    s = overtaking_all_gather().validate()
    net = EmulatedNetwork(single_node(3), LinkEmulation(time_scale=1e-2, trace=True, measure=False))
    native.set_tile_cap(cap)
    try:
        x = random((3 * (1 << 20),), np.float32, seed=5)  # one chunk of 4 MiB per rank and message
        got = _run_on_network(s, x, net)
        trace = net.take_trace()
    finally:
        native.set_tile_cap(None)
        net.close()
    assert_bitwise(got, lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 3, x))
    tiles = tiles_of(4 << 20) if cap is None else tiles_of(4 << 20, max_tiles=cap)
    assert tiles == (64 if cap is None else cap)
    sends = sum(op.kind.value == "s" for rank in s.ranks for tb in rank for op in tb.ops)
    assert len(trace) == sends * tiles
    assert set(trace["bytes"].tolist()) == {(4 << 20) // tiles}


def test_tile_cap_out_of_range_is_refused():
    for bad in (0, native.module().MAX_TILES + 1):
        with pytest.raises(ValueError, match="tile cap"):
            native.set_tile_cap(bad)
    native.set_tile_cap(None)
    assert native.module().tile_cap() == native.module().MAX_TILES


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_direct_allgather(n):
    x = random((n * 1031,), np.float32, seed=n)
    assert_bitwise(run(direct_allgather(n), x), lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_direct_allreduce_is_bitwise_psum(n, dtype):
    s = direct_allreduce(n)
    s.validate(ordered_reduction=True)
    x = random((n * n * 257,), dtype, seed=n)
    assert_bitwise(run(s, x), lax_ref(lambda v: lax.psum(v, AXIS), n, x))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_direct_allreduce_16_bit_sums_round_every_step(dtype):
    """jax.lax sums 16-bit floats in f32 (jaxccl's front end promotes too); the table sums in the dtype,
    rounding each step to nearest even, in rank order."""
    n = 5
    x = random((n * n * 129,), dtype, seed=3)
    blocks = x.reshape(n, -1)
    want = blocks[0]
    for k in range(1, n):
        want = (want.astype(np.float32) + blocks[k].astype(np.float32)).astype(dtype)
    assert_bitwise(run(direct_allreduce(n), x), np.tile(want, n))


@pytest.mark.parametrize("collective", ["psum", "psum_scatter"])
def test_sums_of_negative_zeros_are_positive_zero_like_lax(collective):
    n = 8
    x = random((n * n * 64,), np.float32, seed=11)
    x.reshape(n, -1)[:, ::3] = -0.0  # every rank contributes -0 at these positions
    lib_body = {
        "psum": lambda lib: lambda v: lib.psum(v, AXIS),
        "psum_scatter": lambda lib: lambda v: lib.psum_scatter(v, AXIS, scatter_dimension=0, tiled=True),
    }[collective]
    got = lax_ref(lib_body(jaxccl), n, x)
    assert_bitwise(got, lax_ref(lib_body(lax), n, x))


def test_imported_msccl_xml_runs_in_dataflow_order():
    """MSCCL XML schedules (the hand-written file and a synthesized tree packing's export) run unchanged."""
    import pathlib

    from jaxccl.schedule import from_msccl_xml

    text = ((pathlib.Path(__file__).parents[1] / "data") / "ring_allgather_8.xml").read_text()
    synthesized = jaxccl.synth.all_gather(jaxccl.topology.scenario(rail(hosts=2, gpus_per_host=4), "fail2"))
    x = random((8 * 4099,), np.float32, seed=4)
    want = lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), 8, x)
    for s in (from_msccl_xml(text), from_msccl_xml(synthesized.to_msccl_xml())):
        assert_bitwise(run(s, x), want)


def _thp_mode() -> str | None:
    """The system's transparent huge page mode ("always", "madvise", "never"), or None where unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


def _thp_eligible(address: int) -> bool:
    """Whether the kernel may back the mapping that holds `address` with huge pages (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs transparent huge pages in 'madvise' mode")
@pytest.mark.parametrize("on", [True, False])
def test_large_outputs_are_advised_into_huge_pages(on):
    n = 8
    per_rank = native.module().HUGE_PAGES_MIN_BYTES // 4 // n  # float32: every output is exactly the minimum
    x = random((n * per_rank,), np.float32, seed=3)
    mesh = mesh_of(n)
    comm = jaxccl.Communicator(mesh, AXIS, backend="cpu")
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxccl.all_gather(v, AXIS, tiled=True), mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS)
        )
    )
    native.set_huge_pages(on)
    try:
        with comm:
            out = f(sharded(mesh, x))
        huge = 2 << 20  # the advice covers the whole huge pages inside each buffer
        firsts = [-(-s.data.unsafe_buffer_pointer() // huge) * huge for s in out.addressable_shards]
        eligible = [_thp_eligible(a) for a in firsts]
        assert_bitwise(np.asarray(out), lax_ref(lambda v: lax.all_gather(v, AXIS, tiled=True), n, x))
    finally:
        native.set_huge_pages(True)
        comm.close()
    # In a VM whose host takes back free 2 MiB blocks nothing is advised (docs/executor.md).
    assert eligible == [on and native.huge_pages_usable()] * n


def _linux_at_least(major: int, minor: int) -> bool:
    import platform

    if platform.system() != "Linux":
        return False
    parts = platform.release().split(".")
    return (int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)) >= (major, minor)


@pytest.mark.skipif(not _linux_at_least(5, 14), reason="needs Linux 5.14 or later (MADV_POPULATE_WRITE)")
def test_fresh_large_outputs_are_faulted_in_before_the_launch():
    m = native.module()
    big, small = m.PREFAULT_MIN_BYTES, m.PREFAULT_MIN_BYTES // 2
    try:
        assert m._resident_after_prepare(big) == 1.0
        assert m._resident_after_prepare(small) == 0.0  # below the minimum: left to the page faults
        native.set_prefault(False)
        native.set_huge_pages(False)
        assert m._resident_after_prepare(big) == 0.0
    finally:
        native.set_prefault(True)
        native.set_huge_pages(True)
