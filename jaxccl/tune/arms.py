"""Contexts and arms: what a tuner chooses between for one collective call.

A *context* is NCCL-BOT's ``x = (collective, P, n)`` (Sec. 4): the
collective, the number of ranks and the message size. The message size
follows nccl-tests: the larger of a rank's two buffers (AllGather: the
output, ``N`` shards; ReduceScatter: the input, ``N`` blocks; AllReduce: the
vector).

An *arm* is one installed way of running a context's collective: a schedule
(ring, recursive doubling, a synthesized tree packing, a direct exchange, an
NCCL-like multi-channel ring, a double binary tree...) or a sequence of
schedules run back to back (AllReduce as ReduceScatter then AllGather, the
way ``jaxccl.psum`` composes it). :func:`arm_catalog` builds every arm jaxccl
has for a collective on a topology, in a fixed order: the arm index breaks
ties in the bandits, so every rank must build the same catalogue.

Example:
    >>> from jaxccl.topology import rail
    >>> [a.name for a in arm_catalog("all_gather", rail(hosts=2, gpus_per_host=4))]
    ['ring', 'nccl_ring', 'rd', 'tree', 'direct']
    >>> ctx = Context("all_gather", 8, 1 << 20)
    >>> ctx.key, ctx.part_bytes("all_gather")
    ('all_gather/8/1048576', 131072.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxccl import synth
from jaxccl.errors import TuneError
from jaxccl.schedule.builder import ScheduleBuilder
from jaxccl.schedule.ir import Buffer, Collective, Schedule
from jaxccl.synth import nccl

__all__ = [
    "COLLECTIVES",
    "Arm",
    "Context",
    "TuneError",
    "arm_catalog",
    "arm_names",
    "direct_allgather",
    "exact_arm",
]

#: The collectives the tuner has arm catalogues for.
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
_CONTEXT_FIELDS = ("collective", "num_ranks", "nbytes")


def _positive_int(value: Any, what: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TuneError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Context:
    """NCCL-BOT's context ``x = (collective, P, n)``.

    Attributes:
        collective: a :class:`~jaxccl.schedule.Collective` value (``"all_gather"``...).
        num_ranks: ranks taking part (``P``).
        nbytes: message size in bytes (``n``; nccl-tests convention, see the module docstring).
    """

    collective: str
    num_ranks: int
    nbytes: int

    def __post_init__(self) -> None:
        try:
            coll = Collective(self.collective).value
        except ValueError:
            known = [c.value for c in Collective]
            raise TuneError(f"unknown collective {self.collective!r}; expected one of {known}") from None
        object.__setattr__(self, "collective", coll)
        _positive_int(self.num_ranks, "Context.num_ranks")
        _positive_int(self.nbytes, "Context.nbytes", minimum=0)

    @property
    def key(self) -> str:
        """A stable string key, ``"collective/ranks/bytes"`` (used in exported state)."""
        return f"{self.collective}/{self.num_ranks}/{self.nbytes}"

    def part_bytes(self, collective: str | Collective) -> float:
        """Input bytes per rank of a schedule of ``collective`` run for this context (the simulator's unit)."""
        coll = Collective(collective)
        if coll is Collective.ALL_GATHER:
            return self.nbytes / self.num_ranks
        return float(self.nbytes)

    def to_dict(self) -> dict[str, Any]:
        return {"collective": self.collective, "num_ranks": self.num_ranks, "nbytes": self.nbytes}

    @classmethod
    def from_key(cls, key: str) -> Context:
        """Parses :attr:`key`."""
        parts = str(key).split("/")
        if len(parts) != 3:
            raise TuneError(f"malformed context key {key!r}; expected 'collective/ranks/bytes'")
        try:
            return cls(parts[0], int(parts[1]), int(parts[2]))
        except ValueError as e:
            if isinstance(e, TuneError):
                raise
            raise TuneError(f"malformed context key {key!r}: {e}") from None

    @classmethod
    def coerce(cls, value: Context | Mapping[str, Any] | Sequence[Any]) -> Context:
        """A Context from a Context, a mapping with exactly its fields, or a ``(collective, ranks, bytes)`` tuple."""
        if isinstance(value, Context):
            return value
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(_CONTEXT_FIELDS))
            if unknown:
                raise TuneError(f"unknown context field(s) {unknown}; a context has {list(_CONTEXT_FIELDS)}")
            missing = [f for f in _CONTEXT_FIELDS if f not in value]
            if missing:
                raise TuneError(f"context is missing field(s) {missing}")
            return cls(value["collective"], value["num_ranks"], value["nbytes"])
        if isinstance(value, (tuple, list)) and len(value) == 3:
            return cls(*value)
        raise TuneError(f"expected a Context, a mapping or a (collective, num_ranks, nbytes) tuple, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way to run a collective: its parts run back to back.

    Attributes:
        name: the arm's name within its catalogue (``"ring"``, ``"tree"``...).
        collective: the collective the whole arm implements.
        parts: the schedules, in execution order (each runs on the bytes
            :meth:`Context.part_bytes` gives for its own collective).
    """

    name: str
    collective: str
    parts: tuple[Schedule, ...]

    @property
    def num_ranks(self) -> int:
        return self.parts[0].num_ranks


def direct_allgather(num_ranks: int) -> Schedule:
    """Direct AllGather: every rank sends its shard straight to every peer (one step, ``N - 1`` messages each).

    Peers are visited starting at ``r + 1`` so that no rank is everyone's first target.

    >>> direct_allgather(4).validate().num_ops
    28
    """
    n = _positive_int(num_ranks, "num_ranks")
    b = ScheduleBuilder(Collective.ALL_GATHER, n, 1)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
        for i in range(1, n):
            b.transfer(r, (r + i) % n, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    return b.build(name="direct_allgather", info={"algorithm": "direct"})


_BUILT: dict[tuple[str, str], Schedule] = {}
_BUILT_MAX = 64


def _built(fn: Callable[[Any], Schedule], topo: Any) -> Schedule:
    """``fn(topo)``, memoized per (builder, topology fingerprint): catalogues share their trees."""
    key = (f"{fn.__module__}.{fn.__qualname__}", topo.fingerprint)
    hit = _BUILT.get(key)
    if hit is None:
        hit = fn(topo)
        if len(_BUILT) >= _BUILT_MAX:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = hit
    return hit


def _catalog_entries(collective: Collective) -> list[tuple[str, Callable[[Any], tuple[Schedule, ...] | None]]]:
    # Imported here: the synthesizers pull in scipy/HiGHS, which the selector alone does not need.

    def pow2(topo: Any) -> bool:
        n = topo.num_gpus
        return n & (n - 1) == 0

    def one(fn: Callable[[Any], Schedule]) -> Callable[[Any], tuple[Schedule, ...]]:
        return lambda topo: (_built(fn, topo),)

    def dag(topo: Any) -> Schedule:
        return direct_allgather(topo.num_gpus)

    def tree_ar(topo: Any) -> Schedule:
        return nccl.nccl_allreduce(topo, method="tree")

    if collective is Collective.ALL_GATHER:
        return [
            ("ring", one(synth.ring_allgather)),
            ("nccl_ring", one(nccl.nccl_allgather)),
            ("rd", lambda t: (_built(synth.recursive_doubling_allgather, t),) if pow2(t) else None),
            ("tree", one(synth.all_gather)),
            ("direct", one(dag)),
        ]
    if collective is Collective.REDUCE_SCATTER:
        return [
            ("ring", one(synth.ring_reduce_scatter)),
            ("nccl_ring", one(nccl.nccl_reduce_scatter)),
            ("tree", one(synth.reduce_scatter)),
            ("direct", one(synth.direct_reduce_scatter)),
        ]
    if collective is Collective.ALL_REDUCE:
        return [
            ("ring", one(synth.ring_allreduce)),
            ("nccl_ring", one(nccl.nccl_allreduce)),
            ("nccl_tree", one(tree_ar)),
            ("ordered", one(synth.ordered_allreduce)),
            ("rs_ag_tree", lambda t: (_built(synth.reduce_scatter, t), _built(synth.all_gather, t))),
            ("rs_ag_direct", lambda t: (_built(synth.direct_reduce_scatter, t), _built(dag, t))),
        ]
    raise TuneError(f"no arm catalogue for {collective.value!r}; the tuner covers {list(COLLECTIVES)}")


def arm_names(collective: str | Collective) -> list[str]:
    """Every arm name the catalogue of ``collective`` may hold, in catalogue order."""
    try:
        coll = Collective(collective)
    except ValueError:
        raise TuneError(f"unknown collective {collective!r}") from None
    return [name for name, _ in _catalog_entries(coll)]


def arm_catalog(collective: str | Collective, topo: Any, *, names: Sequence[str] | None = None) -> list[Arm]:
    """Every arm jaxccl has for ``collective`` on ``topo`` (or the ``names`` among them), in catalogue order.

    Arms that do not apply are left out (recursive doubling needs a power-of-two
    rank count). Schedules are built for ``topo`` as given: to model a
    communicator whose schedules were installed on a healthy fabric that later
    degraded, pass the healthy topology here and simulate on the degraded one.

    Raises:
        TuneError: an unknown collective or arm name.
    """
    try:
        coll = Collective(collective)
    except ValueError:
        raise TuneError(f"unknown collective {collective!r}") from None
    entries = _catalog_entries(coll)
    if names is not None:
        known = [n for n, _ in entries]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise TuneError(f"unknown arm(s) {unknown} for {coll.value}; the catalogue has {known}")
        entries = [(n, f) for n, f in entries if n in set(names)]
    out = []
    for name, build in entries:
        parts = build(topo)
        if parts is not None:
            out.append(Arm(name, coll.value, parts))
    return out


def exact_arm(arm: Arm) -> bool:
    """Whether ``arm``'s float results are bitwise ``jax.lax``'s: every part either reduces nothing or sums in
    ascending rank order (``info["ordered_reduction"]``).

    >>> from jaxccl.topology import rail
    >>> [a.name for a in arm_catalog("reduce_scatter", rail(hosts=2, gpus_per_host=2)) if exact_arm(a)]
    ['direct']
    >>> all(exact_arm(a) for a in arm_catalog("all_gather", rail(hosts=2, gpus_per_host=2)))
    True
    """
    return all(not p.collective.reduces or bool((p.info or {}).get("ordered_reduction")) for p in arm.parts)
