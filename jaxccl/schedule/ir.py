"""The schedule IR: ranks -> threadblocks -> ordered ops on chunk ranges.

This is MSCCL's execution model (see ``docs/schedule-ir.md`` for the full
semantics). Every rank runs a list of threadblocks; a threadblock owns at most
one send peer and one receive peer on one channel and executes its ops in
order; an op may additionally wait for ops of other threadblocks of the same
rank (``deps``). Data lives in three per-rank buffers (input, output,
scratch), each split into chunks.

Chunk layout. A buffer is a sequence of *periods* of ``period`` chunks; a period
holds ``L`` elements (``L`` is fixed by the collective and the array size, see
:func:`period_elements`). Chunk ``i`` covers the elements
``[(i // P) * L + (i % P) * L // P, (i // P) * L + (i % P + 1) * L // P)``, so
chunks of the same class ``i % P`` have the same size even when ``L`` is not a
multiple of ``P``. Every transfer or copy must keep the class: source and
destination offsets are congruent modulo ``period``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxccl.errors import ScheduleError
from jaxccl.util import strict

SCHEMA = "jaxccl.schedule/1"
SCHEMA_VERSION = 1


class Collective(str, enum.Enum):
    """The collective a schedule implements, with its chunk layout.

    With ``C`` = :attr:`Schedule.chunks_per_period` and ``N`` ranks:

    - ``ALL_GATHER``: input ``C`` chunks, output ``N*C``; output chunk
      ``r*C + c`` of every rank is input chunk ``c`` of rank ``r``.
    - ``ALL_TO_ALL``: input and output ``N*C``; input chunk ``d*C + c`` of rank
      ``s`` becomes output chunk ``s*C + c`` of rank ``d``.
    - ``REDUCE_SCATTER``: input ``N*C``, output ``C``; output chunk ``c`` of rank
      ``r`` is the sum over ranks ``s`` of input chunk ``r*C + c`` of ``s``.
    - ``ALL_REDUCE``: input and output ``C``; output chunk ``c`` of every rank is
      the sum over all ranks of their input chunk ``c``.
    """

    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"

    @property
    def code(self) -> int:
        return _COLLECTIVE_CODES[self]

    @property
    def reduces(self) -> bool:
        return self in (Collective.REDUCE_SCATTER, Collective.ALL_REDUCE)

    def buffer_chunks(self, num_ranks: int, c: int) -> tuple[int, int]:
        """``(input chunks, output chunks)`` for ``c`` chunks per period."""
        n = num_ranks
        return {
            Collective.ALL_GATHER: (c, n * c),
            Collective.ALL_TO_ALL: (n * c, n * c),
            Collective.REDUCE_SCATTER: (n * c, c),
            Collective.ALL_REDUCE: (c, c),
        }[self]


_COLLECTIVE_CODES = {
    Collective.ALL_GATHER: 0,
    Collective.ALL_TO_ALL: 1,
    Collective.REDUCE_SCATTER: 2,
    Collective.ALL_REDUCE: 3,
}


class Buffer(enum.IntEnum):
    """A rank's buffers. The MSCCL XML names are ``i``, ``o`` and ``s``."""

    INPUT = 0
    OUTPUT = 1
    SCRATCH = 2

    @property
    def xml(self) -> str:
        return "ios"[self.value]


class OpKind(str, enum.Enum):
    """Op types; the values are MSCCL's XML spellings.

    - ``s``: send ``src`` to the send peer.
    - ``r``: receive from the receive peer into ``dst``.
    - ``rcs``: receive into ``dst``, then send ``dst`` on to the send peer.
    - ``rrc``: receive, add to ``src``, store the sum in ``dst``.
    - ``rrs``: receive, add to ``src``, send the sum (not stored locally).
    - ``rrcs``: receive, add to ``src``, store in ``dst`` and send it.
    - ``cpy``: local copy ``src -> dst``.
    - ``re``: local reduction ``dst = dst + src``.
    - ``nop``: no data; only waits for its ``deps``.
    """

    SEND = "s"
    RECV = "r"
    RECV_COPY_SEND = "rcs"
    RECV_REDUCE_COPY = "rrc"
    RECV_REDUCE_SEND = "rrs"
    RECV_REDUCE_COPY_SEND = "rrcs"
    COPY = "cpy"
    REDUCE = "re"
    NOP = "nop"

    @property
    def code(self) -> int:
        return _OP_CODES[self]

    @property
    def sends(self) -> bool:
        return self in _SENDS

    @property
    def receives(self) -> bool:
        return self in _RECVS

    @property
    def reduces(self) -> bool:
        return self in _REDUCES

    @property
    def reads_src(self) -> bool:
        """Whether the op reads its local ``src`` range."""
        return self in _READS_SRC

    @property
    def writes_dst(self) -> bool:
        """Whether the op writes its local ``dst`` range."""
        return self in _WRITES_DST


_OP_CODES = {k: i for i, k in enumerate(OpKind)}
_new_object = object.__new__
_SENDS = frozenset({OpKind.SEND, OpKind.RECV_COPY_SEND, OpKind.RECV_REDUCE_SEND, OpKind.RECV_REDUCE_COPY_SEND})
_RECVS = frozenset(
    {OpKind.RECV, OpKind.RECV_COPY_SEND, OpKind.RECV_REDUCE_COPY, OpKind.RECV_REDUCE_SEND, OpKind.RECV_REDUCE_COPY_SEND}
)
_REDUCES = frozenset({OpKind.RECV_REDUCE_COPY, OpKind.RECV_REDUCE_SEND, OpKind.RECV_REDUCE_COPY_SEND, OpKind.REDUCE})
_READS_SRC = frozenset(
    {
        OpKind.SEND,
        OpKind.RECV_REDUCE_COPY,
        OpKind.RECV_REDUCE_SEND,
        OpKind.RECV_REDUCE_COPY_SEND,
        OpKind.COPY,
        OpKind.REDUCE,
    }
)
_WRITES_DST = frozenset(
    {
        OpKind.RECV,
        OpKind.RECV_COPY_SEND,
        OpKind.RECV_REDUCE_COPY,
        OpKind.RECV_REDUCE_COPY_SEND,
        OpKind.COPY,
        OpKind.REDUCE,
    }
)


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a threadblock.

    ``src``/``dst`` name a buffer and a chunk offset; ``count`` chunks are
    moved. As in MSCCL XML, a ``send`` may also record where the data lands on
    the peer (``dst``) and a ``recv`` where it came from (``src``); these are
    informational and round-trip through XML and JSON. ``deps`` lists
    ``(threadblock, op index)`` pairs of the same rank that must complete
    before this op starts.
    """

    kind: OpKind
    src: Buffer | None = None
    src_off: int = 0
    dst: Buffer | None = None
    dst_off: int = 0
    count: int = 1
    deps: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        if self.src is not None:
            object.__setattr__(self, "src", Buffer(self.src))
        if self.dst is not None:
            object.__setattr__(self, "dst", Buffer(self.dst))
        object.__setattr__(self, "deps", tuple((int(t), int(s)) for t, s in self.deps))
        if self.kind is not OpKind.NOP and self.count < 1:
            raise ScheduleError(f"op {self.kind.value}: count must be >= 1, got {self.count}")
        if self.src_off < 0 or self.dst_off < 0:
            raise ScheduleError(f"op {self.kind.value}: negative chunk offset")
        if self.kind.reads_src and self.src is None:
            raise ScheduleError(f"op {self.kind.value} needs a src buffer")
        if self.kind.writes_dst and self.dst is None:
            raise ScheduleError(f"op {self.kind.value} needs a dst buffer")

    @staticmethod
    def unchecked(
        kind: OpKind,
        src: Buffer | None,
        src_off: int,
        dst: Buffer | None,
        dst_off: int,
        count: int,
        deps: tuple[tuple[int, int], ...],
    ) -> Op:
        """An op from fields already in normal form, without ``__init__``'s conversions and checks.

        For synthesizers that create 10^5..10^6 ops from values they built
        themselves (enum members, Python ints, a tuple of int pairs), where
        the per-op normalization would dominate (it costs ~5x the object).
        The result equals ``Op(...)`` of the same fields; nothing is checked,
        so :meth:`Schedule.validate` is what vouches for such ops.

        >>> f = (OpKind.SEND, Buffer.INPUT, 3, Buffer.SCRATCH, 1, 2, ((1, 0),))
        >>> Op.unchecked(*f) == Op(*f)
        True
        """
        op = _new_object(Op)  # a staticmethod: a classmethod's dispatch costs 15% of the whole call
        fields = op.__dict__  # the frozen dataclass keeps its fields in the instance dict
        fields["kind"] = kind
        fields["src"] = src
        fields["src_off"] = src_off
        fields["dst"] = dst
        fields["dst_off"] = dst_off
        fields["count"] = count
        fields["deps"] = deps
        return op


@dataclasses.dataclass(frozen=True)
class Threadblock:
    """An ordered list of ops with at most one send peer and one receive peer.

    ``send_peer``/``recv_peer`` are ranks or ``-1`` for none. A rank has at
    most one threadblock per (send peer, channel) and per (receive peer,
    channel): the k-th sending op of rank a's threadblock towards b on channel
    c is received by the k-th receiving op of b's threadblock from a on c.
    """

    ops: tuple[Op, ...]
    send_peer: int = -1
    recv_peer: int = -1
    channel: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))

    @staticmethod
    def unchecked(ops: tuple[Op, ...], send_peer: int, recv_peer: int, channel: int = 0) -> Threadblock:
        """A threadblock from an ops tuple, without ``__init__``'s conversion (see :meth:`Op.unchecked`).

        >>> ops = (Op(OpKind.SEND, Buffer.INPUT, 0),)
        >>> Threadblock.unchecked(ops, 1, -1) == Threadblock(ops, 1, -1)
        True
        """
        tb = _new_object(Threadblock)
        fields = tb.__dict__
        fields["ops"] = ops
        fields["send_peer"] = send_peer
        fields["recv_peer"] = recv_peer
        fields["channel"] = channel
        return tb


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A collective schedule for ``num_ranks`` ranks.

    Attributes:
        collective: which collective it implements.
        num_ranks: the number of ranks (GPUs) it is written for.
        chunks_per_period: ``C`` of :class:`Collective`'s layout.
        ranks: per rank, its threadblocks.
        scratch_chunks: size of each rank's scratch buffer, in chunks.
        name: a human-readable label (``"ring"``, ``"forestcoll"``...).
        algbw: predicted algorithm bandwidth in bytes/s (output bytes of one
            rank / time, large-message limit), when known.
        bound: the topology's upper bound on ``algbw`` for this collective.
        info: anything else a synthesizer reports (trees, cuts, slacks...);
            must be JSON-serializable. Not part of :attr:`digest`.
    """

    collective: Collective
    num_ranks: int
    chunks_per_period: int
    ranks: tuple[tuple[Threadblock, ...], ...]
    scratch_chunks: int = 0
    name: str = ""
    algbw: float | None = None
    bound: float | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "collective", Collective(self.collective))
        object.__setattr__(self, "ranks", tuple(tuple(tbs) for tbs in self.ranks))
        if self.num_ranks < 1:
            raise ScheduleError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.chunks_per_period < 1:
            raise ScheduleError(f"chunks_per_period must be >= 1, got {self.chunks_per_period}")
        if len(self.ranks) != self.num_ranks:
            raise ScheduleError(f"schedule has programs for {len(self.ranks)} ranks but num_ranks={self.num_ranks}")
        if self.scratch_chunks < 0:
            raise ScheduleError("scratch_chunks must be >= 0")

    # ----------------------------------------------------------------- layout
    @property
    def period(self) -> int:
        return self.chunks_per_period

    @property
    def in_chunks(self) -> int:
        return self.collective.buffer_chunks(self.num_ranks, self.chunks_per_period)[0]

    @property
    def out_chunks(self) -> int:
        return self.collective.buffer_chunks(self.num_ranks, self.chunks_per_period)[1]

    def buffer_chunks(self, buf: Buffer) -> int:
        return (self.in_chunks, self.out_chunks, self.scratch_chunks)[Buffer(buf)]

    # Cached: the programs are immutable (tuples of frozen threadblocks and ops).
    @functools.cached_property
    def num_threadblocks(self) -> int:
        return sum(len(tbs) for tbs in self.ranks)

    @functools.cached_property
    def num_ops(self) -> int:
        return sum(len(tb.ops) for tbs in self.ranks for tb in tbs)

    # ------------------------------------------------------------ validation
    def validate(self, *, num_slots: int | None = None, ordered_reduction: bool | None = None) -> Schedule:
        """Checks the schedule with the reference interpreter; returns ``self``.

        Raises :class:`jaxccl.ScheduleError` naming the first problem: a
        malformed op, a chunk that ends up with the wrong data, an unmatched
        or mis-ordered send/receive, a dependency cycle, or a deadlock with
        ``num_slots`` message slots per connection. With
        ``ordered_reduction=True`` a reduction must also sum in ascending rank
        order (bitwise equal to ``jax.lax`` on CPU); the default checks it
        when ``info["ordered_reduction"]`` is true.
        """
        from jaxccl.schedule.interpreter import DEFAULT_NUM_SLOTS, check  # cycle: the interpreter imports ir

        check(self, num_slots=num_slots, ordered_reduction=ordered_reduction)
        if num_slots in (None, DEFAULT_NUM_SLOTS) and ordered_reduction is None:
            self.__dict__["_passed_default_check"] = True  # what the executors run with; see `validated`
        return self

    @property
    def validated(self) -> bool:
        """Whether :meth:`validate` passed on this object with its defaults (the executors' slots and order).

        >>> from jaxccl.synth.baselines import ring_allgather
        >>> s = ring_allgather(4)
        >>> s.validated, s.validate().validated
        (False, True)
        """
        return self.__dict__.get("_passed_default_check", False)

    # ---------------------------------------------------------------- digest
    def program_dict(self) -> dict[str, Any]:
        """The executable part (everything but name/algbw/bound/info) as plain data."""
        return {
            "collective": self.collective.value,
            "num_ranks": self.num_ranks,
            "chunks_per_period": self.chunks_per_period,
            "scratch_chunks": self.scratch_chunks,
            "ranks": [[_tb_to_dict(tb) for tb in tbs] for tbs in self.ranks],
        }

    @functools.cached_property
    def digest(self) -> str:
        """Content hash of the executable part, stable across processes."""
        payload = json.dumps({"schema": SCHEMA, **self.program_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (
            self.digest == other.digest
            and self.name == other.name
            and self.algbw == other.algbw
            and self.bound == other.bound
            and dict(self.info) == dict(other.info)
        )

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        bw = f", algbw={self.algbw / 1e9:.2f} GB/s" if self.algbw else ""
        return (
            f"Schedule({self.collective.value}, {self.name or 'unnamed'}, N={self.num_ranks}, "
            f"C={self.chunks_per_period}, {self.num_threadblocks} threadblocks, {self.num_ops} ops{bw})"
        )

    # ------------------------------------------------------------ conversion
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            **self.program_dict(),
            "name": self.name,
            "algbw": self.algbw,
            "bound": self.bound,
            "info": dict(self.info),
        }

    def to_json(self, *, indent: int | None = None) -> str:
        """Serializes to JSON; :meth:`from_json` restores an equal Schedule."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        """Restores :meth:`to_dict` output; malformed input raises ``ScheduleError`` naming the field."""
        if not isinstance(data, Mapping):
            raise ScheduleError("schedule JSON must be an object")
        if data.get("schema") != SCHEMA:
            raise ScheduleError(f"unsupported schedule schema {data.get('schema')!r}; expected {SCHEMA!r}")
        try:
            ranks = data["ranks"]
            if not isinstance(ranks, list) or not all(isinstance(tbs, list) for tbs in ranks):
                raise ScheduleError("schedule JSON: 'ranks' must be a list of lists of threadblocks")
            info = data.get("info") or {}
            if not isinstance(info, Mapping):
                raise ScheduleError(f"schedule JSON: 'info' must be an object, got {type(info).__name__}")
            strict.nesting(info, "schedule JSON: 'info'", ScheduleError)  # free-form: to_json recurses
            name = data.get("name", "")
            if not isinstance(name, str):
                raise ScheduleError(f"schedule JSON: 'name' must be a string, got {name!r}")
            return cls(
                collective=Collective(data["collective"]),
                num_ranks=strict.integer(data["num_ranks"], "schedule JSON: num_ranks", ScheduleError, minimum=1),
                chunks_per_period=strict.integer(
                    data["chunks_per_period"], "schedule JSON: chunks_per_period", ScheduleError, minimum=1
                ),
                scratch_chunks=strict.integer(
                    data.get("scratch_chunks", 0), "schedule JSON: scratch_chunks", ScheduleError, minimum=0
                ),
                ranks=tuple(
                    tuple(_tb_from_dict(tb, f"rank {r} threadblock {t}") for t, tb in enumerate(tbs))
                    for r, tbs in enumerate(ranks)
                ),
                name=name,
                algbw=_optional_rate(data.get("algbw"), "algbw"),
                bound=_optional_rate(data.get("bound"), "bound"),
                info=dict(info),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, ScheduleError):
                raise
            raise ScheduleError(f"malformed schedule JSON: {type(e).__name__}: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Parses :meth:`to_json` output; malformed input raises ``ScheduleError``."""
        return cls.from_dict(strict.load_json(text, "schedule JSON", ScheduleError))

    def to_msccl_xml(
        self, *, min_bytes: int = 0, max_bytes: int | None = None, proto: str = "Simple", runtime_limits: bool = True
    ) -> str:
        """Exports MSCCL XML (``<algo>/<gpu>/<tb>/<step>``); see :mod:`jaxccl.schedule.msccl_xml`."""
        from jaxccl.schedule.msccl_xml import to_msccl_xml  # cycle: msccl_xml imports ir

        return to_msccl_xml(self, min_bytes=min_bytes, max_bytes=max_bytes, proto=proto, runtime_limits=runtime_limits)

    def replace(self, **changes: Any) -> Schedule:
        """A copy with fields replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


def _tb_to_dict(tb: Threadblock) -> dict[str, Any]:
    return {
        "send": tb.send_peer,
        "recv": tb.recv_peer,
        "chan": tb.channel,
        "ops": [_op_to_list(op) for op in tb.ops],
    }


def _op_to_list(op: Op) -> list[Any]:
    return [
        op.kind.value,
        None if op.src is None else op.src.xml,
        op.src_off,
        None if op.dst is None else op.dst.xml,
        op.dst_off,
        op.count,
        [list(d) for d in op.deps],
    ]


def _buf_from_xml(name: str | None) -> Buffer | None:
    if name is None:
        return None
    try:
        return Buffer("ios".index(name))
    except ValueError as e:
        raise ScheduleError(f"unknown buffer {name!r}; expected 'i', 'o' or 's'") from e


def _optional_rate(value: Any, what: str) -> float | None:
    return None if value is None else strict.real(value, f"schedule JSON: {what}", ScheduleError, positive=True)


def _tb_from_dict(d: Mapping[str, Any], where: str) -> Threadblock:
    if not isinstance(d, Mapping):
        raise ScheduleError(f"schedule JSON: {where} must be an object, got {type(d).__name__}")
    ops = []
    items = d["ops"]
    if not isinstance(items, list):
        raise ScheduleError(f"schedule JSON: 'ops' of {where} must be a list")
    for i, item in enumerate(items):
        here = f"schedule JSON: op {i} of {where}"
        if not isinstance(item, list) or len(item) != 7:
            raise ScheduleError(f"{here} must be a list [kind, src, src_off, dst, dst_off, count, deps]")
        kind, src, soff, dst, doff, cnt, deps = item
        if not isinstance(deps, list) or not all(isinstance(x, list) and len(x) == 2 for x in deps):
            raise ScheduleError(f"{here}: deps must be a list of [threadblock, op] pairs")
        ops.append(
            Op(
                OpKind(kind),
                _buf_from_xml(src),
                strict.integer(soff, f"{here}: src_off", ScheduleError, minimum=0),
                _buf_from_xml(dst),
                strict.integer(doff, f"{here}: dst_off", ScheduleError, minimum=0),
                strict.integer(cnt, f"{here}: count", ScheduleError, minimum=0),
                tuple(
                    (
                        strict.integer(t, f"{here}: dependency threadblock", ScheduleError, minimum=0),
                        strict.integer(o, f"{here}: dependency op", ScheduleError, minimum=0),
                    )
                    for t, o in deps
                ),
            )
        )
    return Threadblock(
        tuple(ops),
        strict.integer(d["send"], f"schedule JSON: send peer of {where}", ScheduleError, minimum=-1),
        strict.integer(d["recv"], f"schedule JSON: recv peer of {where}", ScheduleError, minimum=-1),
        strict.integer(d.get("chan", 0), f"schedule JSON: channel of {where}", ScheduleError, minimum=0),
    )


def chunk_bounds(index: int, period: int, period_elems: int) -> tuple[int, int]:
    """Element range ``[start, stop)`` of chunk ``index`` (see the module docstring).

    >>> [chunk_bounds(i, 3, 10) for i in range(4)]
    [(0, 3), (3, 6), (6, 10), (10, 13)]
    """
    base = (index // period) * period_elems
    cls = index % period
    return base + cls * period_elems // period, base + (cls + 1) * period_elems // period


def period_elements(collective: Collective, num_ranks: int, input_elems: int) -> int:
    """Elements per period ``L`` for a rank's input of ``input_elems`` elements.

    AllGather and AllReduce: the whole input; AllToAll and ReduceScatter: one
    ``num_ranks``-th of it (the input must divide evenly).
    """
    collective = Collective(collective)
    if collective in (Collective.ALL_GATHER, Collective.ALL_REDUCE):
        return input_elems
    if input_elems % num_ranks:
        raise ScheduleError(
            f"{collective.value}: input of {input_elems} elements does not split evenly over {num_ranks} ranks"
        )
    return input_elems // num_ranks


def make_schedule(
    collective: Collective | str,
    num_ranks: int,
    chunks_per_period: int,
    programs: Sequence[Iterable[Threadblock]],
    **kwargs: Any,
) -> Schedule:
    """Convenience constructor accepting lists for the rank programs."""
    return Schedule(
        collective=Collective(collective),
        num_ranks=num_ranks,
        chunks_per_period=chunks_per_period,
        ranks=tuple(tuple(p) for p in programs),
        **kwargs,
    )
