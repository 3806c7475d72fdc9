"""A pattern (with its placement) as a jaxccl :class:`~jaxccl.schedule.Schedule`.

Layout. AllReduce: ``C`` = number of chunk graphs; chunk graph ``g`` works on
chunk ``g`` and every device keeps its running value of chunk ``g`` in output
chunk ``g`` (first copied from its input). AllGather: ``C = 1``; the block of
device ``d`` lives in output chunk ``d`` on every device.

Ops. Each flow becomes a send on the sender's threadblock towards the receiver
(one per ``(peer, channel)``, the channel of the flow's chunk graph) and a
receive on the receiver's threadblock from the sender: ``rrc`` for a
``REDUCE`` (output chunk += message), ``r`` for a ``COPY`` or ``GATHER``. An
AllGather flow sends only the blocks its receiver does not hold yet (see
:mod:`jaxccl.tune.react.semantics`), one message per contiguous run of blocks.

Order and dependencies. Ops are emitted step by step -- the sends of step
``t`` (they read what the sender holds at time ``t``), then the receives of
step ``t`` -- and every op waits (``deps``) for the ops of other threadblocks
of its rank that last wrote the chunks it touches and, if it writes them, for
those that read them since. Every dependency, program-order predecessor,
matching send and slot-freeing receive of an op is emitted before it, so the
schedule cannot deadlock for any number of slots, and the interpreter's race
check holds by construction.

Reduction order. A transformed pattern sums in another order than
``jax.lax`` (``info["ordered_reduction"]`` is false): results are bitwise equal
to ``jax.lax.psum`` only for integer dtypes; for floats the interpreter checks
the *set* of contributions of every output chunk (symbolic provenance), which
is what REACT preserves.

Example:
    >>> from jaxccl.tune.react.pattern import double_binary_tree_pattern
    >>> c = compile_pattern(double_binary_tree_pattern(8))
    >>> c.schedule.validate().chunks_per_period, len(c.send_ops)
    (2, 28)
"""

from __future__ import annotations

import dataclasses

from jaxccl.schedule.builder import Handle, ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Collective, OpKind, Schedule
from jaxccl.tune.react.pattern import FlowKind, Pattern

__all__ = ["CompiledPattern", "compile_pattern"]

I, O = Buffer.INPUT, Buffer.OUTPUT
OpKey = tuple[int, int, int]  # (rank, threadblock, op)


@dataclasses.dataclass(frozen=True)
class CompiledPattern:
    """A pattern and its schedule, with the map between flows and sending ops.

    Attributes:
        pattern: what was compiled.
        schedule: the :class:`~jaxccl.schedule.Schedule`.
        send_ops: ``(rank, threadblock, op)`` of every sending op -> the flow it belongs to.
        flow_ops: per flow, its sending ops (empty for an AllGather flow with nothing new to send).
    """

    pattern: Pattern
    schedule: Schedule
    send_ops: dict[OpKey, int]
    flow_ops: tuple[tuple[OpKey, ...], ...]


class _Hazards:
    """Per rank, the op that last wrote each output chunk and those that read it since.

    :meth:`after` names the ops a new op must wait for: the last writer of
    every chunk it reads or writes and, if it writes a chunk, the readers of
    that chunk since (read-after-write, write-after-write, write-after-read).
    """

    def __init__(self, n: int):
        self.writer: list[dict[int, Handle]] = [{} for _ in range(n)]
        self.readers: list[dict[int, list[Handle]]] = [{} for _ in range(n)]

    def after(self, rank: int, reads: range, writes: range) -> list[Handle]:
        writer, readers = self.writer[rank], self.readers[rank]
        deps = [writer[c] for c in reads if c in writer]
        for c in writes:
            if c in writer:
                deps.append(writer[c])
            deps.extend(readers.get(c, ()))
        return deps

    def record(self, op: Handle, reads: range, writes: range) -> None:
        writer, readers = self.writer[op.rank], self.readers[op.rank]
        for c in reads:
            readers.setdefault(c, []).append(op)
        for c in writes:
            writer[c] = op
            readers[c] = []


def _emit(
    builder: ScheduleBuilder,
    hazards: _Hazards,
    rank: int,
    tb: int,
    kind: OpKind,
    src: tuple[Buffer, int],
    dst: tuple[Buffer, int],
    count: int,
    reads: range,
    writes: range,
) -> OpKey:
    """Appends an op reading/writing output chunks ``reads``/``writes``, with the deps that order it."""
    handle = builder.op(rank, tb, kind, src, dst, count, after=hazards.after(rank, reads, writes))
    hazards.record(handle, reads, writes)
    return (handle.rank, handle.tb, handle.op)


def _runs(mask: int) -> list[tuple[int, int]]:
    """Contiguous runs ``(start, length)`` of the set bits of ``mask``."""
    out = []
    b = 0
    while mask >> b:
        if mask >> b & 1:
            start = b
            while mask >> b & 1:
                b += 1
            out.append((start, b - start))
        else:
            b += 1
    return out


def compile_pattern(pattern: Pattern) -> CompiledPattern:
    """Compiles ``pattern`` (see the module docstring); the result is checkable with ``schedule.validate()``.

    A pattern that fails the bitvector check still compiles: its schedule then
    fails the interpreter with the same problem, which the tests use to
    cross-check the two.
    """
    n = pattern.num_ranks
    gather = pattern.collective is Collective.ALL_GATHER
    c = pattern.chunks_per_period
    prog = ScheduleBuilder(pattern.collective, n, c)
    hazards = _Hazards(n)
    for r in range(n):
        local = prog.threadblock(r)
        if gather:
            _emit(prog, hazards, r, local, OpKind.COPY, (I, 0), (O, r), 1, range(0), range(r, r + 1))
        else:
            _emit(prog, hazards, r, local, OpKind.COPY, (I, 0), (O, 0), c, range(0), range(c))
    sem = pattern.semantics
    src_dev, dst_dev = pattern.src_device, pattern.dst_device
    flow_ops: list[list[OpKey]] = [[] for _ in range(pattern.num_flows)]
    send_ops: dict[OpKey, int] = {}
    flows = pattern.flows
    i = 0
    while i < len(flows):
        t = flows[i].step
        j = i
        while j < len(flows) and flows[j].step == t:
            j += 1
        plan = []
        for f in flows[i:j]:
            a, b = int(src_dev[f.index]), int(dst_dev[f.index])
            chan = pattern.channels[f.chunk_graph]
            runs = _runs(sem.message[f.index]) if gather else [(f.chunk_graph, 1)]
            plan.append((f, a, b, chan, runs))
        for f, a, b, chan, runs in plan:
            tb = prog.threadblock(a, send_peer=b, channel=chan)
            for off, cnt in runs:
                span = range(off, off + cnt)
                key = _emit(prog, hazards, a, tb, OpKind.SEND, (O, off), (O, off), cnt, span, range(0))
                flow_ops[f.index].append(key)
                send_ops[key] = f.index
        for f, a, b, chan, runs in plan:
            tb = prog.threadblock(b, recv_peer=a, channel=chan)
            for off, cnt in runs:
                span = range(off, off + cnt)
                if f.kind is FlowKind.REDUCE:
                    _emit(prog, hazards, b, tb, OpKind.RECV_REDUCE_COPY, (O, off), (O, off), cnt, span, span)
                else:
                    _emit(prog, hazards, b, tb, OpKind.RECV, (O, off), (O, off), cnt, range(0), span)
        i = j
    info = {
        "algorithm": pattern.info.get("algorithm", pattern.name),
        "react_pattern": pattern.name,
        "transformed": not pattern.is_identity(),
        "ordered_reduction": False,
    }
    schedule = prog.build(name=f"react_{pattern.name}", info=info)
    return CompiledPattern(pattern, schedule, send_ops, tuple(tuple(x) for x in flow_ops))
