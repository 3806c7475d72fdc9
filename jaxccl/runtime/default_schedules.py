"""Default schedules of a communicator without a topology (one process, ranks sharing memory).

Direct, never relayed: every message goes from the rank that has the data
straight to the rank that needs it, and the compiled table marks such sends
*direct* (the receiver copies from the sender's buffer in place), so each
block is moved once and no rank waits for a chain of hand-offs. Reductions
fold every contribution in ascending rank order ``((x0 + x1) + x2) + ...``,
the order XLA:CPU uses, so results are bitwise equal to ``jax.lax``. They are
schedules like any other: the reference interpreter validates them.

>>> direct_allgather(4).validate().num_ranks
4
>>> direct_allreduce(4).validate(ordered_reduction=True).chunks_per_period
4
"""

from __future__ import annotations

from jaxccl.schedule import Buffer, Schedule, ScheduleBuilder

__all__ = ["direct_allgather", "direct_allreduce"]

I, O = Buffer.INPUT, Buffer.OUTPUT


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
