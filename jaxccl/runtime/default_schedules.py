"""Default schedules of a communicator without a topology.

Direct, never relayed: every message goes from the rank that has the data
straight to the rank that needs it, and the compiled table marks such sends
*direct* (the receiver copies from the sender's buffer in place), so each
block is moved once and no rank waits for a chain of hand-offs. Reductions
fold every contribution in ascending rank order ``((x0 + x1) + x2) + ...``,
the order XLA:CPU uses, so results are bitwise equal to ``jax.lax``. In a
job of several processes XLA:CPU reduces with gloo instead, and so do
:func:`gloo_ring_allreduce` and :func:`gloo_tree_reduce_scatter` (the
defaults there). They are
schedules like any other: the reference interpreter validates them.

>>> direct_allgather(4).validate().num_ranks
4
>>> direct_allreduce(4).validate(ordered_reduction=True).chunks_per_period
4
"""

from __future__ import annotations

from jaxccl.errors import ArgumentError
from jaxccl.schedule import Buffer, OpKind, Schedule, ScheduleBuilder
from jaxccl.schedule.reduction import GlooTree, gloo_tree

__all__ = ["direct_allgather", "direct_allreduce", "gloo_ring_allreduce", "gloo_tree_reduce_scatter"]

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


def direct_allgather(n: int) -> Schedule:
    """AllGather in which every rank sends its block straight to every other rank.

    Args:
        n: number of ranks.

    >>> direct_allgather(8).validate().num_ops
    120
    """
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1)
    for r in range(n):
        b.copy(r, (I, 0), (O, r))
        for k in range(1, n):
            b.transfer(r, (r + k) % n, (I, 0), (O, r))
    return b.build(name="direct_allgather", info={"algorithm": "direct"})


def direct_allreduce(n: int) -> Schedule:
    """Rank-ordered AllReduce: rank ``b`` folds block ``b`` of every rank, then sends it to every rank.

    ``C = N``. The fold is ``((x0 + x1) + x2) + ...`` (the own block by a local
    copy or reduce at its position, the others received with ``r``/``rrc``),
    each step after the previous; the folded block leaves for every peer on
    channel 1 after the last step.

    Args:
        n: number of ranks.

    >>> s = direct_allreduce(4).validate(ordered_reduction=True)
    >>> s.info["ordered_reduction"]
    True
    """
    b = ScheduleBuilder("all_reduce", num_ranks=n, chunks_per_period=n)
    folded = []
    for owner in range(n):
        last = None
        for s in range(n):
            if s == owner:
                if last is None:
                    last = b.copy(owner, (I, owner), (O, owner))
                else:
                    last = b.reduce(owner, (I, owner), (O, owner), after=[last])
            else:
                after = [] if last is None else [last]
                last = b.transfer(s, owner, (I, owner), (O, owner), reduce=last is not None, recv_after=after)
        folded.append(last)
    for owner in range(n):
        for k in range(1, n):
            b.transfer(owner, (owner + k) % n, (O, owner), (O, owner), channel=1, after=[folded[owner]])
    return b.build(name="direct_allreduce", info={"algorithm": "direct", "ordered_reduction": True})


def gloo_ring_allreduce(n: int) -> Schedule:
    """AllReduce in gloo's ring order: what XLA:CPU's reductions across processes compute, bit for bit.

    ``C = N``, one chunk per rank (the caller sizes the chunks as gloo does:
    :func:`jaxccl.schedule.reduction.gloo_ring_chunk`). Messages go down the ring, rank ``r`` to
    ``r - 1``. Chunk ``c`` starts as rank ``c - 1``'s input; each rank below adds its own input to
    what it receives and passes the sum on, and rank ``c`` stores
    ``x_c + (x_(c+1) + (... + (x_(c-2) + x_(c-1))))``, then sends the chunk around the same ring
    (``rcs``) to every rank. One threadblock per rank; the interpreter checks that every rank ends
    with the whole sum.

    Args:
        n: number of ranks.

    >>> s = gloo_ring_allreduce(4).validate()
    >>> s.info["fold"], s.num_threadblocks, s.num_ops
    ('gloo_ring', 4, 32)
    """
    b = ScheduleBuilder("all_reduce", num_ranks=n, chunks_per_period=n)
    if n == 1:
        b.copy(0, (I, 0), (O, 0))
        return b.build(name="gloo_ring_allreduce", info={"algorithm": "ring", "fold": "gloo_ring"})
    for r in range(n):
        tb = b.threadblock(r, send_peer=(r - 1) % n, recv_peer=(r + 1) % n)
        b.op(r, tb, OpKind.SEND, (I, (r + 1) % n), (I, (r + 1) % n))  # chunk r+1 starts here
        for k in range(2, n):  # chunk r+k: add this rank's term, pass it down
            c = (r + k) % n
            b.op(r, tb, OpKind.RECV_REDUCE_SEND, (I, c), (O, c))
        b.op(r, tb, OpKind.RECV_REDUCE_COPY, (I, r), (O, r))  # chunk r is complete here
        b.op(r, tb, OpKind.SEND, (O, r), (O, r))
        for k in range(1, n - 1):  # the complete chunks travel down the same ring
            c = (r + k) % n
            b.op(r, tb, OpKind.RECV_COPY_SEND, None, (O, c))
        b.op(r, tb, OpKind.RECV, None, (O, (r - 1) % n))
    return b.build(name="gloo_ring_allreduce", info={"algorithm": "ring", "fold": "gloo_ring"})


def gloo_tree_reduce_scatter(n: int) -> Schedule:
    """ReduceScatter in the order of gloo's halving-doubling (XLA:CPU's ``psum_scatter`` across processes).

    Every element of every shard is the same tree over the ranks
    (:func:`~jaxccl.schedule.reduction.gloo_tree`), whatever the chunk size. For a
    power of two it is the butterfly tree, lowest bit first: ``(x0 + x1) + (x2 + x3)`` for 4 ranks,
    ``((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))`` for 8. Other counts split into gloo's binary
    blocks, largest first (6 = 4 + 2), each a butterfly tree, folded from the smallest up:
    ``T(block 0) + (T(block 1) + ...)``; 3 ranks give ``(x0 + x1) + x2``, 6 give
    ``((x0 + x1) + (x2 + x3)) + (x4 + x5)`` (measured against XLA at 3 and 6 ranks).
    Moved directly: every rank sends block ``r`` to rank ``r``, which adds each term where the tree
    needs it (``rrc`` as it arrives, ``re`` for sums already held), the root's sums in its output.

    Args:
        n: number of ranks.

    >>> s = gloo_tree_reduce_scatter(4).validate()
    >>> s.info["fold"], s.scratch_chunks
    ('gloo_tree', 1)
    >>> gloo_tree_reduce_scatter(6).validate().num_ranks
    6
    """
    if n < 1:
        raise ArgumentError(f"gloo_tree_reduce_scatter: needs at least one rank, got {n}")
    tree = gloo_tree(n)
    plans = [_TreeFold(r) for r in range(n)]
    for fold in plans:
        fold.root = fold.sum(tree)
    b = ScheduleBuilder(
        "reduce_scatter", num_ranks=n, chunks_per_period=1, scratch_chunks=max(p.scratch for p in plans)
    )
    for fold in plans:
        fold.emit(b)
    return b.build(name="gloo_tree_reduce_scatter", info={"algorithm": "direct", "fold": "gloo_tree"})


class _TreeFold:
    """Rank ``r``'s part of :func:`gloo_tree_reduce_scatter`: the tree's additions as ops, planned first.

    A term is ``("own",)`` (``r``'s input block), ``("remote", s)`` (rank ``s``'s block, not received yet)
    or ``("slot", k)`` (a partial sum in slot ``k``); :meth:`add` records one addition. The slot that ends
    as the root is the output chunk, the others scratch chunks, so no pass copies the result.
    """

    def __init__(self, r: int):
        self.r, self.slots, self.steps, self.root = r, 0, [], None

    def leaf(self, s: int) -> tuple:
        return ("own",) if s == self.r else ("remote", s)

    def sum(self, tree: GlooTree) -> tuple:
        """The additions of ``tree`` (:func:`~jaxccl.schedule.reduction.gloo_tree`) in gloo's order.

        A node whose halves have equal sizes is one of gloo's blocks (a butterfly tree): its
        additions go level by level, as gloo's rounds do. Any other node is the fold of blocks:
        its left block, then the rest, then their sum.
        """
        if isinstance(tree, int):
            return self.leaf(tree)
        left, right = tree
        if _size(left) != _size(right):
            return self.add(self.sum(left), self.sum(right))
        levels = [[tree]]
        while not isinstance(levels[-1][0], int):
            levels.append([half for node in levels[-1] for half in node])
        terms = [self.leaf(s) for s in levels.pop()]
        for _ in levels:
            terms = [self.add(a, b) for a, b in zip(terms[::2], terms[1::2])]
        return terms[0]

    def add(self, a: tuple, b: tuple) -> tuple:
        if b[0] == "slot" and a[0] != "slot":
            a, b = b, a  # sums commute bit for bit: only the tree's shape matters
        if a[0] == "slot":
            self.steps.append(("into", a[1], b))
            return a
        slot = ("slot", self.slots)
        self.slots += 1
        if a[0] == "own":
            a, b = b, a
        self.steps.append(("start", slot[1], a, b))  # a is remote; b own or remote
        return slot

    @property
    def scratch(self) -> int:
        """Scratch chunks it needs (its slots but the root)."""
        return max(0, self.slots - 1)

    def emit(self, b: ScheduleBuilder) -> None:
        r = self.r
        if self.root == ("own",):  # one rank
            b.copy(r, (I, r), (O, 0))
            return
        root = self.root[1]
        where, k_s = {}, 0
        for k in range(self.slots):
            if k == root:
                where[k] = (O, 0)
            else:
                where[k], k_s = (S, k_s), k_s + 1
        last = {}
        for step in self.steps:
            kind, slot, term = step[0], step[1], step[2]
            dst, after = where[slot], [h for h in (last.get(slot),) if h is not None]
            if kind == "start" and step[3][0] == "own":  # dst = own + message, one op
                last[slot] = b.transfer(term[1], r, (I, r), dst, reduce=True, reduce_with=(I, r))
            elif kind == "start":
                got = b.transfer(term[1], r, (I, r), dst)
                last[slot] = b.transfer(step[3][1], r, (I, r), dst, reduce=True, recv_after=[got])
            elif term[0] == "remote":
                last[slot] = b.transfer(term[1], r, (I, r), dst, reduce=True, recv_after=after)
            elif term[0] == "own":
                last[slot] = b.reduce(r, (I, r), dst, after=after)
            else:
                last[slot] = b.reduce(r, where[term[1]], dst, after=[*after, last[term[1]]])


def _size(tree: GlooTree) -> int:
    """The number of ranks (leaves) of ``tree``."""
    return 1 if isinstance(tree, int) else _size(tree[0]) + _size(tree[1])
