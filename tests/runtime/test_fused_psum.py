"""psum on a communicator with a topology: its ReduceScatter and AllGather fused into one launch.

Bitwise equal to the two launches (``fuse_all_reduce=False``) and to ``jax.lax`` where the ReduceScatter
sums in rank order; one launch of the all_reduce slot per psum; installing either half re-fuses without
recompiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.errors import ScheduleError
from jaxccl.runtime import native
from jaxccl.runtime.rounds import plan
from jaxccl.schedule import period_elements
from jaxccl.schedule.fusion import fuse_all_reduce
from jaxccl.schedule.ir import Collective
from jaxccl.synth import baselines
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter
from jaxccl.topology import rail, single_node

RAIL = rail(hosts=2, gpus_per_host=4)
SLOW_NIC = RAIL.degrade(0, "tor:s0r0", gbps=200)  # synthesized halves of 4 and 7 chunks per period
PER_RANK = (21, 3)  # 63 elements per rank: not a multiple of 8 (psum pads to the shards) nor of any chunk count


def _mesh(n: int = 8) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("d",))


def _data(n: int, dtype, seed: int, shape=PER_RANK) -> np.ndarray:
    rng = np.random.default_rng(seed)
    size = (n * shape[0], *shape[1:])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(2**28), 2**28, size=size).astype(dtype)
    return (rng.standard_normal(size) * np.exp(rng.uniform(-6, 6, size))).astype(dtype)


TRACES = {"jaxccl": 0}


@functools.cache
def _psum(lib_name: str, n: int = 8):
    lib = jaxccl if lib_name == "jaxccl" else jax.lax

    def body(v):
        TRACES[lib_name] = TRACES.get(lib_name, 0) + 1  # counts traces (each is a compilation)
        return lib.psum(v, "d")

    return jax.jit(jax.shard_map(body, mesh=_mesh(n), in_specs=P("d"), out_specs=P()))


def _run(comm, x):
    """The psum of ``x`` on ``comm`` (an array or a dict of them): bytes, or per leaf ``{name: bytes}``."""
    with comm:
        return _bytes(_psum("jaxccl", comm.axis_size)(x))


def _lax(x, n: int = 8):
    return _bytes(_psum("lax", n)(x))


def _bytes(y):
    return {k: np.asarray(v).tobytes() for k, v in y.items()} if isinstance(y, dict) else np.asarray(y).tobytes()


def _launches(comm) -> dict[str, int]:
    return {c.value: native.launch_count(s) for c, s in comm._slots.items()}  # noqa: SLF001 - every slot it made


def _pair(topo, backend: str, halves=None):
    """A communicator fusing psum and one running it as two launches, with the same halves."""
    fused = jaxccl.Communicator(_mesh(topo.num_gpus), "d", topology=topo, backend=backend)
    two = jaxccl.Communicator(_mesh(topo.num_gpus), "d", topology=topo, backend=backend, fuse_all_reduce=False)
    for coll, schedule in (halves or {}).items():
        fused.install(coll, schedule)
        two.install(coll, schedule)
    return fused, two


@pytest.mark.parametrize(
    ("topo", "synthesized", "backend"),
    [
        (RAIL, False, "cpu"),
        (RAIL, False, "ppermute"),
        (SLOW_NIC, True, "cpu"),  # C = 8 * lcm(4, 7): on ppermute a minute of compiling (the swaps refine there)
        (single_node(4), True, "cpu"),
        (single_node(4), True, "ppermute"),
    ],
    ids=[
        "rail2x4-defaults-cpu",
        "rail2x4-defaults-ppermute",
        "slow-nic-synthesized-cpu",
        "single4-cpu",
        "single4-ppermute",
    ],
)
def test_fused_psum_is_bitwise_the_two_launches_and_jax_lax(topo, synthesized, backend):
    """Rank-ordered ReduceScatters (the defaults, the closed loop's): bitwise jax.lax, in float32, bfloat16, int32."""
    halves = None
    if synthesized:
        halves = {"reduce_scatter": ordered_reduce_scatter(topo), "all_gather": jaxccl.synth.all_gather(topo)}
    fused, two = _pair(topo, backend, halves)
    schedule = fused.launched_schedule("psum")
    assert two.launched_schedule("psum") is None and fused.schedule("psum") is None
    assert (
        schedule.info["ordered_reduction"]
        and schedule.digest == fuse_all_reduce(fused.schedule("reduce_scatter"), fused.schedule("all_gather")).digest
    )
    n = topo.num_gpus
    xs = {str(np.dtype(d)): _data(n, d, seed=7) for d in (np.float32, jnp.bfloat16, np.int32)}  # one program
    assert _run(fused, xs) == _run(two, xs) == _lax(xs, n)


def test_psum_is_one_launch_of_the_all_reduce_slot():
    fused, two = _pair(RAIL, "cpu")
    x = _data(8, np.float32, seed=1)
    before = _launches(fused), _launches(two)
    for _ in range(3):
        _run(fused, x)
        _run(two, x)
    grew = [
        {c: k - b.get(c, 0) for c, k in _launches(comm).items() if k != b.get(c, 0)}
        for comm, b in zip((fused, two), before)
    ]
    assert grew == [{"all_reduce": 3}, {"reduce_scatter": 3, "all_gather": 3}]


def test_ppermute_psum_is_the_fused_plan():
    """On ppermute the program holds the fused schedule's permutes (plus the two identity barriers), not the halves'."""
    halves = {"reduce_scatter": ordered_reduce_scatter(SLOW_NIC), "all_gather": jaxccl.synth.all_gather(SLOW_NIC)}
    fused, two = _pair(SLOW_NIC, "ppermute", halves)
    x = _data(8, np.float32, seed=2, shape=(8 * 28 * 5,))

    def permutes(comm):
        f = jax.jit(jax.shard_map(lambda v: jaxccl.psum(v, "d"), mesh=_mesh(), in_specs=P("d"), out_specs=P()))
        with comm:
            text = f.lower(x).as_text()
        return text.count("collective_permute")

    def colours(schedule, elems):
        p = plan(schedule, period_elements(schedule.collective, 8, elems))
        return sum(len(e.perms) for rnd in p.rounds for e in rnd.exchanges)

    one = fused.launched_schedule("psum")
    rs, ag = two.schedule("reduce_scatter"), two.schedule("all_gather")
    e = 8 * 28 * 5  # per rank: the fused layout's messages are 5 elements, the halves' 10 to 280
    assert colours(one, e) != colours(rs, e) + colours(ag, e // 8)
    assert permutes(fused) == colours(one, e) + 2  # between the two identity barriers
    assert permutes(two) == colours(rs, e) + colours(ag, e // 8) + 2


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_swapping_a_half_refuses_psum_without_recompiling(backend):
    """Installing a ReduceScatter or AllGather changes the fused psum at the next call, bitwise the two launches."""
    fused, two = _pair(RAIL, backend)
    x = _data(8, np.float32, seed=3)
    assert _run(fused, x) == _run(two, x) == _lax(x)
    traces = TRACES["jaxccl"]
    version = fused.swap_state("psum")["current_version"] if backend == "cpu" else None
    steps = [
        ("reduce_scatter", baselines.ring_reduce_scatter(8)),  # ring order: other bits than jax.lax
        ("all_gather", jaxccl.synth.all_gather(RAIL)),
        ("reduce_scatter", ordered_reduce_scatter(RAIL)),  # rank order again
        ("all_gather", baselines.ring_allgather(8, channels=2)),
    ]
    if backend == "ppermute":  # every install retraces and recompiles there (8 s each): one swap of each half
        steps = steps[:2]
    for coll, schedule in steps:
        fused.install(coll, schedule)
        two.install(coll, schedule)
        launched = fused.launched_schedule("psum")
        assert launched.info["reduce_scatter"]["digest"] == fused.schedule("reduce_scatter").digest
        assert launched.info["all_gather"]["digest"] == fused.schedule("all_gather").digest
        got = _run(fused, x)
        assert got == _run(two, x)
        assert (got == _lax(x)) == launched.info["ordered_reduction"]
        if backend == "cpu":
            state = fused.swap_state("psum")
            assert (
                state["current_version"] > version
                and native.last_launch_version(fused.slot("psum")) == (state["current_version"])
            )
            version = state["current_version"]
    # the native backend swaps tables under the compiled program; ppermute retraces (the schedule is in it)
    assert TRACES["jaxccl"] - traces == (0 if backend == "cpu" else 2 * len(steps))


def test_controller_path_and_record_staged_refuse_too():
    """stage_validated with a precompiled table (the closed loop) and record_staged (tables staged by hand)."""
    from jaxccl.schedule.table import compiled_table

    fused, _ = _pair(RAIL, "cpu")
    x = _data(8, np.int32, seed=4)
    _run(fused, x)
    ring = baselines.ring_reduce_scatter(8).validate()
    fused.stage_validated("reduce_scatter", ring, table=compiled_table(ring, num_slots=8))
    assert fused.launched_schedule("psum").info["reduce_scatter"]["digest"] == ring.digest
    assert _run(fused, x) == _lax(x)  # int32: exact in any order
    tree = jaxccl.synth.all_gather(RAIL).validate()
    native.stage(fused.slot("all_gather"), compiled_table(tree, num_slots=8))
    fused.record_staged("all_gather", tree)
    assert fused.launched_schedule("psum").info["all_gather"]["digest"] == tree.digest
    assert _run(fused, x) == _lax(x)
    assert native.last_launch_version(fused.slot("psum")) == fused.swap_state("psum")["current_version"]


def test_an_installed_all_reduce_replaces_the_fusion_in_compiled_programs():
    fused, _ = _pair(RAIL, "cpu")
    x = _data(8, np.float32, seed=5)
    assert _run(fused, x) == _lax(x)
    traces = TRACES["jaxccl"]
    ring = baselines.ring_allreduce(8)
    fused.install("all_reduce", ring)
    assert fused.launched_schedule("psum") is fused.schedule("psum") is ring
    got = _run(fused, x)
    assert got != _lax(x)  # the ring's order
    fused.install("reduce_scatter", baselines.ring_reduce_scatter(8))  # psum keeps the installed all_reduce
    assert fused.launched_schedule("psum") is ring and _run(fused, x) == got
    assert TRACES["jaxccl"] == traces


def test_a_half_that_fails_the_interpreter_changes_nothing():
    fused, _ = _pair(RAIL, "cpu")
    before = fused.launched_schedule("psum"), fused.swap_state("reduce_scatter"), fused.swap_state("psum")
    wrong = baselines.ring_reduce_scatter(4)
    with pytest.raises(ScheduleError, match="N=4 ranks"):
        fused.install("reduce_scatter", wrong)
    broken = baselines.direct_reduce_scatter(8).replace(ranks=baselines.ring_reduce_scatter(8).ranks[:1] * 8)
    with pytest.raises(ScheduleError):
        fused.stage_validated("reduce_scatter", broken, interpreter=False)  # psum's fusion follows its data
    after = fused.launched_schedule("psum"), fused.swap_state("reduce_scatter"), fused.swap_state("psum")
    assert after == before


def test_the_halves_are_fused_only_once_a_program_traces_psum():
    # A communicator whose programs never sum (the closed loop's AllGather job) pays no fusion: neither at
    # construction nor when a half is swapped; the first psum fuses the halves installed then.
    comm = jaxccl.Communicator(_mesh(), "d", topology=SLOW_NIC, backend="cpu")
    ag = jaxccl.synth.all_gather(SLOW_NIC)
    comm.install("all_gather", ag)
    assert Collective.ALL_REDUCE not in comm._slots  # noqa: SLF001 - no fused table was made nor staged
    x = _data(8, np.float32, 11)
    assert _run(comm, x) == _run(_pair(SLOW_NIC, "cpu", {"all_gather": ag})[1], x)
    assert _launches(comm)["all_reduce"] == 1
    assert comm.launched_schedule("psum").digest == fuse_all_reduce(comm.schedule("reduce_scatter"), ag).digest
    comm.install("all_gather", baselines.ring_allgather(8))  # from now on a half's install re-fuses
    ring = fuse_all_reduce(comm.schedule("reduce_scatter"), comm.schedule("all_gather"))
    assert comm.launched_schedule("psum").digest == ring.digest
    assert _run(comm, x) == _lax(x)
    comm.close()


def test_a_deferred_fusion_keeps_psum_on_the_earlier_pair_until_fuse_psum():
    # The controller stages a half with defer_psum (its swap is not delayed by the fusion), then fuse_psum.
    comm = jaxccl.Communicator(_mesh(), "d", topology=SLOW_NIC, backend="cpu")
    x = _data(8, np.float32, 12)
    assert _run(comm, x) == _lax(x)  # psum traced: the halves follow from now on
    before = comm.launched_schedule("psum")
    ag = jaxccl.synth.all_gather(SLOW_NIC).validate()
    comm.stage_validated("all_gather", ag, defer_psum=True)
    assert comm.schedule("all_gather") is ag and comm.launched_schedule("psum") is before
    assert _run(comm, x) == _lax(x)
    assert comm.fuse_psum() is True and comm.fuse_psum() is False
    assert comm.launched_schedule("psum").digest == fuse_all_reduce(comm.schedule("reduce_scatter"), ag).digest
    assert _run(comm, x) == _lax(x)
    plain = jaxccl.Communicator(_mesh(), "d", backend="cpu")  # no topology: nothing to fuse
    assert plain.fuse_psum() is False
    comm.close()
    plain.close()
