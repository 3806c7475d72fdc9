"""Building schedules from logical transfers.

Synthesizers think in transfers ("rank a sends these chunks to rank b once it
has them"); :class:`ScheduleBuilder` turns them into threadblocks with the
right op order and cross-threadblock dependencies. Each rank gets one
threadblock per (send peer, channel) and one per (receive peer, channel), so
receiving threadblocks never wait on anything but their messages: when every
``after=`` handle names an earlier call, the schedule is deadlock-free for any
number of slots >= 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock

Loc = tuple[Buffer, int]


@dataclasses.dataclass(frozen=True)
class Handle:
    """Identifies one op: ``(rank, threadblock index, op index)``."""

    rank: int
    tb: int
    op: int


@dataclasses.dataclass
class _TB:
    send_peer: int
    recv_peer: int
    channel: int
    ops: list[Op] = dataclasses.field(default_factory=list)


class ScheduleBuilder:
    """Accumulates ops per rank and builds a :class:`Schedule`.

    Example (a 2-rank all_gather):
        >>> from jaxccl.schedule import Buffer, ScheduleBuilder
        >>> b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
        >>> for r in range(2):
        ...     _ = b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        ...     _ = b.transfer(r, 1 - r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        >>> s = b.build(name="pair").validate()
        >>> s.num_threadblocks
        6
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
        self._tbs: list[list[_TB]] = [[] for _ in range(self.num_ranks)]
        self._local: list[int | None] = [None] * self.num_ranks
        self._send_tb: dict[tuple[int, int, int], int] = {}
        self._recv_tb: dict[tuple[int, int, int], int] = {}

    # ---------------------------------------------------------------- helpers
    def _check_rank(self, r: int) -> None:
        if not 0 <= r < self.num_ranks:
            raise ScheduleError(f"rank {r} out of range 0..{self.num_ranks - 1}")

    def _tb_index(self, rank: int, key: tuple[int, int, int] | None, send: int, recv: int, chan: int) -> int:
        table = self._send_tb if send >= 0 else self._recv_tb
        if key is None:
            if self._local[rank] is None:
                self._tbs[rank].append(_TB(-1, -1, chan))
                self._local[rank] = len(self._tbs[rank]) - 1
            return self._local[rank]  # type: ignore[return-value]
        idx = table.get(key)
        if idx is None:
            self._tbs[rank].append(_TB(send, recv, chan))
            idx = len(self._tbs[rank]) - 1
            table[key] = idx
        return idx

    def _append(
        self, rank: int, tb: int, kind: OpKind, src: Loc | None, dst: Loc | None, count: int, after: Iterable[Handle]
    ) -> Handle:
        deps = []
        for h in after:
            if h is None:
                continue
            if h.rank != rank:
                raise ScheduleError(f"dependency {h} is on rank {h.rank}, not on rank {rank}")
            if h.tb != tb:
                deps.append((h.tb, h.op))
        deps = sorted(set(deps))
        op = Op(
            kind,
            None if src is None else Buffer(src[0]),
            0 if src is None else int(src[1]),
            None if dst is None else Buffer(dst[0]),
            0 if dst is None else int(dst[1]),
            int(count),
            tuple(deps),
        )
        ops = self._tbs[rank][tb].ops
        ops.append(op)
        return Handle(rank, tb, len(ops) - 1)

    # -------------------------------------------------------------------- API
    def copy(self, rank: int, src: Loc, dst: Loc, count: int = 1, *, after: Iterable[Handle] = ()) -> Handle:
        """A local copy on ``rank`` (in its local threadblock)."""
        self._check_rank(rank)
        tb = self._tb_index(rank, None, -1, -1, 0)
        return self._append(rank, tb, OpKind.COPY, src, dst, count, after)

    def reduce(self, rank: int, src: Loc, dst: Loc, count: int = 1, *, after: Iterable[Handle] = ()) -> Handle:
        """A local ``dst = dst + src`` on ``rank``."""
        self._check_rank(rank)
        tb = self._tb_index(rank, None, -1, -1, 0)
        return self._append(rank, tb, OpKind.REDUCE, src, dst, count, after)

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
        stb = self._tb_index(src_rank, (src_rank, dst_rank, channel), dst_rank, -1, channel)
        rtb = self._tb_index(dst_rank, (dst_rank, src_rank, channel), -1, src_rank, channel)
        self._append(src_rank, stb, OpKind.SEND, src, dst, count, after)
        if reduce:
            return self._append(dst_rank, rtb, OpKind.RECV_REDUCE_COPY, reduce_with or dst, dst, count, recv_after)
        return self._append(dst_rank, rtb, OpKind.RECV, src, dst, count, recv_after)

    def build(self, **kwargs: Any) -> Schedule:
        """The :class:`Schedule`; ``kwargs`` go to its constructor (name, algbw, bound, info)."""
        ranks = tuple(
            tuple(Threadblock(tuple(t.ops), t.send_peer, t.recv_peer, t.channel) for t in tbs) for tbs in self._tbs
        )
        return Schedule(
            collective=self.collective,
            num_ranks=self.num_ranks,
            chunks_per_period=self.chunks_per_period,
            scratch_chunks=self.scratch_chunks,
            ranks=ranks,
            **kwargs,
        )
