"""Baseline schedules: NCCL-style rings, recursive doubling, direct exchanges, trees.

Every baseline takes ``n_or_topo`` (a rank count or a
:class:`~jaxccl.topology.Topology`, whose ``num_gpus`` is the rank count) and
returns a :class:`~jaxccl.schedule.Schedule` that passes
:meth:`~jaxccl.schedule.Schedule.validate`. All are out-of-place: the own
contribution is copied (or reduced) into the output explicitly.

Threadblocks are placed by hand (:meth:`ScheduleBuilder.threadblock
<jaxccl.schedule.ScheduleBuilder.threadblock>` and :meth:`~jaxccl.schedule.ScheduleBuilder.op`
rather than transfers) so that rings use MSCCL's fused ops (``rcs``, ``rrs``,
``rrcs``) with one threadblock per ring and channel, as NCCL's ring kernels do.

Example:
    >>> from jaxccl.synth.baselines import ring_allgather, ordered_allreduce
    >>> ring_allgather(4, channels=2).validate().num_threadblocks
    8
    >>> ordered_allreduce(3).info["ordered_reduction"]
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jaxccl.errors import ScheduleError
from jaxccl.schedule.builder import Handle, ScheduleBuilder
from jaxccl.schedule.interpreter import gc_paused
from jaxccl.schedule.ir import Buffer, Collective, OpKind, Schedule

I, O = Buffer.INPUT, Buffer.OUTPUT

__all__ = [
    "binary_tree_allreduce",
    "direct_alltoall",
    "direct_reduce_scatter",
    "double_binary_tree_allreduce",
    "ordered_allreduce",
    "rail_ring_order",
    "recursive_doubling_allgather",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
]


# --------------------------------------------------------------------------- helpers
_F = TypeVar("_F", bound=Callable[..., Schedule])


def _fast(fn: _F) -> _F:
    """Builds with the cyclic GC paused (10^5..10^6 small objects; see :func:`gc_paused`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Schedule:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _ranks_of(n_or_topo: Any) -> tuple[int, Any]:
    """``(num_ranks, topology or None)``."""
    if isinstance(n_or_topo, bool):
        raise ScheduleError(f"expected a rank count or a Topology, got {n_or_topo!r}")
    if isinstance(n_or_topo, int):
        if n_or_topo < 1:
            raise ScheduleError(f"number of ranks must be >= 1, got {n_or_topo}")
        return n_or_topo, None
    n = getattr(n_or_topo, "num_gpus", None)
    if not isinstance(n, int):
        raise ScheduleError(f"expected a rank count or a Topology, got {type(n_or_topo).__name__}")
    return n, n_or_topo


def _check_channels(channels: int) -> int:
    if not isinstance(channels, int) or isinstance(channels, bool) or channels < 1:
        raise ScheduleError(f"channels must be a positive integer, got {channels!r}")
    return channels


def rail_ring_order(topo: Any) -> list[int]:
    """NCCL's rail-aligned ring through the hosts of ``topo``.

    Hosts are visited in index order; even hosts are walked in ascending rank
    order and odd hosts in descending order, so every inter-host hop joins two
    GPUs of the same rail (host 0: 0..7, host 1: 15..8, host 2: 16..23, ...).
    With an odd number of multi-GPU hosts the closing hop back to rank 0
    crosses rails (NCCL has the same issue and routes it through PXN).

    >>> from jaxccl.topology import rail
    >>> rail_ring_order(rail(hosts=2, gpus_per_host=4))
    [0, 1, 2, 3, 7, 6, 5, 4]
    """
    order: list[int] = []
    for h, gpus in enumerate(topo.hosts):
        g = sorted(gpus)
        order.extend(g if h % 2 == 0 else reversed(g))
    return order


def _ring_order(n: int, topo: Any, order: Sequence[int] | None) -> list[int]:
    if order is None:
        return rail_ring_order(topo) if topo is not None else list(range(n))
    try:
        out = [int(r) for r in order]
    except (TypeError, ValueError) as e:
        raise ScheduleError(f"ring order must be a sequence of ranks, got {order!r}") from e
    if sorted(out) != list(range(n)):
        raise ScheduleError(f"ring order must be a permutation of 0..{n - 1}, got {out}")
    return out


def _direction(channel: int, bidirectional: bool) -> int:
    return -1 if bidirectional and channel % 2 else 1


def _ring_info(order: list[int], channels: int, bidirectional: bool, **extra: Any) -> dict[str, Any]:
    return {"order": list(order), "channels": channels, "bidirectional": bidirectional, **extra}


# ------------------------------------------------------------------------ all_gather
@_fast
def ring_allgather(
    n_or_topo: Any,
    *,
    channels: int = 1,
    order: Sequence[int] | None = None,
    bidirectional: bool = False,
) -> Schedule:
    """NCCL's ring AllGather with ``channels`` rings.

    The layout has ``C = channels`` chunks per period; channel ``k`` moves
    chunk ``k`` of every rank around its ring in ``N - 1`` steps with one
    threadblock per rank (``s`` of the own chunk, its ``cpy`` into the output,
    ``rcs`` x (N-2), ``r``). All channels run the ring in the same direction, as NCCL does;
    with ``bidirectional=True`` odd channels run it backwards (useful on
    topologies whose links are not full-duplex through a switch, e.g.
    :func:`jaxccl.topology.ring`).

    Args:
        n_or_topo: number of ranks or a Topology.
        channels: number of rings (= chunks per period).
        order: the ring as a permutation of the ranks. Default ``0..N-1``, or
            for a Topology :func:`rail_ring_order`.
        bidirectional: run odd channels in the reverse direction.

    >>> s = ring_allgather(8, channels=2).validate()
    >>> s.chunks_per_period, s.num_ops
    (2, 144)
    """
    n, topo = _ranks_of(n_or_topo)
    c = _check_channels(channels)
    ring = _ring_order(n, topo, order)
    pos = {r: p for p, r in enumerate(ring)}
    prog = ScheduleBuilder(Collective.ALL_GATHER, n, c)
    if n == 1:
        prog.op(0, prog.threadblock(0), OpKind.COPY, (I, 0), (O, 0), c)
    for k in range(c if n > 1 else 0):
        d = _direction(k, bidirectional)
        for r in range(n):
            p = pos[r]
            tb = prog.threadblock(r, send_peer=ring[(p + d) % n], recv_peer=ring[(p - d) % n], channel=k)
            prog.op(r, tb, OpKind.SEND, (I, k), (O, r * c + k))
            prog.op(r, tb, OpKind.COPY, (I, k), (O, r * c + k))
            for s in range(1, n):
                origin = ring[(p - d * s) % n]
                loc = (O, origin * c + k)
                prog.op(r, tb, OpKind.RECV_COPY_SEND if s < n - 1 else OpKind.RECV, loc, loc)
    return prog.build(name="ring_allgather", info=_ring_info(ring, c, bidirectional, algorithm="ring"))


@_fast
def recursive_doubling_allgather(n_or_topo: Any) -> Schedule:
    """Recursive-doubling AllGather (``log2 N`` exchange steps); ``N`` must be a power of two.

    In step ``j`` rank ``r`` exchanges everything it holds (the ``2**j``
    ranks' blocks of its aligned group) with rank ``r ^ 2**j``. One chunk per
    period; one threadblock per partner (``s`` then ``r``), each send waiting
    for the previous step's receive.

    >>> recursive_doubling_allgather(8).validate().num_threadblocks
    24
    """
    n, _ = _ranks_of(n_or_topo)
    if n & (n - 1):
        raise ScheduleError(f"recursive doubling needs a power-of-two number of ranks, got N={n}")
    steps = n.bit_length() - 1
    prog = ScheduleBuilder(Collective.ALL_GATHER, n, 1)
    for r in range(n):
        if n == 1:
            prog.op(r, prog.threadblock(r), OpKind.COPY, (I, 0), (O, 0))
            continue
        last = None
        for j in range(steps):
            peer = r ^ (1 << j)
            tb = prog.threadblock(r, send_peer=peer, recv_peer=peer, channel=0)
            mine, theirs = (r >> j) << j, (peer >> j) << j
            size = 1 << j
            if j == 0:
                prog.op(r, tb, OpKind.SEND, (I, 0), (O, r))
                prog.op(r, tb, OpKind.COPY, (I, 0), (O, r))
            else:
                prog.op(r, tb, OpKind.SEND, (O, mine), (O, mine), size, after=[last])
            last = prog.op(r, tb, OpKind.RECV, (O, theirs), (O, theirs), size)
    return prog.build(name="recursive_doubling_allgather", info={"algorithm": "recursive_doubling"})


# ------------------------------------------------------------------------ all_to_all
@_fast
def direct_alltoall(n_or_topo: Any) -> Schedule:
    """Direct AllToAll: every rank sends block ``d`` straight to rank ``d``.

    One chunk per period; rank ``r`` has one threadblock per peer (``s`` then
    ``r``), the first of which also copies the own block; peers are visited
    starting at ``r + 1`` so that no rank is everyone's first target.

    >>> direct_alltoall(4).validate().num_ops
    28
    """
    n, _ = _ranks_of(n_or_topo)
    prog = ScheduleBuilder(Collective.ALL_TO_ALL, n, 1)
    for r in range(n):
        first = True
        for i in range(1, n):
            peer = (r + i) % n
            tb = prog.threadblock(r, send_peer=peer, recv_peer=peer, channel=0)
            prog.op(r, tb, OpKind.SEND, (I, peer), (O, r))
            if first:
                prog.op(r, tb, OpKind.COPY, (I, r), (O, r))
                first = False
            prog.op(r, tb, OpKind.RECV, (I, r), (O, peer))
        if n == 1:
            prog.op(r, prog.threadblock(r), OpKind.COPY, (I, 0), (O, 0))
    return prog.build(name="direct_alltoall", info={"algorithm": "direct"})


# -------------------------------------------------------------------- reduce_scatter
def _ring_rs_ops(
    prog: ScheduleBuilder,
    ring: list[int],
    p: int,
    tb: int,
    d: int,
    offset: Callable[[int], int],
    out: int,
    fuse_send: bool,
) -> None:
    """Ring reduce-scatter steps of the rank at ring position ``p`` (direction ``d``) in threadblock ``tb``.

    ``offset(owner)`` is the input chunk of ``owner``'s block this ring handles;
    the owner stores its sum in output chunk ``out``. With ``fuse_send`` the last
    step is ``rrcs`` (the all-reduce's first all-gather send) instead of ``rrc``.
    """
    n, r = len(ring), ring[p]
    prog.op(r, tb, OpKind.SEND, (I, offset(ring[(p - d) % n])))
    for s in range(1, n - 1):
        prog.op(r, tb, OpKind.RECV_REDUCE_SEND, (I, offset(ring[(p - d * (s + 1)) % n])))
    kind = OpKind.RECV_REDUCE_COPY_SEND if fuse_send else OpKind.RECV_REDUCE_COPY
    prog.op(r, tb, kind, (I, offset(r)), (O, out))


@_fast
def ring_reduce_scatter(
    n_or_topo: Any,
    *,
    channels: int = 1,
    order: Sequence[int] | None = None,
    bidirectional: bool = False,
) -> Schedule:
    """NCCL's ring ReduceScatter with ``channels`` rings (``C = channels``).

    The partial sum of the block owned by ring position ``q`` starts at
    ``q + 1`` and travels once around the ring (``s``, ``rrs`` x (N-2),
    ``rrc``), so each chunk is summed in an order rotated by its owner: not
    the ascending rank order of ``jax.lax`` (``info["ordered_reduction"]`` is
    false, except for ``N <= 2`` where one addition is order-free).
    ``order``/``bidirectional`` as for :func:`ring_allgather`.

    >>> ring_reduce_scatter(4).validate().info["ordered_reduction"]
    False
    """
    n, topo = _ranks_of(n_or_topo)
    c = _check_channels(channels)
    ring = _ring_order(n, topo, order)
    prog = ScheduleBuilder(Collective.REDUCE_SCATTER, n, c)
    if n == 1:
        prog.op(0, prog.threadblock(0), OpKind.COPY, (I, 0), (O, 0), c)
    else:
        for k in range(c):
            d = _direction(k, bidirectional)
            for p, r in enumerate(ring):
                tb = prog.threadblock(r, send_peer=ring[(p + d) % n], recv_peer=ring[(p - d) % n], channel=k)
                _ring_rs_ops(prog, ring, p, tb, d, lambda q, k=k: q * c + k, k, False)
    info = _ring_info(ring, c, bidirectional, algorithm="ring", ordered_reduction=n <= 2)
    return prog.build(name="ring_reduce_scatter", info=info)


def _direct_sends(prog: ScheduleBuilder, n: int, owner: int, in_off: int, out_off: int, count: int, chan: int) -> None:
    """Every rank but ``owner`` sends its block ``in_off`` towards ``owner``'s ``out_off``."""
    for s in range(n):
        if s != owner:
            prog.op(
                s,
                prog.threadblock(s, send_peer=owner, recv_peer=owner, channel=chan),
                OpKind.SEND,
                (I, in_off),
                (O, out_off),
                count,
            )


def _ordered_fold(
    prog: ScheduleBuilder, n: int, owner: int, in_off: int, out_off: int, count: int, chan: int
) -> Handle:
    """``owner`` folds block ``in_off`` of every rank into ``out_off`` in ascending rank order.

    ``((x0 + x1) + x2) + ...``: the first term arrives by ``r`` (or ``cpy`` when
    it is the owner's own), the others by ``rrc`` from the peer's threadblock
    (``re`` for the owner's own block), each step depending on the previous.
    Returns the handle of the last step. Pair with :func:`_direct_sends`.
    """
    last: Handle | None = None
    acc = (O, out_off)
    for s in range(n):
        if s == owner:
            tb = prog.threadblock(owner)
            kind = OpKind.COPY if last is None else OpKind.REDUCE
            last = prog.op(owner, tb, kind, (I, in_off), acc, count, after=[last])
        else:
            tb = prog.threadblock(owner, send_peer=s, recv_peer=s, channel=chan)
            if last is None:
                last = prog.op(owner, tb, OpKind.RECV, (I, in_off), acc, count)
            else:
                last = prog.op(owner, tb, OpKind.RECV_REDUCE_COPY, acc, acc, count, after=[last])
    assert last is not None
    return last


@_fast
def direct_reduce_scatter(n_or_topo: Any) -> Schedule:
    """Rank-ordered direct ReduceScatter (jaxccl's default ``psum_scatter``).

    Every rank sends block ``r`` straight to rank ``r``, which folds the
    contributions in ascending rank order ``((x0 + x1) + x2) + ...`` (its own
    block at its position), chaining the ``r``/``rrc``/``re`` steps with
    dependencies. XLA:CPU sums in the same order, so the result is bitwise
    equal to ``jax.lax.psum_scatter`` (``info["ordered_reduction"]`` is true).

    >>> direct_reduce_scatter(4).validate(ordered_reduction=True).num_threadblocks
    16
    """
    n, _ = _ranks_of(n_or_topo)
    prog = ScheduleBuilder(Collective.REDUCE_SCATTER, n, 1)
    # All sends first, so every threadblock towards a peer is [s, r|rrc]: a send never
    # waits behind a fold.
    for owner in range(n):
        _direct_sends(prog, n, owner, owner, 0, 1, 0)
    for owner in range(n):
        _ordered_fold(prog, n, owner, owner, 0, 1, 0)
    return prog.build(
        name="direct_reduce_scatter",
        info={"algorithm": "direct", "ordered_reduction": True},
    )


# ------------------------------------------------------------------------ all_reduce
@_fast
def ring_allreduce(
    n_or_topo: Any,
    *,
    channels: int = 1,
    order: Sequence[int] | None = None,
    bidirectional: bool = False,
) -> Schedule:
    """NCCL's ring AllReduce: ring ReduceScatter then ring AllGather, fused per channel.

    The layout has ``C = N * channels`` chunks; rank ``b`` owns chunks
    ``b*channels .. b*channels + channels - 1`` and channel ``k`` handles chunk
    ``b*channels + k`` of every block. Each rank runs one threadblock per
    channel: ``s``, ``rrs`` x (N-2), ``rrcs`` (its own block, reduced, stored
    and sent on), ``rcs`` x (N-2), ``r``. Not rank-ordered (see
    :func:`ring_reduce_scatter`).

    >>> ring_allreduce(4, channels=2).validate().chunks_per_period
    8
    """
    n, topo = _ranks_of(n_or_topo)
    k_ch = _check_channels(channels)
    ring = _ring_order(n, topo, order)
    c = n * k_ch
    prog = ScheduleBuilder(Collective.ALL_REDUCE, n, c)
    if n == 1:
        prog.op(0, prog.threadblock(0), OpKind.COPY, (I, 0), (O, 0), c)
    else:
        for k in range(k_ch):
            d = _direction(k, bidirectional)
            for p, r in enumerate(ring):
                tb = prog.threadblock(r, send_peer=ring[(p + d) % n], recv_peer=ring[(p - d) % n], channel=k)
                off = lambda q, k=k: q * k_ch + k  # noqa: E731
                _ring_rs_ops(prog, ring, p, tb, d, off, off(r), True)
                for s in range(1, n):
                    loc = (O, off(ring[(p - d * s) % n]))
                    prog.op(r, tb, OpKind.RECV_COPY_SEND if s < n - 1 else OpKind.RECV, loc, loc)
    info = _ring_info(ring, k_ch, bidirectional, algorithm="ring", ordered_reduction=n <= 2)
    return prog.build(name="ring_allreduce", info=info)


@_fast
def ordered_allreduce(n_or_topo: Any, *, order: Sequence[int] | None = None) -> Schedule:
    """Rank-ordered AllReduce (jaxccl's default ``psum``): direct ReduceScatter + ring AllGather.

    ``C = N``; rank ``b`` folds chunk ``b`` of every rank in ascending rank
    order (as :func:`direct_reduce_scatter`, on channel 0), then the reduced
    chunks go around a ring (channel 1; ``order`` as for
    :func:`ring_allgather`), the ring's first send waiting for the last fold.
    Bitwise equal to ``jax.lax.psum`` on CPU.

    >>> ordered_allreduce(4).validate(ordered_reduction=True).chunks_per_period
    4
    """
    n, topo = _ranks_of(n_or_topo)
    ring = _ring_order(n, topo, order)
    prog = ScheduleBuilder(Collective.ALL_REDUCE, n, n)
    for b in range(n):
        _direct_sends(prog, n, b, b, b, 1, 0)
    lasts = [_ordered_fold(prog, n, b, b, b, 1, 0) for b in range(n)]
    if n > 1:
        for p, r in enumerate(ring):
            nxt, prv = ring[(p + 1) % n], ring[(p - 1) % n]
            tb = prog.threadblock(r, send_peer=nxt, recv_peer=prv, channel=1)
            prog.op(r, tb, OpKind.SEND, (O, r), (O, r), after=[lasts[r]])
            for s in range(1, n):
                loc = (O, ring[(p - s) % n])
                prog.op(r, tb, OpKind.RECV_COPY_SEND if s < n - 1 else OpKind.RECV, loc, loc)
    info = {"algorithm": "direct+ring", "order": ring, "ordered_reduction": True}
    return prog.build(name="ordered_allreduce", info=info)


# ---------------------------------------------------------------------- tree all_reduce
def _binary_tree(ranks: Sequence[int]) -> dict[int, tuple[int, list[int]]]:
    """NCCL's binary tree (``ncclGetBtree``) over ``ranks``: ``{rank: (parent or -1, children)}``.

    With ``i`` the index in ``ranks``: index 0 is the root and has one child,
    the largest power of two ``< len``; an index whose lowest set bit is ``b``
    has children ``i - b/2`` and ``i + b/2``, the right one moved to
    ``i + b/4``, ``i + b/8``... while it lies beyond the end.
    """
    m = len(ranks)
    tree: dict[int, tuple[int, list[int]]] = {ranks[0]: (-1, [])} if m else {}
    stack = [(1 << ((m - 1).bit_length() - 1), ranks[0])] if m > 1 else []
    if stack:
        tree[ranks[0]][1].append(ranks[stack[0][0]])
    while stack:
        i, parent = stack.pop()
        half = (i & -i) >> 1
        kids = [i - half] if half else []
        while half and i + half >= m:
            half >>= 1
        if half:
            kids.append(i + half)
        tree[ranks[i]] = (parent, [ranks[k] for k in kids])
        stack.extend((k, ranks[i]) for k in kids)
    return tree


def _tree_sums_in_rank_order(tree: dict[int, tuple[int, list[int]]]) -> bool:
    """Whether :func:`_tree_allreduce_ops` sums ``((x0 + x1) + x2) + ...`` up to commutativity.

    Each node computes ``((own + child0) + child1)``; with NCCL's tree (the root
    adds the whole rest of the tree at once) that is the case only for ``N <= 2``.
    """
    root = next(r for r, (parent, _) in tree.items() if parent < 0)

    def term(r: int) -> Any:
        t: Any = r
        for ch in tree[r][1]:
            t = (t, term(ch))
        return t

    def is_fold(t: Any, k: int) -> bool:  # t == ((x0 + x1) + ...) + xk, each + commutative
        if k == 0:
            return t == 0
        if not isinstance(t, tuple):
            return False
        a, b = t
        return (b == k and is_fold(a, k - 1)) or (a == k and is_fold(b, k - 1))

    return is_fold(term(root), len(tree) - 1)


def _tree_allreduce_ops(
    prog: ScheduleBuilder, tree: dict[int, tuple[int, list[int]]], off: int, count: int, chan: int
) -> None:
    """Reduce up the tree into ``off`` of each node's output, then broadcast down.

    Each node keeps its partial sum in its output chunk: it copies its input,
    folds each child's partial (``rrc``), sends the sum to its parent, receives
    the final value back and forwards it to its children. Threadblocks: one per
    (peer, channel) with ``send = recv = peer``.
    """
    for r, (parent, children) in tree.items():
        local = prog.threadblock(r)
        last = prog.op(r, local, OpKind.COPY, (I, off), (O, off), count)
        for ch in children:
            tb = prog.threadblock(r, send_peer=ch, recv_peer=ch, channel=chan)
            last = prog.op(r, tb, OpKind.RECV_REDUCE_COPY, (O, off), (O, off), count, after=[last])
        if parent >= 0:
            tb = prog.threadblock(r, send_peer=parent, recv_peer=parent, channel=chan)
            prog.op(r, tb, OpKind.SEND, (O, off), (O, off), count, after=[last])
            last = prog.op(r, tb, OpKind.RECV, (O, off), (O, off), count)
        for ch in children:
            tb = prog.threadblock(r, send_peer=ch, recv_peer=ch, channel=chan)
            prog.op(r, tb, OpKind.SEND, (O, off), (O, off), count, after=[last])


@_fast
def binary_tree_allreduce(n_or_topo: Any, *, order: Sequence[int] | None = None) -> Schedule:
    """AllReduce over one binary tree (reduce to the root, broadcast back); ``C = 1``.

    The tree is NCCL's binary tree over ``order`` (default ``0..N-1`` or
    :func:`rail_ring_order` for a Topology; see :func:`_binary_tree`). Each
    node sums ``(own + first child) + second child``, not the ascending rank
    order for ``N > 2`` (``info["ordered_reduction"]`` says which).

    >>> binary_tree_allreduce(5).validate().info["tree"]["0"]
    [-1, [4]]
    """
    n, topo = _ranks_of(n_or_topo)
    ranks = _ring_order(n, topo, order)
    tree = _binary_tree(ranks)
    prog = ScheduleBuilder(Collective.ALL_REDUCE, n, 1)
    _tree_allreduce_ops(prog, tree, 0, 1, 0)
    info = {
        "algorithm": "tree",
        "order": ranks,
        "tree": {str(r): [p, ch] for r, (p, ch) in sorted(tree.items())},
        "ordered_reduction": _tree_sums_in_rank_order(tree),
    }
    return prog.build(name="binary_tree_allreduce", info=info)


@_fast
def double_binary_tree_allreduce(n_or_topo: Any, *, order: Sequence[int] | None = None) -> Schedule:
    """NCCL's double binary tree AllReduce; ``C = 2``, chunk ``t`` goes over tree ``t``.

    Tree 0 is NCCL's binary tree over ``order``; tree 1 is the same shape over
    that order shifted by one position when ``N`` is odd and mirrored when it
    is even (NCCL's ``ncclGetDtree``), so that every rank is an inner node in
    at most one tree (except the first rank of ``order`` for odd ``N``, as in
    NCCL). Tree ``t`` runs on channel ``t``.

    >>> double_binary_tree_allreduce(8).validate().chunks_per_period
    2
    """
    n, topo = _ranks_of(n_or_topo)
    ranks = _ring_order(n, topo, order)
    other = ranks[1:] + ranks[:1] if n % 2 else ranks[::-1]
    trees = [_binary_tree(ranks), _binary_tree(other)]
    prog = ScheduleBuilder(Collective.ALL_REDUCE, n, 2)
    for t, tree in enumerate(trees):
        _tree_allreduce_ops(prog, tree, t, 1, t)
    info = {
        "algorithm": "double_tree",
        "order": ranks,
        "trees": [{str(r): [p, ch] for r, (p, ch) in sorted(tree.items())} for tree in trees],
        "ordered_reduction": all(_tree_sums_in_rank_order(tree) for tree in trees),
    }
    return prog.build(name="double_binary_tree_allreduce", info=info)
