"""In-place MSCCL programs, run out-of-place.

msccl-tools writes *in-place* algorithms (``inplace="1"``) for one buffer per
rank that starts as the input and ends as the output; its steps name that
buffer through one or both of ``i`` and ``o`` (msccl-tools'
``get_buffer_index``):

============== ============================ ============================
collective     the in-place buffer B         how ``i`` / ``o`` index B
============== ============================ ============================
allgather      ``N*C`` chunks (the output)   ``o[k] = B[k]``, ``i[k] = B[r*C + k]``
allreduce      ``C`` chunks                  ``i[k] = o[k] = B[k]``
reducescatter  ``N*C`` chunks (the input)    ``i[k] = B[k]``, ``o[k] = B[r*C + k]``
alltoall       ``N*C`` chunks                ``i[k] = o[k] = B[k]``
============== ============================ ============================

jaxccl's buffers are out-of-place (inputs read-only), so :func:`out_of_place`
places B in the output buffer when it has B's size (allgather, allreduce,
alltoall) and in scratch otherwise (reducescatter, at an offset that is a
multiple of ``C`` so every chunk keeps its class), and adds one peerless
threadblock per rank: a copy of the input into B, which every op touching
those chunks depends on, and, when B lives in scratch, a copy of the rank's
result out of B after the last op of every threadblock that writes it. The
translated program moves the same messages as the original; it costs one
local copy of the input (and of the result) per rank.

Example:
    >>> from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock
    >>> send = lambda peer, off: Threadblock((Op(OpKind.SEND, Buffer.OUTPUT, off, Buffer.OUTPUT, off),), peer, -1)
    >>> recv = lambda peer, off: Threadblock((Op(OpKind.RECV, Buffer.OUTPUT, off, Buffer.OUTPUT, off),), -1, peer)
    >>> in_place = Schedule(Collective.ALL_GATHER, 2, 1, ((send(1, 0), recv(1, 1)), (send(0, 1), recv(0, 0))))
    >>> s = out_of_place(in_place)
    >>> s.ranks[0][2].ops[0]  # the input copied into its place in the output
    Op(kind=<OpKind.COPY: 'cpy'>, src=<Buffer.INPUT: 0>, src_off=0, dst=<Buffer.OUTPUT: 1>, dst_off=0, count=1, deps=())
    >>> s.validate() is s
    True
"""

from __future__ import annotations

import dataclasses

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock

__all__ = ["out_of_place"]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the pieces of one rank's in-place buffer B are, in chunks."""

    size: int  # chunks of B
    views: dict[Buffer, tuple[int, int]]  # XML buffer -> (offset in B, chunks it may address)
    input_at: int  # where the rank's input starts in B
    output_at: int  # where the rank's result starts in B


def _layout(coll: Collective, n: int, c: int, r: int) -> _Layout:
    if coll is Collective.ALL_GATHER:
        return _Layout(n * c, {Buffer.OUTPUT: (0, n * c), Buffer.INPUT: (r * c, c)}, r * c, 0)
    if coll is Collective.ALL_REDUCE:
        return _Layout(c, {Buffer.INPUT: (0, c), Buffer.OUTPUT: (0, c)}, 0, 0)
    if coll is Collective.REDUCE_SCATTER:
        return _Layout(n * c, {Buffer.INPUT: (0, n * c), Buffer.OUTPUT: (r * c, c)}, 0, r * c)
    return _Layout(n * c, {Buffer.INPUT: (0, n * c), Buffer.OUTPUT: (0, n * c)}, 0, 0)


def out_of_place(schedule: Schedule) -> Schedule:
    """The out-of-place equivalent of an in-place program (see the module docstring).

    ``schedule`` holds the in-place program with its buffer references as
    written (``i``/``o`` meaning B). The result is not validated.

    Raises:
        ScheduleError: a step addresses a chunk outside the part of B its
            buffer name may reach.
    """
    coll, n, c = schedule.collective, schedule.num_ranks, schedule.chunks_per_period
    in_chunks, out_chunks = coll.buffer_chunks(n, c)
    b_size = _layout(coll, n, c, 0).size
    if out_chunks == b_size:
        home, base, scratch = Buffer.OUTPUT, 0, schedule.scratch_chunks
    else:
        base = -(-schedule.scratch_chunks // c) * c  # a multiple of C: chunk classes stay as they were
        home, scratch = Buffer.SCRATCH, base + b_size
    ranks = []
    for r, tbs in enumerate(schedule.ranks):
        lay = _layout(coll, n, c, r)
        copy_in = len(tbs)  # the added threadblock; its op 0 copies the input into B
        init = (base + lay.input_at, base + lay.input_at + in_chunks)
        result = (base + lay.output_at, base + lay.output_at + out_chunks)
        new_tbs, last_writers = [], []
        for t, tb in enumerate(tbs):
            ops, last = [], None
            for i, op in enumerate(tb.ops):
                where = f"rank {r} threadblock {t} op {i} ({op.kind.value})"
                src_lay = _side_layout(coll, n, c, r, tb.recv_peer, op.kind.reads_src)
                dst_lay = _side_layout(coll, n, c, r, tb.send_peer, op.kind.writes_dst)
                src, src_off = _locate(op.src, op.src_off, op.count, src_lay, home, base, where)
                dst, dst_off = _locate(op.dst, op.dst_off, op.count, dst_lay, home, base, where)
                deps = op.deps
                touched = (op.kind.reads_src and src is home and _overlaps(src_off, op.count, init)) or (
                    op.kind.writes_dst and dst is home and _overlaps(dst_off, op.count, init)
                )
                if touched:
                    deps = (*deps, (copy_in, 0))
                if op.kind.writes_dst and dst is home and _overlaps(dst_off, op.count, result):
                    last = (t, i)
                ops.append(dataclasses.replace(op, src=src, src_off=src_off, dst=dst, dst_off=dst_off, deps=deps))
            new_tbs.append(dataclasses.replace(tb, ops=tuple(ops)))
            if last is not None:
                last_writers.append(last)
        local = [Op(OpKind.COPY, Buffer.INPUT, 0, home, init[0], in_chunks)]
        if home is Buffer.SCRATCH:
            local.append(Op(OpKind.COPY, home, result[0], Buffer.OUTPUT, 0, out_chunks, tuple(last_writers)))
        new_tbs.append(Threadblock(tuple(local), -1, -1, 0))
        ranks.append(tuple(new_tbs))
    info = {**schedule.info, "msccl_inplace": True}
    return dataclasses.replace(schedule, ranks=tuple(ranks), scratch_chunks=scratch, info=info)


def _side_layout(coll: Collective, n: int, c: int, r: int, peer: int, local: bool) -> _Layout:
    """The layout one end of an op is in: this rank's, or the peer's for the informational remote end."""
    return _layout(coll, n, c, r if local or not 0 <= peer < n else peer)


def _locate(
    buf: Buffer | None, off: int, count: int, lay: _Layout, home: Buffer, base: int, where: str
) -> tuple[Buffer | None, int]:
    """Where an ``i``/``o`` reference of the in-place program lands in ``home``; scratch and absent stay."""
    if buf is None or buf is Buffer.SCRATCH:
        return buf, off
    start, reach = lay.views[buf]
    if off + count > reach:
        raise ScheduleError(
            f"in-place MSCCL XML: {where} addresses {buf.xml}[{off}:{off + count}], but {buf.xml} reaches "
            f"{reach} chunk(s) of the in-place buffer"
        )
    return home, base + start + off


def _overlaps(off: int, count: int, span: tuple[int, int]) -> bool:
    return off < span[1] and span[0] < off + count
