"""Compiling a :class:`~jaxccl.schedule.Schedule` into the flat ``int32`` table the executors interpret.

The format is "Compiled table (version 2)" of ``docs/schedule-ir.md``: a
16-word header, a rank table (``N x 2``), a threadblock table (``T x 8``) and
an op table (``O x 10``). The native executors (``xla_ffi/host/table.cc``) check
every word again before they run a table.

A table is *sealed*: header word 14 holds the CRC-32 (zlib's) of all its other
words, so the registry refuses a table that changed after it was compiled
(:func:`checksum`, :func:`seal`). A table declares exactly the scratch chunks
its ops use (scratch no op touches is never allocated).

Two things happen here beyond copying fields:

* **Dependencies.** An op with more than one dependency becomes a chain of
  ``nop`` ops in front of it, one dependency each; op indices named by
  dependencies are remapped to the expanded threadblocks.
* **Direct sends.** A sending op is marked *direct* (the receiver reads the
  sender's buffer in place instead of a staged copy) when its source range is
  never written after the send: the source is ``INPUT`` (read-only for the
  executors), or every write of every chunk of the range in the whole rank
  program happens-before the send (program order plus dependencies), so none
  comes after it. ``rrs`` sends a sum that exists nowhere else, so it is never
  direct.

Example:
    >>> from jaxccl.schedule import Buffer, ScheduleBuilder
    >>> from jaxccl.schedule.table import checksum, compile_table, header
    >>> b = ScheduleBuilder("all_gather", num_ranks=2, chunks_per_period=1)
    >>> for r in range(2):
    ...     _ = b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    ...     _ = b.transfer(r, 1 - r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    >>> t = compile_table(b.build())
    >>> header(t)["num_threadblocks"], header(t)["num_connections"]
    (6, 2)
    >>> header(t)["checksum"] == checksum(t)
    True
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock, make_schedule

MAGIC = 0x4C43434A  # "JCCL" little-endian
VERSION = 2
HEADER_WORDS = 16
RANK_WORDS = 2
TB_WORDS = 8
OP_WORDS = 10
DIGEST_WORD = 12
CHECKSUM_WORD = 14
_UNSIGNED_HEADER_WORDS = (0, DIGEST_WORD, CHECKSUM_WORD)  # magic, digest, checksum: 32-bit patterns, not counts

FLAG_ORDERED_REDUCTION = 1
OP_FLAG_DIRECT = 1

HEADER_FIELDS = (
    "magic",
    "version",
    "collective",
    "num_ranks",
    "chunks_per_period",
    "input_chunks",
    "output_chunks",
    "scratch_chunks",
    "num_slots",
    "num_threadblocks",
    "num_ops",
    "flags",
    "digest_low32",
    "num_connections",
    "checksum",
    "reserved",
)
TB_FIELDS = ("rank", "send_peer", "recv_peer", "channel", "first_op", "num_ops", "send_conn", "recv_conn")
OP_FIELDS = ("kind", "src_buf", "src_off", "dst_buf", "dst_off", "count", "dep_tb", "dep_op", "flags", "reserved")

# Which of (src, dst) each op kind uses in the table; unused fields are (-1, 0).
_USES_SRC = frozenset(
    {OpKind.SEND, OpKind.RECV_REDUCE_COPY, OpKind.RECV_REDUCE_SEND, OpKind.RECV_REDUCE_COPY_SEND, OpKind.COPY}
    | {OpKind.REDUCE}
)
_USES_DST = frozenset(
    {OpKind.RECV, OpKind.RECV_COPY_SEND, OpKind.RECV_REDUCE_COPY, OpKind.RECV_REDUCE_COPY_SEND, OpKind.COPY}
    | {OpKind.REDUCE}
)


def _send_source(op: Any) -> tuple[Buffer, int]:
    """Where the outgoing message of a sending op is read from (``rrs``: its ``src`` operand)."""
    if op.kind in (OpKind.RECV_COPY_SEND, OpKind.RECV_REDUCE_COPY_SEND):
        return op.dst, op.dst_off
    return op.src, op.src_off


def _recv_target_offset(op: Any) -> int:
    """The chunk offset whose class an incoming message must match."""
    return op.src_off if op.kind is OpKind.RECV_REDUCE_SEND else op.dst_off


def compile_table(schedule: Schedule, num_slots: int = 8) -> np.ndarray:
    """Compiles ``schedule`` into the version-2 table of ``docs/schedule-ir.md``.

    Args:
        schedule: the schedule; it is not validated here (call
            :meth:`Schedule.validate` first), but structural errors (bad peers,
            ranges, dependencies, unmatched connections) raise.
        num_slots: message slots per connection (``>= 1``); a send blocks
            while its connection holds this many unconsumed messages.

    Returns:
        A 1-D little-endian ``int32`` array.

    Raises:
        ScheduleError: naming the rank, threadblock and op that cannot be compiled.

    Example:
        >>> from jaxccl.schedule import Buffer, ScheduleBuilder
        >>> b = ScheduleBuilder("all_reduce", num_ranks=1, chunks_per_period=1)
        >>> _ = b.copy(0, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0))
        >>> compile_table(b.build())[:2].tolist() == [MAGIC, VERSION]
        True
    """
    if int(num_slots) < 1:
        raise ScheduleError(f"num_slots must be >= 1, got {num_slots}")
    s = schedule
    n, c = s.num_ranks, s.chunks_per_period
    sizes = {Buffer.INPUT: s.in_chunks, Buffer.OUTPUT: s.out_chunks, Buffer.SCRATCH: s.scratch_chunks}

    _check_structure(s, sizes)
    conns = _connections(s)
    scratch = _scratch_used(s)
    direct = [_direct_sends(s, r, scratch) for r in range(n)]

    rank_rows: list[tuple[int, int]] = []
    tb_rows: list[list[int]] = []
    op_rows: list[list[int]] = []
    for r, tbs in enumerate(s.ranks):
        rank_rows.append((len(tb_rows), len(tbs)))
        # Expanded index of every original op: its nop chain comes first.
        new_index = [_expanded_indices(tbs, t) for t in range(len(tbs))]
        for t, tb in enumerate(tbs):
            first = len(op_rows)
            for i, op in enumerate(tb.ops):
                deps = _cross_deps(op, i, t)
                mapped = [(dt, new_index[dt][di]) for dt, di in deps]
                for dt, di in mapped[:-1]:
                    op_rows.append([OpKind.NOP.code, -1, 0, -1, 0, 0, dt, di, 0, 0])
                dep_tb, dep_op = mapped[-1] if mapped else (-1, -1)
                row = [op.kind.code, -1, 0, -1, 0, 0 if op.kind is OpKind.NOP else op.count, dep_tb, dep_op, 0, 0]
                if op.kind in _USES_SRC:
                    row[1], row[2] = int(op.src), op.src_off
                if op.kind in _USES_DST:
                    row[3], row[4] = int(op.dst), op.dst_off
                if (t, i) in direct[r]:
                    row[8] = OP_FLAG_DIRECT
                op_rows.append(row)
            send_conn = conns[(r, tb.send_peer, tb.channel)] if tb.send_peer >= 0 else -1
            recv_conn = conns[(tb.recv_peer, r, tb.channel)] if tb.recv_peer >= 0 else -1
            num_ops = len(op_rows) - first
            tb_rows.append([r, tb.send_peer, tb.recv_peer, tb.channel, first, num_ops, send_conn, recv_conn])

    hdr = [0] * HEADER_WORDS
    hdr[0] = MAGIC
    hdr[1] = VERSION
    hdr[2] = s.collective.code
    hdr[3] = n
    hdr[4] = c
    hdr[5] = s.in_chunks
    hdr[6] = s.out_chunks
    hdr[7] = scratch
    hdr[8] = int(num_slots)
    hdr[9] = len(tb_rows)
    hdr[10] = len(op_rows)
    hdr[11] = FLAG_ORDERED_REDUCTION if s.info.get("ordered_reduction") else 0
    hdr[DIGEST_WORD] = int(s.digest[-8:], 16)
    hdr[13] = len(conns)

    words = np.empty(HEADER_WORDS + RANK_WORDS * n + TB_WORDS * len(tb_rows) + OP_WORDS * len(op_rows), np.int64)
    words[:HEADER_WORDS] = hdr
    pos = HEADER_WORDS
    words[pos : pos + RANK_WORDS * n] = np.asarray(rank_rows, np.int64).reshape(-1)
    pos += RANK_WORDS * n
    if tb_rows:
        words[pos : pos + TB_WORDS * len(tb_rows)] = np.asarray(tb_rows, np.int64).reshape(-1)
    pos += TB_WORDS * len(tb_rows)
    if op_rows:
        words[pos:] = np.asarray(op_rows, np.int64).reshape(-1)
    if words.max(initial=0) > 0xFFFFFFFF or words.min(initial=0) < -(2**31):
        raise ScheduleError("schedule too large for an int32 table")
    # Words above 2**31 (the magic, the digest) wrap to their two's-complement int32 value.
    return seal(words.astype(np.uint32).view(np.int32))


def compiled_table(schedule: Schedule, num_slots: int = 8) -> np.ndarray:
    """:func:`compile_table`, memoized on the schedule object: a read-only array, compiled once per ``num_slots``.

    Schedules are immutable, so their compilation is too; :func:`check_table` compares against it.

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather
        >>> s = ring_allgather(4)
        >>> compiled_table(s) is compiled_table(s), compiled_table(s).flags.writeable
        (True, False)
    """
    cache = schedule.__dict__.setdefault("_compiled_tables", {})
    key = int(num_slots)
    if key not in cache:
        table = compile_table(schedule, num_slots=key)
        table.flags.writeable = False
        cache[key] = table
    return cache[key]


def check_table(schedule: Schedule, table: Any, *, what: str = "the table") -> np.ndarray:
    """Returns ``table`` if it is exactly the compilation of ``schedule``; raises naming the difference otherwise.

    A table enters the executor only as the compilation of the schedule it is staged with: the table of
    another schedule, of another collective or rank count, or one changed after it was compiled (even with
    its checksum recomputed) is refused. ``schedule`` is compiled with the ``num_slots`` of the table's
    header (once per schedule, :func:`compiled_table`).

    Raises:
        ScheduleError: ``table`` is not a table, or not the compilation of ``schedule``.

    Example:
        >>> from jaxccl.synth.baselines import direct_alltoall, ring_allgather
        >>> ring = ring_allgather(4)
        >>> check_table(ring, compile_table(ring)).size > 0
        True
        >>> check_table(ring, compile_table(direct_alltoall(4)))
        Traceback (most recent call last):
        ...
        jaxccl.errors.ScheduleError: the table is not the compilation of schedule ring_allgather (...): it is a ...
    """
    arr = np.asarray(table)
    if arr.ndim != 1 or arr.dtype != np.int32 or arr.size < HEADER_WORDS:
        raise ScheduleError(f"{what} is not a compiled table (a 1-D int32 array of at least {HEADER_WORDS} words)")
    h = header(arr)
    name = f"{schedule.name or 'unnamed'} ({schedule.digest[:12]})"
    prefix = f"{what} is not the compilation of schedule {name}"
    names = {c.code: c.value for c in type(schedule.collective)}
    if h["collective"] != schedule.collective.code or h["num_ranks"] != schedule.num_ranks:
        raise ScheduleError(
            f"{prefix}: it is a table of {names.get(h['collective'], h['collective'])} over {h['num_ranks']} ranks, "
            f"not {schedule.collective.value} over {schedule.num_ranks}"
        )
    if h["digest_low32"] != int(schedule.digest[-8:], 16):
        raise ScheduleError(
            f"{prefix}: it was compiled from a schedule with digest ...{h['digest_low32']:08x}, "
            f"not ...{schedule.digest[-8:]}"
        )
    if h["num_slots"] < 1:
        raise ScheduleError(f"{prefix}: its header has num_slots={h['num_slots']}")
    expected = compiled_table(schedule, num_slots=h["num_slots"])
    if arr.size != expected.size:
        raise ScheduleError(f"{prefix}: it has {arr.size} words, the compilation {expected.size}")
    differ = np.flatnonzero(arr != expected)
    if differ.size > 1:  # the checksum word differs whenever another word does: name the other
        differ = differ[differ != CHECKSUM_WORD]
    if differ.size:
        k = int(differ[0])
        raise ScheduleError(
            f"{prefix}: {differ.size} word(s) differ, the first at word {k} ({_word_name(expected, k)}): "
            f"{int(arr[k])}, compiled {int(expected[k])}"
        )
    return arr


def _word_name(table: np.ndarray, k: int) -> str:
    """Which field word ``k`` of a table is (for error messages)."""
    if k < HEADER_WORDS:
        return f"header {HEADER_FIELDS[k]}"
    h = header(table)
    pos = k - HEADER_WORDS
    if pos < RANK_WORDS * h["num_ranks"]:
        return f"rank {pos // RANK_WORDS}"
    pos -= RANK_WORDS * h["num_ranks"]
    if pos < TB_WORDS * h["num_threadblocks"]:
        return f"threadblock {pos // TB_WORDS} {TB_FIELDS[pos % TB_WORDS]}"
    pos -= TB_WORDS * h["num_threadblocks"]
    return f"op {pos // OP_WORDS} {OP_FIELDS[pos % OP_WORDS]}"


def checksum(table: np.ndarray) -> int:
    """The CRC-32 (``zlib.crc32``) of a table's words as little-endian bytes, the checksum word left out.

    Example:
        >>> import zlib
        >>> words = np.arange(20, dtype=np.int32)
        >>> checksum(words) == zlib.crc32(np.delete(words, CHECKSUM_WORD).astype("<i4").tobytes())
        True
    """
    w = np.ascontiguousarray(table, dtype="<i4")
    if w.ndim != 1 or w.size < HEADER_WORDS:
        raise ScheduleError(f"a table is a 1-D array of at least {HEADER_WORDS} words")
    return zlib.crc32(w[CHECKSUM_WORD + 1 :].tobytes(), zlib.crc32(w[:CHECKSUM_WORD].tobytes()))


def seal(table: np.ndarray) -> np.ndarray:
    """A copy of ``table`` (1-D ``int32``) with its checksum word set: what :func:`compile_table` returns.

    Example:
        >>> words = np.zeros(HEADER_WORDS, np.int32)
        >>> header(seal(words))["checksum"] == checksum(words)
        True
    """
    out = np.array(table, dtype="<i4", copy=True)
    out[CHECKSUM_WORD] = np.uint32(checksum(out)).view(np.int32)
    return out


def header(table: np.ndarray) -> dict[str, int]:
    """The header words of a compiled table by name (the digest as an unsigned value)."""
    t = np.asarray(table)
    if t.ndim != 1 or t.size < HEADER_WORDS:
        raise ScheduleError(f"a table is a 1-D array of at least {HEADER_WORDS} words")
    u = t[:HEADER_WORDS].astype(np.int64) & 0xFFFFFFFF
    s = t[:HEADER_WORDS].astype(np.int64)
    return {name: int(u[k] if k in _UNSIGNED_HEADER_WORDS else s[k]) for k, name in enumerate(HEADER_FIELDS)}


def decode(table: np.ndarray) -> dict[str, Any]:
    """Splits a compiled table into its header, rank, threadblock and op rows (for tests and debugging)."""
    t = np.asarray(table).astype(np.int64)
    h = header(table)
    n, nt, no = h["num_ranks"], h["num_threadblocks"], h["num_ops"]
    if min(n, nt, no) < 0:
        raise ScheduleError(f"table header has a negative count (N={n}, {nt} threadblocks, {no} ops)")
    expected = HEADER_WORDS + RANK_WORDS * n + TB_WORDS * nt + OP_WORDS * no
    if t.size != expected:
        raise ScheduleError(f"table has {t.size} words; its header implies {expected}")
    pos = HEADER_WORDS
    ranks = t[pos : pos + RANK_WORDS * n].reshape(n, RANK_WORDS)
    pos += RANK_WORDS * n
    tbs = t[pos : pos + TB_WORDS * nt].reshape(nt, TB_WORDS)
    pos += TB_WORDS * nt
    ops = t[pos:].reshape(no, OP_WORDS)
    return {
        "header": h,
        "ranks": [tuple(int(x) for x in row) for row in ranks],
        "threadblocks": [dict(zip(TB_FIELDS, (int(x) for x in row))) for row in tbs],
        "ops": [dict(zip(OP_FIELDS, (int(x) for x in row))) for row in ops],
    }


def schedule_of(table: np.ndarray) -> Schedule:
    """The schedule a table runs, one op per table row (a ``nop`` row stays a ``nop`` op).

    The inverse of :func:`compile_table` up to how dependencies are written:
    ``compile_table(schedule_of(t))`` is ``t`` again, except the digest word,
    for every table :func:`compile_table` emitted (:func:`verify` checks it).

    Raises:
        ScheduleError: the table's rows describe no schedule (sizes, codes, offsets).

    Example:
        >>> from jaxccl.synth.baselines import ring_allgather
        >>> schedule_of(compile_table(ring_allgather(4))).num_ops == ring_allgather(4).num_ops
        True
    """
    d = decode(table)
    h = d["header"]
    collectives = {c.code: c for c in Collective}
    kinds = {k.code: k for k in OpKind}
    try:
        ranks = []
        for first, count in d["ranks"]:
            tbs = []
            for tb in d["threadblocks"][first : first + count]:
                ops = []
                for o in d["ops"][tb["first_op"] : tb["first_op"] + tb["num_ops"]]:
                    src = Buffer(o["src_buf"]) if o["src_buf"] != -1 else None
                    dst = Buffer(o["dst_buf"]) if o["dst_buf"] != -1 else None
                    deps = ((o["dep_tb"], o["dep_op"]),) if o["dep_tb"] != -1 else ()
                    op = Op(kinds[o["kind"]], src, o["src_off"], dst, o["dst_off"], o["count"], deps)
                    ops.append(op)
                tbs.append(Threadblock(tuple(ops), tb["send_peer"], tb["recv_peer"], tb["channel"]))
            ranks.append(tbs)
        info = {"ordered_reduction": True} if h["flags"] & FLAG_ORDERED_REDUCTION else {}
        return make_schedule(
            collectives[h["collective"]],
            h["num_ranks"],
            h["chunks_per_period"],
            ranks,
            scratch_chunks=h["scratch_chunks"],
            info=info,
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ScheduleError(f"table rows describe no schedule: {e}") from None


def verify(table: np.ndarray) -> Schedule:
    """Proves that ``table`` is what :func:`compile_table` emits for a schedule :meth:`~Schedule.validate` accepts.

    The table's schedule (:func:`schedule_of`) is checked by the reference
    interpreter with the table's slot count and compiled again; every word but
    the digest must come back (a direct flag, a connection id, a scratch size
    the compiler would not write is refused), and the checksum must be right.
    Costs a :meth:`~Schedule.validate`: for tables from elsewhere (a file, a
    tool), not for each hot-swap of a table compiled here.

    Returns:
        The table's schedule.

    Raises:
        ScheduleError: naming the first word that differs, or what the interpreter found.

    Example:
        >>> from jaxccl.synth.baselines import ring_reduce_scatter
        >>> verify(compile_table(ring_reduce_scatter(4))).collective.value
        'reduce_scatter'
    """
    t = np.asarray(table)
    h = header(t)
    if checksum(t) != h["checksum"]:
        raise ScheduleError(f"table checksum 0x{h['checksum']:08x} is not its words' 0x{checksum(t):08x}")
    s = schedule_of(t)
    s.validate(num_slots=h["num_slots"])
    again = compile_table(s, num_slots=h["num_slots"])
    differ = [w for w in range(min(t.size, again.size)) if w not in (DIGEST_WORD, CHECKSUM_WORD) and t[w] != again[w]]
    if t.size != again.size or differ:
        w = differ[0] if differ else min(t.size, again.size)
        raise ScheduleError(
            f"table word {w} is not what compile_table writes for the table's schedule "
            f"({int(t[w]) if w < t.size else 'missing'} instead of {int(again[w]) if w < again.size else 'none'})"
        )
    return s


# --------------------------------------------------------------------------- checks


def _scratch_used(s: Schedule) -> int:
    """Scratch chunks the ops name (``0..k-1``): what a table declares and the executors allocate."""
    used = 0
    for tbs in s.ranks:
        for tb in tbs:
            for op in tb.ops:
                if op.kind in _USES_SRC and op.src is Buffer.SCRATCH:
                    used = max(used, op.src_off + op.count)
                if op.kind in _USES_DST and op.dst is Buffer.SCRATCH:
                    used = max(used, op.dst_off + op.count)
    return used


def _where(r: int, t: int, i: int | None = None) -> str:
    return f"rank {r}, threadblock {t}" + ("" if i is None else f", op {i}")


def _check_structure(s: Schedule, sizes: dict[Buffer, int]) -> None:
    n, c = s.num_ranks, s.chunks_per_period
    for r, tbs in enumerate(s.ranks):
        send_keys: set[tuple[int, int]] = set()
        recv_keys: set[tuple[int, int]] = set()
        for t, tb in enumerate(tbs):
            for peer, what, keys in ((tb.send_peer, "send", send_keys), (tb.recv_peer, "receive", recv_keys)):
                if peer == -1:
                    continue
                if not 0 <= peer < n or peer == r:
                    raise ScheduleError(f"{_where(r, t)}: {what} peer {peer} is not another rank of 0..{n - 1}")
                if (peer, tb.channel) in keys:
                    raise ScheduleError(
                        f"{_where(r, t)}: a second threadblock to {what} with rank {peer} on channel {tb.channel}"
                    )
                keys.add((peer, tb.channel))
            if tb.channel < 0:
                raise ScheduleError(f"{_where(r, t)}: negative channel {tb.channel}")
            for i, op in enumerate(tb.ops):
                where = _where(r, t, i)
                if op.kind.sends and tb.send_peer < 0:
                    raise ScheduleError(f"{where}: '{op.kind.value}' sends but the threadblock has no send peer")
                if op.kind.receives and tb.recv_peer < 0:
                    raise ScheduleError(f"{where}: '{op.kind.value}' receives but the threadblock has no receive peer")
                if op.kind in _USES_DST and op.dst is Buffer.INPUT:
                    raise ScheduleError(f"{where}: '{op.kind.value}' writes the input buffer, which is read-only")
                for used, buf, off in ((_USES_SRC, op.src, op.src_off), (_USES_DST, op.dst, op.dst_off)):
                    if op.kind in used and off + op.count > sizes[buf]:
                        raise ScheduleError(
                            f"{where}: chunks {off}..{off + op.count - 1} of {buf.name} exceed its {sizes[buf]} chunks"
                        )
                if op.kind in _USES_SRC and op.kind in _USES_DST and (op.src_off - op.dst_off) % c:
                    raise ScheduleError(
                        f"{where}: src offset {op.src_off} and dst offset {op.dst_off} differ in chunk class mod {c}"
                    )
                for dt, di in op.deps:
                    if not (0 <= dt < len(tbs) and 0 <= di < len(tbs[dt].ops)):
                        raise ScheduleError(f"{where}: dependency ({dt}, {di}) names no op of rank {r}")
                    if dt == t and di >= i:
                        raise ScheduleError(f"{where}: depends on op {di} of its own threadblock, which runs later")


def _cross_deps(op: Any, i: int, t: int | None) -> list[tuple[int, int]]:
    """The op's dependencies on other threadblocks (same-threadblock ones are implied by program order)."""
    return sorted({(dt, di) for dt, di in op.deps if dt != t})


def _expanded_indices(tbs: Sequence[Any], t: int) -> list[int]:
    idx, k = [], 0
    for i, op in enumerate(tbs[t].ops):
        k += max(len(_cross_deps(op, i, t)) - 1, 0)
        idx.append(k)
        k += 1
    return idx


def _connections(s: Schedule) -> dict[tuple[int, int, int], int]:
    """Numbers the (sender, receiver, channel) triples and checks both ends agree message by message."""
    senders: dict[tuple[int, int, int], tuple[int, Any]] = {}
    receivers: dict[tuple[int, int, int], tuple[int, Any]] = {}
    for r, tbs in enumerate(s.ranks):
        for t, tb in enumerate(tbs):
            if tb.send_peer >= 0:
                senders[(r, tb.send_peer, tb.channel)] = (t, tb)
            if tb.recv_peer >= 0:
                receivers[(tb.recv_peer, r, tb.channel)] = (t, tb)
    c = s.chunks_per_period
    for key in sorted(set(senders) | set(receivers)):
        a, b, ch = key
        if key not in receivers:
            raise ScheduleError(
                f"{_where(a, senders[key][0])} sends to rank {b} on channel {ch}, "
                f"but rank {b} has no threadblock receiving from rank {a} on that channel"
            )
        if key not in senders:
            raise ScheduleError(
                f"{_where(b, receivers[key][0])} receives from rank {a} on channel {ch}, "
                f"but rank {a} has no threadblock sending to rank {b} on that channel"
            )
        st, stb = senders[key]
        rt, rtb = receivers[key]
        sends = [(i, op) for i, op in enumerate(stb.ops) if op.kind.sends]
        recvs = [(i, op) for i, op in enumerate(rtb.ops) if op.kind.receives]
        if len(sends) != len(recvs):
            raise ScheduleError(
                f"connection rank {a} -> rank {b} channel {ch}: {len(sends)} sending ops but {len(recvs)} receiving ops"
            )
        for k, ((si, sop), (ri, rop)) in enumerate(zip(sends, recvs)):
            src_off = _send_source(sop)[1]
            if sop.count != rop.count or (src_off - _recv_target_offset(rop)) % c:
                raise ScheduleError(
                    f"connection rank {a} -> rank {b} channel {ch}, message {k}: {_where(a, st, si)} sends "
                    f"{sop.count} chunk(s) from offset {src_off} but {_where(b, rt, ri)} expects {rop.count} "
                    f"at offset {_recv_target_offset(rop)} (counts and chunk classes must match)"
                )
    return {key: k for k, key in enumerate(sorted(senders))}


# ------------------------------------------------------------------ direct sends


def _direct_sends(s: Schedule, r: int, scratch: int) -> set[tuple[int, int]]:
    """``(threadblock, op)`` of the sends of rank ``r`` whose source range is never written after them.

    ``scratch``: the scratch chunks the ops use (declared but unused scratch is never sized here).
    """
    tbs = s.ranks[r]
    ops = [(t, i, op) for t, tb in enumerate(tbs) for i, op in enumerate(tb.ops)]
    candidates = [(t, i, op) for t, i, op in ops if op.kind.sends and op.kind is not OpKind.RECV_REDUCE_SEND]
    if not candidates:
        return set()
    # Per buffer chunk: the ops that write it.
    writers = {b: [[] for _ in range(size)] for b, size in ((Buffer.OUTPUT, s.out_chunks), (Buffer.SCRATCH, scratch))}
    for k, (_, _, op) in enumerate(ops):
        if op.kind in _USES_DST:
            for c in range(op.dst_off, op.dst_off + op.count):
                writers[op.dst][c].append(k)
    need = {(t, i) for t, i, _ in candidates}
    for tb in tbs:
        for op in tb.ops:
            need.update((dt, di) for dt, di in op.deps)
    clocks = _vector_clocks(tbs, need)

    def happens_before(w: tuple[int, int], x: tuple[int, int]) -> bool:
        if w[0] == x[0]:
            return w[1] <= x[1]
        clock = clocks.get(x)
        return clock is not None and clock[w[0]] >= w[1]

    direct = set()
    for t, i, op in candidates:
        buf, off = _send_source(op)
        if buf is Buffer.INPUT:
            direct.add((t, i))
            continue
        ws = {k for c in range(off, off + op.count) for k in writers[buf][c]}
        if all(happens_before(ops[k][:2], (t, i)) for k in ws):  # every write is before: none after
            direct.add((t, i))
    return direct


def _vector_clocks(tbs: Sequence[Any], need: set[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """Vector clocks (per threadblock, the last op that happens-before-or-is the op) of the ops in ``need``.

    Ops on a dependency cycle get no clock (they never run; their sends are not direct).
    """
    nt = len(tbs)
    cur = [np.full(nt, -1, np.int64) for _ in range(nt)]
    ptr = [0] * nt
    snap: dict[tuple[int, int], np.ndarray] = {}
    progress = True
    while progress:
        progress = False
        for t in range(nt):
            ops = tbs[t].ops
            while ptr[t] < len(ops):
                i = ptr[t]
                deps = _cross_deps(ops[i], i, t)
                if any(ptr[dt] <= di for dt, di in deps):
                    break
                clock = cur[t]
                for d in deps:
                    clock = np.maximum(clock, snap[d])
                clock[t] = i
                cur[t] = clock
                if (t, i) in need:
                    snap[(t, i)] = clock.copy()
                ptr[t] += 1
                progress = True
    return snap
