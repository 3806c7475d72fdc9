"""MSCCL XML import and export.

The format is MSCCL's (msccl-tools ``ir_to_xml``, read by msccl-executor-nccl)::

    <algo name="ring" proto="Simple" nchannels="1" nchunksperloop="8" ngpus="8" coll="allgather"
          inplace="0" outofplace="1" minBytes="0" maxBytes="9223372036854775807">
      <gpu id="0" i_chunks="1" o_chunks="8" s_chunks="0">
        <tb id="0" send="1" recv="7" chan="0">
          <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1"
                depid="-1" deps="-1" hasdep="0"/>
          ...

Conventions (MSCCL's):

- ``coll`` is ``allgather``, ``alltoall``, ``reducescatter`` or ``allreduce``
  (``reduce_scatter`` and ``all_gather``-style spellings are accepted on import).
- ``nchunksperloop`` is the number of chunks of the larger of a rank's input
  and output buffers, so the period ``C`` is ``nchunksperloop / ngpus`` for
  all-gather, all-to-all and reduce-scatter and ``nchunksperloop`` for
  all-reduce. ``i_chunks``/``o_chunks`` must match the collective's layout.
- An absent buffer is written ``srcbuf="i" srcoff="-1"`` /
  ``dstbuf="o" dstoff="-1"``.
- A step has at most one dependency (``depid`` = threadblock id, ``deps`` =
  step index); ``hasdep="1"`` marks steps another step depends on.

Lossless round trip. :func:`to_msccl_xml` writes an op with ``k > 1``
dependencies as ``k - 1`` ``nop`` steps right before it, carrying its 2nd..k-th
dependency, followed by the op itself with the first one (MSCCL's executor
folds the dependencies of ``nop`` steps into the next step, so the plain
MSCCL reading is the same program). Those ``nop`` steps carry
``jaxccl:dep="1"``; :func:`from_msccl_xml` folds marked ``nop`` steps back
into the next step's dependencies and keeps unmarked ``nop`` steps as
``nop`` ops (which wait for their dependency, as in MSCCL). Everything else a
:class:`Schedule` holds travels in the ``jaxccl`` namespace
(``xmlns:jaxccl="urn:jaxccl:schedule:1"``): ``jaxccl:period`` (checked
against ``nchunksperloop``), ``jaxccl:algbw`` and ``jaxccl:bound`` on
``<algo>``, ``jaxccl:srcoff``/``jaxccl:dstoff`` on steps whose absent buffer
has a non-zero offset, and ``info`` as JSON in an XML comment
``<!-- jaxccl:info {...} -->`` inside ``<algo>`` (comments, because MSCCL's
parser limits attribute values to 255 characters and ignores comments).
So ``from_msccl_xml(to_msccl_xml(s, runtime_limits=False)) == s`` for every schedule, and an XML
without any ``jaxccl`` extras imports with MSCCL's conventions.

Example:
    >>> from jaxccl.synth.baselines import ordered_allreduce
    >>> s = ordered_allreduce(4)
    >>> from_msccl_xml(to_msccl_xml(s)) == s
    True
"""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET
from typing import Any
from xml.sax.saxutils import quoteattr

from jaxccl.errors import ScheduleError
from jaxccl.schedule.inplace import out_of_place
from jaxccl.schedule.interpreter import gc_paused
from jaxccl.schedule.ir import Buffer, Collective, Op, OpKind, Schedule, Threadblock
from jaxccl.util import safe_xml, strict

NAMESPACE = "urn:jaxccl:schedule:1"
PROTOCOLS = ("Simple", "LL", "LL128")
INT64_MAX = 2**63 - 1
# What msccl-executor-nccl loads at most (its msccl_struct.h).
MSCCL_MAX_STEPS = 256
MSCCL_MAX_THREADBLOCKS_PER_CHANNEL = 32
MSCCL_MAX_COUNT = 72

_NS = "{" + NAMESPACE + "}"
_COLL_TO_XML = {
    Collective.ALL_GATHER: "allgather",
    Collective.ALL_TO_ALL: "alltoall",
    Collective.REDUCE_SCATTER: "reducescatter",
    Collective.ALL_REDUCE: "allreduce",
}
_COLL_FROM_XML = {
    "allgather": Collective.ALL_GATHER,
    "all_gather": Collective.ALL_GATHER,
    "alltoall": Collective.ALL_TO_ALL,
    "all_to_all": Collective.ALL_TO_ALL,
    "reducescatter": Collective.REDUCE_SCATTER,
    "reduce_scatter": Collective.REDUCE_SCATTER,
    "allreduce": Collective.ALL_REDUCE,
    "all_reduce": Collective.ALL_REDUCE,
}
_INFO_PREFIX = "jaxccl:info "
_STEP_TYPES = {k.value: k for k in OpKind}
_BUFFERS = {b.xml: b for b in Buffer}


# ---------------------------------------------------------------------------- export
def _nchunksperloop(s: Schedule) -> int:
    return max(s.in_chunks, s.out_chunks)


def _period_from(coll: Collective, n: int, nchunks: int) -> int | None:
    if coll is Collective.ALL_REDUCE:
        return nchunks
    return nchunks // n if nchunks % n == 0 else None


def _float_attr(x: float) -> str:
    return repr(float(x))


def to_msccl_xml(
    schedule: Schedule,
    *,
    min_bytes: int = 0,
    max_bytes: int | None = None,
    proto: str = "Simple",
    runtime_limits: bool = True,
) -> str:
    """Serializes ``schedule`` as MSCCL XML (see the module docstring).

    Args:
        schedule: the schedule.
        min_bytes: ``minBytes`` (the smallest message MSCCL should use it for).
        max_bytes: ``maxBytes``; ``None`` writes the largest int64.
        proto: ``Simple``, ``LL`` or ``LL128``.
        runtime_limits: write what the MSCCL runtime (msccl-executor-nccl) can
            load: a step moving more than ``MSCCL_MAX_COUNT`` chunks is split
            into consecutive steps of at most that many (:func:`split_counts`,
            the same program), and schedules that still have more than
            ``MSCCL_MAX_STEPS`` steps in a threadblock (dependency ``nop``
            steps included) or more than ``MSCCL_MAX_THREADBLOCKS_PER_CHANNEL``
            threadblocks of a rank on one channel are refused. ``False`` writes
            any schedule as it is (for jaxccl's own round trips).

    Returns:
        The XML text.

    Raises:
        ScheduleError: bad arguments, or a schedule over a runtime limit (naming
            it and where).

    >>> from jaxccl.synth.baselines import ring_allgather
    >>> print(to_msccl_xml(ring_allgather(2)).splitlines()[3].strip())
    <tb id="0" send="1" recv="1" chan="0">
    """
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"expected a Schedule, got {type(schedule).__name__}")
    if proto not in PROTOCOLS:
        raise ScheduleError(f"unknown MSCCL protocol {proto!r}; expected one of {PROTOCOLS}")
    max_b = INT64_MAX if max_bytes is None else int(max_bytes)
    if int(min_bytes) < 0 or max_b < int(min_bytes):
        raise ScheduleError(f"need 0 <= min_bytes <= max_bytes, got {min_bytes} and {max_bytes}")
    s = schedule
    if runtime_limits:
        s = split_counts(s, MSCCL_MAX_COUNT)
        _check_runtime_limits(s)
    nchannels = max((tb.channel + 1 for tbs in s.ranks for tb in tbs), default=1)
    head = [
        f"<algo name={quoteattr(s.name)}",
        f'proto="{proto}"',
        f'nchannels="{nchannels}"',
        f'nchunksperloop="{_nchunksperloop(s)}"',
        f'ngpus="{s.num_ranks}"',
        f'coll="{_COLL_TO_XML[s.collective]}"',
        'inplace="0"',
        'outofplace="1"',
        f'minBytes="{int(min_bytes)}"',
        f'maxBytes="{max_b}"',
        f'xmlns:jaxccl="{NAMESPACE}"',
        f'jaxccl:period="{s.period}"',
    ]
    if s.algbw is not None:
        head.append(f'jaxccl:algbw="{_float_attr(s.algbw)}"')
    if s.bound is not None:
        head.append(f'jaxccl:bound="{_float_attr(s.bound)}"')
    out = [" ".join(head) + ">"]
    if s.info:
        text = json.dumps(dict(s.info), sort_keys=True, separators=(",", ":"), allow_nan=False)
        # "--" cannot appear in a comment; outside JSON strings it never occurs, inside it is escaped.
        out.append(f"  <!-- {_INFO_PREFIX}{text.replace('--', '-' + chr(92) + 'u002d')} -->")
    for r, tbs in enumerate(s.ranks):
        out.append(f'  <gpu id="{r}" i_chunks="{s.in_chunks}" o_chunks="{s.out_chunks}" s_chunks="{s.scratch_chunks}">')
        steps = [_steps(tb) for tb in tbs]
        index = [idx for _, idx in steps]
        targets = {(t, i) for tb in tbs for op in tb.ops for t, i in op.deps}
        for t, tb in enumerate(tbs):
            out.append(f'    <tb id="{t}" send="{tb.send_peer}" recv="{tb.recv_peer}" chan="{tb.channel}">')
            for k, (op, dep, marked, real) in enumerate(steps[t][0]):
                out.append("      " + _step_xml(k, op, dep, marked, real is not None and (t, real) in targets, index))
            out.append("    </tb>")
        out.append("  </gpu>")
    out.append("</algo>")
    return "\n".join(out) + "\n"


def split_counts(schedule: Schedule, max_count: int) -> Schedule:
    """The same program with every op of more than ``max_count`` chunks cut into consecutive ops of at most that many.

    An op of ``k`` chunks becomes ``ceil(k / max_count)`` ops on consecutive chunk
    ranges (sizes differ by at most one), in its place in its threadblock: the
    first carries its dependencies, a dependency on it names the last. Both ends
    of a message have the same count, so sender and receiver are cut alike and
    the connection carries the pieces in order. Chunks are independent (a
    reduction sums chunk by chunk), so the result is bitwise the same.

    Args:
        schedule: the schedule.
        max_count: the largest count an op may keep (``>= 1``).

    Returns:
        ``schedule`` itself when no op is larger, else the split schedule.

    >>> from jaxccl.schedule import Buffer, ScheduleBuilder
    >>> b = ScheduleBuilder("all_gather", num_ranks=1, chunks_per_period=5)
    >>> _ = b.copy(0, (Buffer.INPUT, 0), (Buffer.OUTPUT, 0), 5)
    >>> [(op.src_off, op.count) for op in split_counts(b.build(), 2).ranks[0][0].ops]
    [(0, 2), (2, 2), (4, 1)]
    """
    if int(max_count) < 1:
        raise ScheduleError(f"max_count must be >= 1, got {max_count}")
    s = schedule
    if all(op.count <= max_count for tbs in s.ranks for tb in tbs for op in tb.ops):
        return s
    ranks = []
    for tbs in s.ranks:
        # last[t][i]: the index, in the split threadblock t, of the last piece of op i.
        last: list[list[int]] = []
        for tb in tbs:
            k, ends = 0, []
            for op in tb.ops:
                k += _pieces(op, max_count)
                ends.append(k - 1)
            last.append(ends)
        new_tbs = []
        for tb in tbs:
            ops: list[Op] = []
            for op in tb.ops:
                deps = tuple(
                    (dt, last[dt][di] if 0 <= dt < len(last) and 0 <= di < len(last[dt]) else di) for dt, di in op.deps
                )
                p, start = _pieces(op, max_count), 0
                for j in range(p):
                    size = op.count // p + (1 if j < op.count % p else 0)
                    ops.append(
                        dataclasses.replace(
                            op,
                            src_off=op.src_off + start if op.src is not None else op.src_off,
                            dst_off=op.dst_off + start if op.dst is not None else op.dst_off,
                            count=size,
                            deps=deps if j == 0 else (),
                        )
                    )
                    start += size
            new_tbs.append(dataclasses.replace(tb, ops=tuple(ops)))
        ranks.append(new_tbs)
    return s.replace(ranks=tuple(tuple(tbs) for tbs in ranks))


def _pieces(op: Op, max_count: int) -> int:
    return max(1, -(-op.count // max_count))


def _check_runtime_limits(s: Schedule) -> None:
    for r, tbs in enumerate(s.ranks):
        per_channel: dict[int, int] = {}
        for t, tb in enumerate(tbs):
            per_channel[tb.channel] = per_channel.get(tb.channel, 0) + 1
            steps = sum(max(1, len(op.deps)) for op in tb.ops)
            if steps > MSCCL_MAX_STEPS:
                raise ScheduleError(
                    f"MSCCL export: rank {r} threadblock {t} needs {steps} steps (dependency nops included); the "
                    f"MSCCL runtime allows {MSCCL_MAX_STEPS}: use fewer chunks per period or more channels, or pass "
                    "runtime_limits=False to write it anyway"
                )
            big = next((op for op in tb.ops if op.count > MSCCL_MAX_COUNT), None)
            if big is not None:
                raise ScheduleError(
                    f"MSCCL export: rank {r} threadblock {t} has a {big.kind.value} step of {big.count} chunks; the "
                    f"MSCCL runtime allows {MSCCL_MAX_COUNT} per step (pass runtime_limits=False to write it anyway)"
                )
        for chan, count in per_channel.items():
            if count > MSCCL_MAX_THREADBLOCKS_PER_CHANNEL:
                raise ScheduleError(
                    f"MSCCL export: rank {r} has {count} threadblocks on channel {chan}; the MSCCL runtime allows "
                    f"{MSCCL_MAX_THREADBLOCKS_PER_CHANNEL} per channel: spread them over more channels, or pass "
                    "runtime_limits=False to write it anyway"
                )


def _steps(tb: Threadblock) -> tuple[list[tuple[Op | None, tuple[int, int] | None, bool, int | None]], list[int]]:
    """``([(op or None for a dep-nop, its one dep, marked, real op index)], step index of every op)``."""
    steps: list[tuple[Op | None, tuple[int, int] | None, bool, int | None]] = []
    index: list[int] = []
    for i, op in enumerate(tb.ops):
        for d in op.deps[1:]:
            steps.append((None, d, True, None))
        index.append(len(steps))
        steps.append((op, op.deps[0] if op.deps else None, False, i))
    return steps, index


def _step_xml(
    k: int, op: Op | None, dep: tuple[int, int] | None, marked: bool, hasdep: bool, index: list[list[int]]
) -> str:
    if op is None:
        kind, src, soff, dst, doff, cnt = OpKind.NOP, None, 0, None, 0, 0
    else:
        kind, src, soff, dst, doff, cnt = op.kind, op.src, op.src_off, op.dst, op.dst_off, op.count
    attrs = [f'<step s="{k}" type="{kind.value}"']
    attrs.append(f'srcbuf="{src.xml}" srcoff="{soff}"' if src is not None else 'srcbuf="i" srcoff="-1"')
    attrs.append(f'dstbuf="{dst.xml}" dstoff="{doff}"' if dst is not None else 'dstbuf="o" dstoff="-1"')
    attrs.append(f'cnt="{cnt}"')
    if dep is None:
        attrs.append('depid="-1" deps="-1"')
    else:
        t, i = dep
        if not 0 <= t < len(index) or not 0 <= i < len(index[t]):
            raise ScheduleError(f"cannot export: a step depends on tb {t} op {i}, which does not exist")
        attrs.append(f'depid="{t}" deps="{index[t][i]}"')
    attrs.append(f'hasdep="{1 if hasdep else 0}"')
    if marked:
        attrs.append('jaxccl:dep="1"')
    if src is None and soff:
        attrs.append(f'jaxccl:srcoff="{soff}"')
    if dst is None and doff:
        attrs.append(f'jaxccl:dstoff="{doff}"')
    return " ".join(attrs) + "/>"


# ---------------------------------------------------------------------------- import
def _int(el: ET.Element, name: str, where: str, default: int | None = None) -> int:
    v = el.get(name)
    if v is None:
        if default is not None:
            return default
        raise ScheduleError(f"MSCCL XML: {where} is missing attribute {name!r}")
    return strict.integer_text(v, f"MSCCL XML: attribute {name} of {where}", ScheduleError)


def _quick_int(v: str) -> int:
    """``int(v)`` for plain ASCII digits with an optional ``-``; ``ValueError`` sends the caller to the slow path."""
    if v.isascii() and (v.isdigit() or (v[:1] == "-" and v[1:].isdigit())):
        return int(v)
    raise ValueError(v)


def _float(el: ET.Element, name: str, where: str) -> float | None:
    v = el.get(name)
    if v is None:
        return None
    return strict.real_text(v, f"MSCCL XML: attribute {name} of {where}", ScheduleError, positive=True)


def _buffer(el: ET.Element, name: str, where: str) -> Buffer:
    v = el.get(name)
    if v is None:
        raise ScheduleError(f"MSCCL XML: {where} is missing attribute {name!r}")
    try:
        return Buffer("ios".index(v))
    except ValueError:
        raise ScheduleError(f"MSCCL XML: {where} has unknown buffer {name}={v!r}; expected 'i', 'o' or 's'") from None


def _step_slow(st: ET.Element, where: str) -> tuple[int, OpKind, Buffer, int, Buffer, int, int, int, int]:
    s_attr = _int(st, "s", where)
    t = st.get("type")
    if t is None:
        raise ScheduleError(f"MSCCL XML: {where} is missing attribute 'type'")
    kind = _STEP_TYPES.get(t)
    if kind is None:
        raise ScheduleError(f"MSCCL XML: {where} has unknown step type {t!r}; expected one of {sorted(_STEP_TYPES)}")
    src, soff = _buffer(st, "srcbuf", where), _int(st, "srcoff", where)
    dst, doff = _buffer(st, "dstbuf", where), _int(st, "dstoff", where)
    cnt = _int(st, "cnt", where)
    return s_attr, kind, src, soff, dst, doff, cnt, _int(st, "depid", where, default=-1), _int(st, "deps", where, -1)


def _parse(text: str | bytes) -> ET.Element:
    return safe_xml.parse(
        text,
        what="MSCCL XML",
        error=ScheduleError,
        nesting_note="MSCCL XML has 4: <algo>/<gpu>/<tb>/<step>",
        comments=True,
    )


def from_msccl_xml(text: str | bytes) -> Schedule:
    """Parses MSCCL XML into a :class:`Schedule` (see the module docstring).

    The result is not validated; call :meth:`Schedule.validate`.

    Raises:
        ScheduleError: naming the problem (parse error with its line, unknown
            collective or step type, missing or non-integer attribute, wrong
            number of GPUs or chunks, dangling dependency, ...).
    """
    with gc_paused():
        return _from_root(_parse(text))


def _from_root(root: ET.Element) -> Schedule:
    if root.tag != "algo":
        raise ScheduleError(f"MSCCL XML: the root element must be <algo>, got <{root.tag}>")
    coll_name = root.get("coll")
    if coll_name is None:
        raise ScheduleError("MSCCL XML: <algo> is missing attribute 'coll'")
    coll = _COLL_FROM_XML.get(coll_name.strip().lower())
    if coll is None:
        raise ScheduleError(
            f"MSCCL XML: unsupported collective coll={coll_name!r}; jaxccl supports allgather, alltoall, "
            "reducescatter and allreduce"
        )
    n = _int(root, "ngpus", "<algo>")
    if n < 1:
        raise ScheduleError(f"MSCCL XML: ngpus must be >= 1, got {n}")
    nchunks = _int(root, "nchunksperloop", "<algo>")
    period = _period_from(coll, n, nchunks) if nchunks >= 1 else None
    if period is None or period < 1:
        raise ScheduleError(
            f"MSCCL XML: nchunksperloop={nchunks} does not fit {coll_name} on {n} GPUs "
            f"({'a positive multiple of ngpus' if coll is not Collective.ALL_REDUCE else 'must be positive'})"
        )
    declared = root.get(_NS + "period")
    if declared is not None and _int(root, _NS + "period", "<algo>") != period:
        raise ScheduleError(
            f"MSCCL XML: jaxccl:period={declared} disagrees with nchunksperloop={nchunks} for {coll_name} on {n} GPUs"
        )
    proto = root.get("proto")
    if proto is not None and proto not in PROTOCOLS:
        raise ScheduleError(f"MSCCL XML: unknown protocol proto={proto!r}; expected one of {PROTOCOLS}")
    in_place = _int(root, "inplace", "<algo>", default=0) == 1
    if not in_place and root.get("outofplace") is not None and _int(root, "outofplace", "<algo>") == 0:
        raise ScheduleError('MSCCL XML: outofplace="0" without inplace="1": the algorithm runs in no buffer layout')
    nchannels = _int(root, "nchannels", "<algo>", default=-1)
    in_chunks, out_chunks = coll.buffer_chunks(n, period)

    info: dict[str, Any] = {}
    gpus: dict[int, ET.Element] = {}
    for child in root:
        if child.tag is ET.Comment:
            body = (child.text or "").strip()
            if body.startswith(_INFO_PREFIX.strip()):
                try:
                    info = strict.load_json(body[len(_INFO_PREFIX.strip()) :], "jaxccl:info comment", ScheduleError)
                except ScheduleError as e:
                    raise ScheduleError(f"MSCCL XML: {e}") from None
                if not isinstance(info, dict):
                    raise ScheduleError("MSCCL XML: the jaxccl:info comment must hold a JSON object")
                strict.nesting(info, "MSCCL XML: the jaxccl:info comment", ScheduleError)
            continue
        if child.tag != "gpu":
            raise ScheduleError(f"MSCCL XML: unexpected element <{child.tag}> in <algo>; expected <gpu>")
        gid = _int(child, "id", "<gpu>")
        if gid in gpus:
            raise ScheduleError(f'MSCCL XML: <gpu id="{gid}"> appears twice')
        gpus[gid] = child
    if len(gpus) != n or sorted(gpus) != list(range(n)):  # the length first: ngpus may be 10**18
        shown = sorted(gpus)[:16]
        raise ScheduleError(
            f"MSCCL XML: ngpus={n} but found <gpu> ids {shown}{'...' if len(gpus) > 16 else ''}; expected 0..{n - 1}"
        )

    scratch = 0
    ranks = []
    cache: dict[tuple, Op] = {}
    max_chan = -1
    for r in range(n):
        gpu = gpus[r]
        where = f'<gpu id="{r}">'
        for attr, want in (("i_chunks", in_chunks), ("o_chunks", out_chunks)):
            got = _int(gpu, attr, where)
            if got != want and not (in_place and 0 <= got <= max(in_chunks, out_chunks)):
                raise ScheduleError(
                    f"MSCCL XML: {where} has {attr}={got}, but {coll_name} with {n} GPUs and "
                    f"nchunksperloop={nchunks} needs {want}"
                    + ("" if in_place else ' (an in-place algorithm must say inplace="1")')
                )
        s_chunks = _int(gpu, "s_chunks", where, default=0)
        if s_chunks < 0:
            raise ScheduleError(f"MSCCL XML: {where} has negative s_chunks={s_chunks}")
        scratch = max(scratch, s_chunks)
        tbs = _read_threadblocks(gpu, r, cache)
        max_chan = max([max_chan, *(tb.channel for tb in tbs)])
        ranks.append(tuple(tbs))
    if nchannels >= 0 and max_chan >= nchannels:
        raise ScheduleError(f"MSCCL XML: nchannels={nchannels} but a threadblock uses channel {max_chan}")
    schedule = Schedule(
        collective=coll,
        num_ranks=n,
        chunks_per_period=period,
        ranks=tuple(ranks),
        scratch_chunks=scratch,
        name=root.get("name", ""),
        algbw=_float(root, _NS + "algbw", "<algo>"),
        bound=_float(root, _NS + "bound", "<algo>"),
        info=info,
    )
    return out_of_place(schedule) if in_place else schedule


def _read_threadblocks(gpu: ET.Element, r: int, cache: dict[tuple, Op]) -> list[Threadblock]:
    """The threadblocks of one ``<gpu>``; equal steps share one :class:`Op` through ``cache``."""
    raw: dict[int, tuple[int, int, int, list[ET.Element]]] = {}
    for el in gpu:
        if el.tag is ET.Comment:
            continue
        if el.tag != "tb":
            raise ScheduleError(f'MSCCL XML: unexpected element <{el.tag}> in <gpu id="{r}">; expected <tb>')
        where = f'<tb> of <gpu id="{r}">'
        tid = _int(el, "id", where)
        where = f'<tb id="{tid}"> of <gpu id="{r}">'
        if tid in raw:
            raise ScheduleError(f"MSCCL XML: {where} appears twice")
        if tid < 0:
            raise ScheduleError(f"MSCCL XML: {where} has a negative id")
        steps = [c for c in el if c.tag is not ET.Comment]
        for c in steps:
            if c.tag != "step":
                raise ScheduleError(f"MSCCL XML: unexpected element <{c.tag}> in {where}; expected <step>")
        raw[tid] = (_int(el, "send", where), _int(el, "recv", where), _int(el, "chan", where), steps)
    ids = sorted(raw)
    position = {tid: k for k, tid in enumerate(ids)}  # MSCCL requires 0..T-1; tolerate gaps by renumbering

    # First pass: parse steps; remember which step indices are marked dependency-nops.
    parsed: list[list[tuple[OpKind, Buffer | None, int, Buffer | None, int, int, tuple[int, int] | None, bool]]] = []
    for tid in ids:
        send, recv, chan, steps = raw[tid]
        where_tb = f'<tb id="{tid}"> of <gpu id="{r}">'
        rows = []
        for k, st in enumerate(steps):
            at = st.attrib
            try:  # fast path; the slow path below names what is wrong
                s_attr, kind = _quick_int(at["s"]), _STEP_TYPES[at["type"]]
                src, soff = _BUFFERS[at["srcbuf"]], _quick_int(at["srcoff"])
                dst, doff = _BUFFERS[at["dstbuf"]], _quick_int(at["dstoff"])
                cnt = _quick_int(at["cnt"])
                depid, deps = _quick_int(at.get("depid", "-1")), _quick_int(at.get("deps", "-1"))
            except (KeyError, ValueError):
                s_attr, kind, src, soff, dst, doff, cnt, depid, deps = _step_slow(st, f"step {k} of {where_tb}")
            if s_attr != k or soff < -1 or doff < -1 or (depid < 0) != (deps < 0) or depid >= 0:
                where = f"step {k} of {where_tb}"
                if s_attr != k:
                    raise ScheduleError(
                        f"MSCCL XML: {where} has s={s_attr}; steps must be numbered 0, 1, 2, ... in order"
                    )
                if soff < -1 or doff < -1:
                    raise ScheduleError(f"MSCCL XML: {where} has a negative chunk offset")
                if (depid < 0) != (deps < 0):
                    raise ScheduleError(f"MSCCL XML: {where} has depid={depid} but deps={deps}; give both or neither")
            if soff == -1:
                src, soff = None, _int(st, _NS + "srcoff", f"step {k} of {where_tb}", default=0)
            if doff == -1:
                dst, doff = None, _int(st, _NS + "dstoff", f"step {k} of {where_tb}", default=0)
            if soff < 0 or doff < 0:
                raise ScheduleError(f"MSCCL XML: step {k} of {where_tb} has a negative chunk offset")
            dep = None
            if depid >= 0:
                where = f"step {k} of {where_tb}"
                if depid not in raw:
                    raise ScheduleError(f"MSCCL XML: {where} depends on threadblock {depid}, which does not exist")
                if deps >= len(raw[depid][3]):
                    raise ScheduleError(
                        f"MSCCL XML: {where} depends on step {deps} of threadblock {depid}, which has "
                        f"{len(raw[depid][3])} steps"
                    )
                if depid == tid:
                    raise ScheduleError(f"MSCCL XML: {where} depends on its own threadblock")
                dep = (depid, deps)
            marked = at.get(_NS + "dep") == "1"
            if marked and (kind is not OpKind.NOP or dep is None):
                raise ScheduleError(
                    f"MSCCL XML: step {k} of {where_tb} is marked jaxccl:dep but is not a nop with a dependency"
                )
            rows.append((kind, src, soff, dst, doff, cnt, dep, marked))
        parsed.append(rows)

    # Dependency targets must stay ops: a marked nop that something depends on is kept.
    targets = {row[6] for rows in parsed for row in rows if row[6] is not None}
    # Second pass: fold marked nops into the next step and renumber steps to op indices.
    op_index: dict[tuple[int, int], int] = {}
    plans: list[list[tuple[int, list[tuple[int, int]]]]] = []
    for tid, rows in zip(ids, parsed):
        plan: list[tuple[int, list[tuple[int, int]]]] = []
        pending: list[tuple[int, int]] = []
        for k, row in enumerate(rows):
            if row[7] and (tid, k) not in targets and k + 1 < len(rows):
                pending.append(row[6])
                continue
            op_index[(tid, k)] = len(plan)
            plan.append((k, pending))
            pending = []
        plans.append(plan)

    tbs = []
    for tid, rows, plan in zip(ids, parsed, plans):
        send, recv, chan, _ = raw[tid]
        ops = []
        for k, extra in plan:
            kind, src, soff, dst, doff, cnt, dep, _ = rows[k]
            all_deps = ([dep] if dep is not None else []) + extra
            mapped = []
            for dt, ds in all_deps:
                if (dt, ds) not in op_index:  # pragma: no cover - targets are never folded
                    raise ScheduleError(f"MSCCL XML: dependency on folded step {ds} of threadblock {dt}")
                mapped.append((position[dt], op_index[(dt, ds)]))
            key = (kind, src, soff, dst, doff, cnt, tuple(mapped))
            op = cache.get(key)
            try:
                if op is None:
                    op = cache[key] = Op(*key)
                ops.append(op)
            except ScheduleError as e:
                raise ScheduleError(f'MSCCL XML: step {k} of <tb id="{tid}"> of <gpu id="{r}">: {e}') from None
        tbs.append(Threadblock(tuple(ops), send, recv, chan))
    return tbs
