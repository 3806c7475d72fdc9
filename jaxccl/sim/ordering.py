"""Which ops of a threadblock must wait for which: the order a dataflow executor keeps.

A threadblock's op list is a program, but most of its order is incidental: an
op that sends chunk 5 need not wait for an earlier op that receives chunk 9.
Readiness-driven (dataflow) execution keeps only the order that the data needs,
so that an op whose data is ready never waits behind an unrelated op of its
threadblock that is still waiting (no head-of-line blocking). Op ``j`` waits
for an earlier op ``i`` of its threadblock when:

* they touch overlapping chunks of one buffer and at least one of them writes
  them (read after write, write after read, write after write); or
* either is a ``nop``: a ``nop`` starts after every earlier op of its
  threadblock and every later op starts after it (MSCCL encodes extra
  dependencies as ``nop`` rows in front of an op, relying on this order).

Explicit ``deps``, the send/receive matching of a connection (the k-th send
meets the k-th receive) and its slots stay as they are. Everything a dataflow
execution can do, an in-order one can too (the order kept is a subset of
program order), so dataflow never deadlocks where in-order execution does not.

Only the nearest conflicting op per chunk is named (the last writer; the
readers since it), which implies the rest transitively.

>>> from jaxccl.schedule import Buffer, Op, OpKind, Threadblock
>>> I, O = Buffer.INPUT, Buffer.OUTPUT
>>> tb = Threadblock(
...     (Op(OpKind.RECV, O, 2, O, 2), Op(OpKind.SEND, I, 0, O, 0), Op(OpKind.SEND, O, 2, O, 2)),
...     send_peer=1, recv_peer=2)
>>> threadblock_order(tb)  # the second send waits for the receive of its chunk, not the first send
[(0, 2)]
"""

from __future__ import annotations

from jaxccl.schedule.ir import OpKind, Threadblock

__all__ = ["threadblock_order"]


def threadblock_order(tb: Threadblock) -> list[tuple[int, int]]:
    """The ``(earlier, later)`` op index pairs of ``tb`` that dataflow execution keeps (see the module docstring).

    Args:
        tb: one threadblock.

    Returns:
        Pairs ``(i, j)`` with ``i < j``, sorted: op ``j`` starts only after op
        ``i`` completed.
    """
    last_writer: dict[tuple[int, int], int] = {}
    readers: dict[tuple[int, int], list[int]] = {}
    barrier = -1  # the last nop
    since_barrier: list[int] = []
    pairs: set[tuple[int, int]] = set()
    for j, op in enumerate(tb.ops):
        if op.kind is OpKind.NOP:
            pairs.update((i, j) for i in since_barrier)
            if barrier >= 0:
                pairs.add((barrier, j))
            barrier, since_barrier = j, []
            continue
        if barrier >= 0:
            pairs.add((barrier, j))
        since_barrier.append(j)
        reads = [(int(op.src), c) for c in range(op.src_off, op.src_off + op.count)] if op.kind.reads_src else []
        writes = [(int(op.dst), c) for c in range(op.dst_off, op.dst_off + op.count)] if op.kind.writes_dst else []
        for key in reads + writes:
            w = last_writer.get(key)
            if w is not None:
                pairs.add((w, j))
        for key in writes:
            pairs.update((r, j) for r in readers.get(key, ()))
        for key in reads:
            readers.setdefault(key, []).append(j)
        for key in writes:
            last_writer[key] = j
            readers[key] = []
    return sorted(pairs)
