"""Building schedules op by op or from logical transfers.

:class:`ScheduleBuilder` is the one way jaxccl's synthesizers write
programs. It works at two levels:

- *Transfers* (:meth:`~ScheduleBuilder.transfer`, :meth:`~ScheduleBuilder.copy`,
  :meth:`~ScheduleBuilder.reduce`): "rank a sends these chunks to rank b once
  it has them". Each rank gets one threadblock per (send peer, channel) and
  one per (receive peer, channel), so receiving threadblocks never wait on
  anything but their messages: when every ``after=`` handle names an earlier
  call, the schedule is deadlock-free for any number of slots >= 1.
- *Ops on threadblocks* (:meth:`~ScheduleBuilder.threadblock`,
  :meth:`~ScheduleBuilder.op`): the caller picks the threadblock by its
  ``(send peer, receive peer, channel)`` and the op kind, e.g. a ring's fused
  ``rcs``/``rrs``/``rrcs`` ops on one threadblock per ring and channel, as
  NCCL's ring kernels run them. The caller is then responsible for the
  matching of sends and receives (``Schedule.validate()`` checks it).

Both levels share the threadblock table: a threadblock is identified by
``(rank, send peer, receive peer, channel)`` and numbered by first use.
Equal ops (same kind, buffers, offsets, count and dependencies) are one
shared immutable :class:`~jaxccl.schedule.ir.Op` object, which keeps
schedules of 10^5..10^6 ops fast to build and small in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock

Loc = tuple[Buffer, int]
TbKey = tuple[int, int, int]  # (send peer, receive peer, channel); -1: none

_LOCAL: TbKey = (-1, -1, 0)


_new_handle = tuple.__new__  # Handle(...) without NamedTuple's Python-level __new__ (2x faster)


class Handle(NamedTuple):
    """Identifies one op: ``(rank, threadblock index, op index)``.

    >>> Handle(0, 1, 2).tb
    1
    """

    rank: int
    tb: int
    op: int


class ScheduleBuilder:
    """Accumulates ops per rank and builds a :class:`Schedule`.

    Example (a 2-rank all_gather from transfers):
        >>> from jaxccl.schedule import Buffer, ScheduleBuilder
        >>> b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
        >>> for r in range(2):
        ...     _ = b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        ...     _ = b.transfer(r, 1 - r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        >>> s = b.build(name="pair").validate()
        >>> s.num_threadblocks
        6

    Example (the same with one threadblock per peer, ops placed by hand):
        >>> from jaxccl.schedule import OpKind
        >>> b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
        >>> for r in range(2):
        ...     tb = b.threadblock(r, send_peer=1 - r, recv_peer=1 - r)
        ...     _ = b.op(r, tb, OpKind.SEND, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        ...     _ = b.op(r, tb, OpKind.COPY, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        ...     _ = b.op(r, tb, OpKind.RECV, (Buffer.INPUT, 0), (Buffer.OUTPUT, 1 - r))
        >>> b.build(name="pair").validate().num_threadblocks
        2
    """

    def __init__(
        self,
        collective: Collective | str,
        num_ranks: int,
        chunks_per_period: int,
        *,
        scratch_chunks: int = 0,
    ):
        self.collective = Collective(collective)
        self.num_ranks = int(num_ranks)
        self.chunks_per_period = int(chunks_per_period)
        self.scratch_chunks = int(scratch_chunks)
        self._keys: list[dict[TbKey, int]] = [{} for _ in range(self.num_ranks)]
        self._tbs: list[list[tuple[TbKey, list[Op]]]] = [[] for _ in range(self.num_ranks)]
        self._interned: dict[tuple, Op] = {}

    # ------------------------------------------------------------ op level
    def threadblock(self, rank: int, *, send_peer: int = -1, recv_peer: int = -1, channel: int = 0) -> int:
        """The index of ``rank``'s threadblock for ``(send_peer, recv_peer, channel)``, created on first use.

        ``-1`` means no peer; ``threadblock(rank)`` is the rank's local
        threadblock (the one :meth:`copy` and :meth:`reduce` use).
        """
        if not 0 <= rank < self.num_ranks:
            self._check_rank(rank)
        key = (send_peer, recv_peer, channel)
        keys = self._keys[rank]
        idx = keys.get(key)
        if idx is None:
            tbs = self._tbs[rank]
            idx = keys[key] = len(tbs)
            tbs.append((key, []))
        return idx

    def op(
        self,
        rank: int,
        tb: int,
        kind: OpKind,
        src: Loc | None = None,
        dst: Loc | None = None,
        count: int = 1,
        *,
        after: Iterable[Handle | None] = (),
    ) -> Handle:
        """Appends an op to threadblock ``tb`` of ``rank``; returns its handle.

        Args:
            rank: the rank.
            tb: an index from :meth:`threadblock`.
            kind: the op kind.
            src, dst: ``(buffer, chunk offset)`` or None where the op has none.
            count: chunks moved.
            after: handles of ops on the same rank this op waits for (None
                entries are skipped; ops of ``tb`` itself are already ordered).

        Raises:
            ScheduleError: an unknown rank or threadblock, a dependency on
                another rank, or a malformed op.
        """
        if rank < 0 or tb < 0:
            raise ScheduleError(f"no threadblock {tb} on rank {rank}")
        try:
            ops = self._tbs[rank][tb][1]
        except IndexError:
            self._check_rank(rank)
            raise ScheduleError(f"rank {rank} has no threadblock {tb} (it has {len(self._tbs[rank])})") from None
        deps = self._deps(rank, tb, after) if after else ()
        key = (kind, src, dst, count, deps)
        try:
            op = self._interned.get(key)
        except TypeError:
            raise ScheduleError(f"src/dst must be (buffer, offset) tuples, got {src!r} and {dst!r}") from None
        if op is None:
            op = self._interned[key] = Op(
                kind,
                None if src is None else Buffer(src[0]),
                0 if src is None else int(src[1]),
                None if dst is None else Buffer(dst[0]),
                0 if dst is None else int(dst[1]),
                int(count),
                deps,
            )
        ops.append(op)
        return _new_handle(Handle, (rank, tb, len(ops) - 1))

    # ------------------------------------------------------ transfer level
    def copy(self, rank: int, src: Loc, dst: Loc, count: int = 1, *, after: Iterable[Handle] = ()) -> Handle:
        """A local copy on ``rank`` (in its local threadblock)."""
        return self.op(rank, self.threadblock(rank), OpKind.COPY, src, dst, count, after=after)

    def reduce(self, rank: int, src: Loc, dst: Loc, count: int = 1, *, after: Iterable[Handle] = ()) -> Handle:
        """A local ``dst = dst + src`` on ``rank``."""
        return self.op(rank, self.threadblock(rank), OpKind.REDUCE, src, dst, count, after=after)

    def transfer(
        self,
        src_rank: int,
        dst_rank: int,
        src: Loc,
        dst: Loc,
        count: int = 1,
        *,
        channel: int = 0,
        after: Iterable[Handle] = (),
        reduce: bool = False,
        reduce_with: Loc | None = None,
        recv_after: Iterable[Handle] = (),
    ) -> Handle:
        """Sends ``count`` chunks from ``src`` on ``src_rank`` to ``dst`` on ``dst_rank``.

        ``after`` are handles on ``src_rank`` the send waits for (e.g. the
        receive that brought the data). With ``reduce=True`` the receiver
        stores ``reduce_with + incoming`` into ``dst`` (``reduce_with``
        defaults to ``dst``); ``recv_after`` are handles on ``dst_rank`` the
        receive waits for (e.g. the op that last wrote ``reduce_with``).
        Returns the handle of the receiving op.
        """
        self._check_rank(src_rank)
        self._check_rank(dst_rank)
        if src_rank == dst_rank:
            raise ScheduleError(f"transfer from rank {src_rank} to itself; use copy()")
        stb = self.threadblock(src_rank, send_peer=dst_rank, channel=channel)
        rtb = self.threadblock(dst_rank, recv_peer=src_rank, channel=channel)
        self.op(src_rank, stb, OpKind.SEND, src, dst, count, after=after)
        if reduce:
            return self.op(dst_rank, rtb, OpKind.RECV_REDUCE_COPY, reduce_with or dst, dst, count, after=recv_after)
        return self.op(dst_rank, rtb, OpKind.RECV, src, dst, count, after=recv_after)

    # ---------------------------------------------------------------- build
    def build(self, **kwargs: Any) -> Schedule:
        """The :class:`Schedule`; ``kwargs`` go to its constructor (name, algbw, bound, info)."""
        ranks = tuple(
            tuple(Threadblock(tuple(ops), send, recv, chan) for (send, recv, chan), ops in tbs) for tbs in self._tbs
        )
        return Schedule(
            collective=self.collective,
            num_ranks=self.num_ranks,
            chunks_per_period=self.chunks_per_period,
            scratch_chunks=self.scratch_chunks,
            ranks=ranks,
            **kwargs,
        )

    # -------------------------------------------------------------- helpers
    def _check_rank(self, r: int) -> None:
        if not 0 <= r < self.num_ranks:
            raise ScheduleError(f"rank {r} out of range 0..{self.num_ranks - 1}")

    def _deps(self, rank: int, tb: int, after: Iterable[Handle | None]) -> tuple[tuple[int, int], ...]:
        """``(threadblock, op)`` pairs of ``after`` outside ``tb``, sorted; all must be on ``rank``."""
        waits = set()
        for h in after:
            if h is None:
                continue
            if h.rank != rank:
                raise ScheduleError(f"dependency {h} is on rank {h.rank}, not on rank {rank}")
            if h.tb != tb:
                waits.add((h.tb, h.op))
        return tuple(sorted(waits))
