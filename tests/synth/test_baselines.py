"""Baseline schedules: every one passes the reference interpreter."""

from __future__ import annotations

import pytest

from jaxccl.errors import ScheduleError
from jaxccl.schedule import Collective, Schedule
from jaxccl.schedule.interpreter import check
from jaxccl.synth import (
    binary_tree_allreduce,
    direct_alltoall,
    direct_reduce_scatter,
    double_binary_tree_allreduce,
    ordered_allreduce,
    rail_ring_order,
    recursive_doubling_allgather,
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
)
from jaxccl.topology import rail, ring, single_node

SIZES = [1, 2, 3, 4, 5, 8, 16]
RINGS = [ring_allgather, ring_reduce_scatter, ring_allreduce]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("channels", [1, 2, 3])
@pytest.mark.parametrize("fn", RINGS, ids=lambda f: f.__name__)
def test_rings_validate(fn, n, channels):
    s = fn(n, channels=channels)
    assert isinstance(s, Schedule) and s.num_ranks == n
    rep = check(s)
    assert rep.num_ops == s.num_ops
    # One ring threadblock per channel and rank.
    assert s.num_threadblocks == (n * channels if n > 1 else 1)
    assert s.info["channels"] == channels


@pytest.mark.parametrize("n", [2, 5, 8])
@pytest.mark.parametrize("fn", RINGS, ids=lambda f: f.__name__)
def test_rings_bidirectional_and_custom_order(fn, n):
    order = [(3 * i + 1) % n for i in range(n)] if n != 3 else [2, 0, 1]
    if sorted(order) != list(range(n)):
        order = list(reversed(range(n)))
    s = fn(n, channels=2, order=order, bidirectional=True)
    s.validate()
    assert s.info["order"] == order
    peers = {tb.send_peer for tb in s.ranks[order[0]]}
    assert peers == {order[1], order[-1]}  # channel 0 forward, channel 1 backward


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_recursive_doubling_validates(n):
    s = recursive_doubling_allgather(n).validate()
    assert s.collective is Collective.ALL_GATHER
    if n > 1:
        # log2(N) partners per rank.
        assert len(s.ranks[0]) == n.bit_length() - 1


@pytest.mark.parametrize("n", [3, 5, 6, 12])
def test_recursive_doubling_rejects_non_power_of_two(n):
    with pytest.raises(ScheduleError, match=f"N={n}"):
        recursive_doubling_allgather(n)


@pytest.mark.parametrize("n", [*SIZES, 64])
def test_direct_alltoall_validates(n):
    s = direct_alltoall(n).validate()
    assert s.collective is Collective.ALL_TO_ALL
    assert s.num_ops == n * (2 * (n - 1) + 1)


@pytest.mark.parametrize("n", [*SIZES, 64])
def test_direct_reduce_scatter_is_ordered(n):
    s = direct_reduce_scatter(n)
    assert s.info["ordered_reduction"] is True
    rep = check(s, ordered_reduction=True)
    assert rep.ordered_reduction


@pytest.mark.parametrize("channels", [1, 2, 3])
@pytest.mark.parametrize("fn", RINGS, ids=lambda f: f.__name__)
def test_rings_64(fn, channels):
    rep = check(fn(64, channels=channels))
    assert rep.max_in_flight <= 2


def test_rail_ring_64():
    topo = rail(hosts=8, gpus_per_host=8)
    s = ring_allgather(topo, channels=2).validate()
    assert s.info["order"] == rail_ring_order(topo)


@pytest.mark.parametrize("n", SIZES)
def test_ordered_allreduce_is_ordered(n):
    s = ordered_allreduce(n)
    assert s.chunks_per_period == n
    rep = check(s, ordered_reduction=True)
    assert rep.ordered_reduction


@pytest.mark.parametrize("n", [3, 4, 8])
@pytest.mark.parametrize("fn", [ring_reduce_scatter, ring_allreduce], ids=lambda f: f.__name__)
def test_unordered_reductions_are_flagged(fn, n):
    s = fn(n)
    assert s.info["ordered_reduction"] is False
    s.validate()  # the sum is right ...
    with pytest.raises(ScheduleError, match="ascending rank order"):
        s.validate(ordered_reduction=True)  # ... but not in jax.lax's order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 16])
@pytest.mark.parametrize("fn", [binary_tree_allreduce, double_binary_tree_allreduce], ids=lambda f: f.__name__)
def test_tree_ordered_flag_is_truthful(fn, n):
    s = fn(n)
    try:
        s.validate(ordered_reduction=True)
        truly_ordered = True
    except ScheduleError as e:
        assert "ascending rank order" in str(e)
        truly_ordered = False
    assert s.info["ordered_reduction"] is truly_ordered
    assert truly_ordered == (n <= 2)


def test_two_rank_reductions_are_ordered():
    for s in (ring_reduce_scatter(2), ring_allreduce(2)):
        assert s.info["ordered_reduction"] is True
        s.validate()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fn", [binary_tree_allreduce, double_binary_tree_allreduce], ids=lambda f: f.__name__)
def test_trees_validate(fn, n):
    fn(n).validate()


def test_binary_tree_is_nccls():
    # ncclGetBtree for 8 ranks: 0 -> 4; 4 -> 2, 6; 2 -> 1, 3; 6 -> 5, 7.
    tree = binary_tree_allreduce(8).info["tree"]
    kids = {int(r): sorted(ch) for r, (_, ch) in tree.items()}
    assert kids == {0: [4], 4: [2, 6], 2: [1, 3], 6: [5, 7], 1: [], 3: [], 5: [], 7: []}
    # 6 ranks: 4's right child 6 does not exist, so it moves to 5.
    kids6 = {int(r): sorted(ch) for r, (_, ch) in binary_tree_allreduce(6).info["tree"].items()}
    assert kids6 == {0: [4], 4: [2, 5], 2: [1, 3], 1: [], 3: [], 5: []}


@pytest.mark.parametrize("n", [3, 4, 5, 8, 16])
def test_double_tree_inner_nodes_disjoint(n):
    s = double_binary_tree_allreduce(n)
    inner = [{int(r) for r, (_, kids) in tree.items() if kids} for tree in s.info["trees"]]
    assert inner[0] & inner[1] == ({0} if n % 2 else set())  # as NCCL: only rank 0 for odd N
    for tree in s.info["trees"]:
        assert sorted(int(r) for r in tree) == list(range(n))
        assert sum(1 for _, (parent, _) in tree.items() if parent < 0) == 1


def test_rail_order_aligns_rails():
    topo = rail(hosts=3, gpus_per_host=8)
    order = rail_ring_order(topo)
    assert order[:8] == list(range(8))
    assert order[8:16] == list(range(15, 7, -1))
    assert order[16:] == list(range(16, 24))
    # Every inter-host hop joins GPUs of the same rail.
    for a, b in zip(order, order[1:]):
        if a // 8 != b // 8:
            assert a % 8 == b % 8
    s = ring_allgather(topo, channels=2).validate()
    assert s.info["order"] == order
    assert s.num_ranks == 24


def test_topology_argument():
    for topo in (single_node(4), ring(5), rail(hosts=2, gpus_per_host=2)):
        for fn in (ring_allgather, direct_alltoall, direct_reduce_scatter, ordered_allreduce, ring_allreduce):
            s = fn(topo).validate()
            assert s.num_ranks == topo.num_gpus
    assert ring_allgather(single_node(4)).info["order"] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ring_allgather(0), "number of ranks"),
        (lambda: ring_allgather(4, channels=0), "channels"),
        (lambda: ring_allgather(4, order=[0, 1, 2]), "permutation"),
        (lambda: ring_allreduce(3, order=[0, 0, 1]), "permutation"),
        (lambda: direct_alltoall("x"), "rank count or a Topology"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ScheduleError, match=match):
        call()


def test_info_is_json_and_roundtrips():
    for s in (ring_allgather(4, channels=2), double_binary_tree_allreduce(5), ordered_allreduce(3)):
        assert Schedule.from_json(s.to_json()) == s
