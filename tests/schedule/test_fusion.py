"""fuse_all_reduce: a ReduceScatter and an AllGather as one AllReduce, bitwise the two run one after the other."""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxccl
from jaxccl.errors import ScheduleError, UnsupportedTypeError
from jaxccl.runtime.default_schedules import direct_allgather, direct_allreduce, gloo_tree_reduce_scatter
from jaxccl.schedule import Buffer, OpKind, ScheduleBuilder
from jaxccl.schedule.fusion import FUSED_ALGORITHM, fuse_all_reduce, input_padding
from jaxccl.schedule.interpreter import evaluate
from jaxccl.schedule.table import compile_table, header
from jaxccl.synth import baselines, nccl
from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter
from jaxccl.topology import fat_tree, rail, ring, single_node

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH
TOPOLOGIES = {
    "rail2x4": rail(hosts=2, gpus_per_host=4),
    "rail2x4_slow_nic": rail(hosts=2, gpus_per_host=4).degrade(0, "tor:s0r0", gbps=200),
    "rail4x2": rail(hosts=4, gpus_per_host=2),
    "rail3x2": rail(hosts=3, gpus_per_host=2),
    "single4": single_node(4),
    "ring5": ring(5),
    "fat_tree2x3": fat_tree(leaves=2, gpus_per_leaf=3, spines=2),
}


@functools.cache
def _halves(topo_name: str) -> tuple[dict, dict]:
    """Every ReduceScatter and AllGather producer of the project for one topology."""
    topo = TOPOLOGIES[topo_name]
    n = topo.num_gpus
    rs = {
        "direct": baselines.direct_reduce_scatter(n),
        "ring": baselines.ring_reduce_scatter(n),
        "ring2_bidirectional": baselines.ring_reduce_scatter(n, channels=2, bidirectional=True),
        "gloo_tree": gloo_tree_reduce_scatter(n),
        "ordered": ordered_reduce_scatter(topo),
        "tree_packing": jaxccl.synth.reduce_scatter(topo),
        "nccl": nccl.nccl_reduce_scatter(topo),
    }
    ag = {
        "direct": direct_allgather(n),
        "ring": baselines.ring_allgather(n),
        "tree_packing": jaxccl.synth.all_gather(topo),
        "nccl": nccl.nccl_allgather(topo),
    }
    return rs, ag


def _inputs(n: int, elems: int, dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return [rng.integers(-(2**30), 2**30, elems, dtype=np.int32) for _ in range(n)]
    # float32 (bfloat16 sums run in float32, rounded once: jaxccl.schedule.reduction.wire_dtype)
    return [(rng.standard_normal(elems) * np.exp(rng.uniform(-8, 8, elems))).astype(np.float32) for _ in range(n)]


def _bits(x: np.ndarray) -> bytes:
    return np.asarray(x).tobytes()


RS_NAMES = ("direct", "ring", "ring2_bidirectional", "gloo_tree", "ordered", "tree_packing", "nccl")
AG_NAMES = ("direct", "ring", "tree_packing", "nccl")
# Every pair on the degraded rail (chunk counts 1, 2, 4 and 7: the fused layouts refine both halves), each
# ReduceScatter with one AllGather on the other topologies.
CASES = [("rail2x4_slow_nic", rs, ag) for rs, ag in itertools.product(RS_NAMES, AG_NAMES)] + [
    (topo, rs, AG_NAMES[i % len(AG_NAMES)])
    for topo in TOPOLOGIES
    if topo != "rail2x4_slow_nic"
    for i, rs in enumerate(RS_NAMES)
]


@pytest.mark.parametrize(("topo", "rs_name", "ag_name"), CASES, ids=["-".join(c) for c in CASES])
def test_fused_schedule_is_the_two_halves_bit_for_bit(topo, rs_name, ag_name):
    """Valid (the interpreter proves it, ordered where the ReduceScatter is), compiles, and sums as the halves."""
    rs, ag = (h[name] for h, name in zip(_halves(topo), (rs_name, ag_name)))
    fused = fuse_all_reduce(rs, ag)
    n = rs.num_ranks
    assert fused.validated and fused.collective.value == "all_reduce" and fused.num_ranks == n
    assert fused.info["algorithm"] == FUSED_ALGORITHM
    assert fused.info["ordered_reduction"] == bool(rs.info.get("ordered_reduction"))
    assert fused.chunks_per_period % (n * rs.chunks_per_period) == 0
    assert fused.chunks_per_period % (n * ag.chunks_per_period) == 0
    if fused.info["ordered_reduction"]:
        fused.validate(ordered_reduction=True)
    else:
        with pytest.raises(ScheduleError, match="ascending rank order"):
            fused.validate(ordered_reduction=True)
    table = compile_table(fused)
    assert header(table)["collective"] == 3 and header(table)["num_ranks"] == n
    # each rank runs the ReduceScatter's threadblocks as they are, then the AllGather's on channels of their own
    offset = fused.info["channel_offset"]
    assert offset > max(tb.channel for tbs in rs.ranks for tb in tbs)
    for r in range(n):
        k = len(rs.ranks[r])
        assert [(tb.send_peer, tb.recv_peer, tb.channel) for tb in fused.ranks[r][:k]] == [
            (tb.send_peer, tb.recv_peer, tb.channel) for tb in rs.ranks[r]
        ]
        assert all(tb.channel >= offset for tb in fused.ranks[r][k:])
    # 13 elements per shard: no chunk count of the pool divides it
    for dtype, seed in ((np.float32, 1), (np.int32, 2)):
        xs = _inputs(n, n * 13, dtype, seed)
        two = evaluate(ag, evaluate(rs, xs))
        one = evaluate(fused, xs)
        assert all(_bits(a) == _bits(b) for a, b in zip(one, two))


def test_ordered_fusion_is_bitwise_a_rank_ordered_fold_and_the_halves_order_shows():
    """Where the ReduceScatter sums in ring order the fused result differs from the ordered fold, as the halves do."""
    rs, ag = _halves("rail2x4_slow_nic")
    xs = _inputs(8, 8 * 64, np.float32, 3)
    ordered = evaluate(fuse_all_reduce(rs["ordered"], ag["tree_packing"]), xs)
    reference = evaluate(direct_allreduce(8), xs)  # jax.lax's order (tests/schedule/test_reductions.py)
    assert all(_bits(a) == _bits(b) for a, b in zip(ordered, reference))
    ring = evaluate(fuse_all_reduce(rs["ring"], ag["tree_packing"]), xs)
    assert any(_bits(a) != _bits(b) for a, b in zip(ring, reference))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_dtypes_and_sizes_that_no_chunk_count_divides(dtype):
    """C = 8 * lcm(4, 7) = 224 chunks; sizes down to fewer elements than chunks (empty chunks)."""
    rs, ag = _halves("rail2x4_slow_nic")
    fused = fuse_all_reduce(rs["ordered"], ag["tree_packing"])
    assert (rs["ordered"].chunks_per_period, ag["tree_packing"].chunks_per_period) == (4, 7)
    assert fused.chunks_per_period == 224
    for elems in (8, 8 * 5, 8 * 127):
        rng = np.random.default_rng(elems)
        xs = [(rng.standard_normal(elems) * 100).astype(dtype) for _ in range(8)]
        wire = [x.astype(np.float32) if dtype == jnp.bfloat16 else x for x in xs]
        one = evaluate(fused, wire)
        two = evaluate(ag["tree_packing"], evaluate(rs["ordered"], wire))
        want = evaluate(direct_allreduce(8), wire)
        assert all(_bits(a) == _bits(b) == _bits(c) for a, b, c in zip(one, two, want))


def test_shards_leave_when_they_are_reduced_without_a_barrier():
    """Each AllGather send waits only for the fold of its own shard (the last op writing it), nothing else."""
    rs = baselines.direct_reduce_scatter(4)
    fused = fuse_all_reduce(rs, direct_allgather(4))
    for r, tbs in enumerate(fused.ranks):
        ag_sends = [op for tb in tbs if tb.channel == fused.info["channel_offset"] for op in tb.ops if op.kind.sends]
        assert len(ag_sends) == 3
        for op in ag_sends:
            assert op.src is O and op.src_off == r and len(op.deps) == 1
            t, i = op.deps[0]
            fold_end = tbs[t].ops[i]
            assert fold_end.kind.writes_dst and fold_end.dst is O and fold_end.dst_off == r
            assert tbs[t].channel == 0  # a ReduceScatter op
    # the AllGather's copy of a rank's own block into its output is gone: the fold left it there
    copies = [sum(op.kind is OpKind.COPY for tbs in s.ranks for tb in tbs for op in tb.ops) for s in (fused, rs)]
    assert copies[0] == copies[1] == 1  # rank 0's fold starts with a copy of its own term


def test_rate_is_the_two_phases_one_after_the_other():
    topo = TOPOLOGIES["rail2x4"]
    rs, ag = ordered_reduce_scatter(topo), jaxccl.synth.all_gather(topo)
    fused = fuse_all_reduce(rs, ag)
    assert fused.algbw == pytest.approx(1 / (1 / rs.algbw + 1 / ag.algbw))
    assert fused.info["reduce_scatter"] == {"name": rs.name, "digest": rs.digest, "algbw": rs.algbw}
    assert fused.info["all_gather"]["digest"] == ag.digest
    assert fuse_all_reduce(baselines.direct_reduce_scatter(8), ag).algbw is None  # a half without a rate
    assert fuse_all_reduce(gloo_tree_reduce_scatter(4), direct_allgather(4)).info["fold"] == "gloo_tree"


def _relay_reduce_scatter() -> jaxccl.schedule.Schedule:
    """3 ranks, rank-ordered folds; rank 0's term of shard 2 travels through rank 1's output chunk first.

    Rank 1's output holds another shard's data on the way (the fusion moves it to scratch), and rank 1's
    own fold may overwrite it only after the relay read it.
    """
    b = ScheduleBuilder("reduce_scatter", num_ranks=3, chunks_per_period=1, scratch_chunks=1)
    relayed = b.transfer(0, 1, (I, 2), (O, 0))
    forward_tb = b.threadblock(1, send_peer=2, channel=1)
    forwarded = b.op(1, forward_tb, OpKind.SEND, (O, 0), (S, 0), after=[relayed])
    got = b.op(2, b.threadblock(2, recv_peer=1, channel=1), OpKind.RECV, (O, 0), (S, 0))
    for owner in range(3):
        last = None
        for s in range(3):
            if s == owner:
                last = (
                    b.copy(owner, (I, owner), (O, 0))
                    if last is None
                    else b.reduce(owner, (I, owner), (O, 0), after=[last])
                )
            elif (s, owner) == (0, 2):
                last = b.copy(2, (S, 0), (O, 0), after=[got])
            else:
                after = [h for h in (last, forwarded if owner == 1 else None) if h is not None]
                last = b.transfer(s, owner, (I, owner), (O, 0), reduce=last is not None, recv_after=after)
    return b.build(name="relay", info={"ordered_reduction": True})


def _relay_all_gather() -> jaxccl.schedule.Schedule:
    """3 ranks; rank 0's block reaches rank 2 through rank 1's scratch."""
    b = ScheduleBuilder("all_gather", num_ranks=3, chunks_per_period=1, scratch_chunks=1)
    for r in range(3):
        b.copy(r, (I, 0), (O, r))
    for s, d in ((0, 1), (1, 0), (1, 2), (2, 0), (2, 1)):
        b.transfer(s, d, (I, 0), (O, s))
    kept = b.transfer(0, 1, (I, 0), (S, 0), channel=1)
    b.transfer(1, 2, (S, 0), (O, 0), channel=1, after=[kept])
    return b.build(name="relay_ag")


def test_data_on_the_way_through_outputs_and_scratch():
    rs, ag = _relay_reduce_scatter().validate(), _relay_all_gather().validate()
    fused = fuse_all_reduce(rs, ag)
    fused.validate(ordered_reduction=True)
    # rank 1 holds the RS's relayed block 2 and the AG's block 0 on the way: one period of C = 3 holds both
    assert fused.scratch_chunks == 3
    xs = _inputs(3, 3 * 11, np.float32, 5)
    one, two = evaluate(fused, xs), evaluate(ag, evaluate(rs, xs))
    assert all(_bits(a) == _bits(b) == _bits(c) for a, b, c in zip(one, two, evaluate(direct_allreduce(3), xs)))


def test_one_rank():
    fused = fuse_all_reduce(baselines.direct_reduce_scatter(1), direct_allgather(1))
    assert fused.num_ops == 1 and evaluate(fused, [np.arange(5.0, dtype=np.float32)])[0].tolist() == [0, 1, 2, 3, 4]


def test_input_padding():
    fused = fuse_all_reduce(baselines.ring_reduce_scatter(8), baselines.ring_allgather(8))
    assert [input_padding(fused, e) for e in (1, 8, 63, 64)] == [7, 0, 1, 0]
    assert input_padding(direct_allreduce(8), 63) == 0


def test_bad_inputs_are_named_errors():
    rs4, ag4 = baselines.direct_reduce_scatter(4), direct_allgather(4)
    with pytest.raises(ScheduleError, match="N=4 ranks but the all_gather schedule for N=8"):
        fuse_all_reduce(rs4, direct_allgather(8))
    with pytest.raises(ScheduleError, match="reduce_scatter schedule .* implements all_gather, not reduce_scatter"):
        fuse_all_reduce(ag4, ag4)
    with pytest.raises(ScheduleError, match="all_gather schedule .* implements all_reduce, not all_gather"):
        fuse_all_reduce(rs4, direct_allreduce(4))
    with pytest.raises(UnsupportedTypeError, match="must be a Schedule, got str"):
        fuse_all_reduce(rs4, "ring")
    broken = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
    broken.copy(0, (I, 0), (O, 0))
    broken.transfer(0, 1, (I, 0), (O, 0))  # rank 1 never gets its own block, rank 0 never rank 1's
    with pytest.raises(ScheduleError, match="output chunk"):
        fuse_all_reduce(baselines.direct_reduce_scatter(2), broken.build())


def test_an_op_moving_several_shards_at_once_is_refused():
    """Rank 1 sends input chunks 0 and 3 in one message (through scratch): blocks 0 and 3 are not adjacent."""
    b = ScheduleBuilder("reduce_scatter", num_ranks=2, chunks_per_period=2, scratch_chunks=2)
    b.copy(1, (I, 0), (S, 0))
    staged = b.copy(1, (I, 3), (S, 1))
    got = b.transfer(1, 0, (S, 0), (S, 0), count=2, after=[staged])
    for owner, peer in ((0, 1), (1, 0)):
        for c in range(2):
            j = owner * 2 + c
            first = b.copy(owner, (I, j), (O, c))
            if owner == 0 and c == 0:
                b.reduce(0, (S, 0), (O, 0), after=[first, got])
            else:
                b.transfer(peer, owner, (I, j), (O, c), channel=1, reduce=True, recv_after=[first])
    rs = b.build(name="two_shards_per_message").validate()
    with pytest.raises(ScheduleError, match=r"non-consecutive blocks \[0, 3\]"):
        fuse_all_reduce(rs, direct_allgather(2))
