"""REACT's epochs on the native CPU executor with link emulation: per-message times from the executor trace.

:class:`ExecutorRunner` is a :data:`~jaxccl.tune.react.measure.Runner` that
runs a schedule once on a :class:`~jaxccl.Communicator` whose CPU executor
paces every message over the links of the emulated topology
(``link_emulation=LinkEmulation(..., trace=True)``). For each call it

1. injects ``topology`` into the emulated network if it is not the one
   running (``comm.inject``: live capacity change, nothing recompiles),
2. installs ``schedule`` if it is not the active one (``comm.install``: the
   reference interpreter checks it, the executor hot-swaps it),
3. runs the collective on random integer data inside ``jax.shard_map`` and
   checks the result bitwise against ``jax.lax`` (``check=True``),
4. turns the executor's trace of delivered messages
   (:data:`jaxccl.runtime.emulated.TRACE_DTYPE`) into a
   :class:`~jaxccl.tune.react.measure.Measurement` (:func:`trace_measurement`).

Times are *emulated* seconds (real seconds times ``time_scale``), so algbw is
in the topology's units and comparable with the simulator. A message starts
when its sender posted it (queueing on a busy link counts, as in a flow's
completion time) and, with ``end="link"`` (default), ends when its last byte
reached the receiver over the emulated links (``tx_end`` plus the route's
latency, what a NIC completion timestamp says); ``end="observed"`` uses the time
the receiving thread saw it (adds the host's wake-up latency: noisier on a
loaded machine). The collective's time is the span from the first post to the
last end.

Integer data because a REACT swap changes the order of a reduction: integer
sums are exact, so a transformed AllReduce must still equal ``jax.lax.psum``
bit for bit (see :mod:`jaxccl.tune.react.compile`).

Example (8 emulated CPU devices, ``jaxccl.emulate(8)`` before JAX starts):

.. code-block:: python

    from jaxccl.topology import fat_tree
    from jaxccl.tune import react
    topo = fat_tree(1, 8)
    runner = react.ExecutorRunner.create(topo, 1 << 20, time_scale=5e-4)
    m = runner(react.double_binary_tree_pattern(8).to_schedule(), topo)
    m.algbw / 1e9            # ~9.3 GB/s emulated (the simulator, store-and-forward: 9.5)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl.errors import ExecutorError, ScheduleError, TuneError
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.schedule.ir import Collective, Schedule, chunk_bounds, period_elements
from jaxccl.tune.react.measure import Measurement
from jaxccl.util.options import choose

__all__ = [
    "END_MODES",
    "ExecutorRunner",
    "expected_sends",
    "interleaved_runs",
    "table_op_indices",
    "trace_measurement",
]

END_MODES = ("link", "observed")
OpKey = tuple[int, int, int]


def expected_sends(schedule: Schedule, input_elems: int, itemsize: int) -> dict[OpKey, int]:
    """Bytes of the message of every sending op ``(rank, threadblock, op)`` of ``schedule``.

    Args:
        schedule: the schedule.
        input_elems: elements of one rank's input buffer.
        itemsize: bytes per element.
    """
    period_elems = period_elements(schedule.collective, schedule.num_ranks, input_elems)
    c = schedule.chunks_per_period
    out: dict[OpKey, int] = {}
    for r, tbs in enumerate(schedule.ranks):
        for t, tb in enumerate(tbs):
            for o, op in enumerate(tb.ops):
                if op.kind.sends:
                    lo = chunk_bounds(op.src_off, c, period_elems)[0]
                    hi = chunk_bounds(op.src_off + op.count - 1, c, period_elems)[1]
                    out[(r, t, o)] = (hi - lo) * itemsize
    return out


def table_op_indices(schedule: Schedule) -> list[list[list[int]]]:
    """``[rank][threadblock][op]``: the index of each schedule op in its threadblock of the compiled table.

    The executor's trace names ops by their index in the compiled table
    (``docs/schedule-ir.md``, "Compiled table"), where an op with ``k > 1``
    dependencies on other threadblocks is preceded by ``k - 1`` ``nop`` ops
    (one dependency each); threadblock indices are unchanged.
    """
    out: list[list[list[int]]] = []
    for tbs in schedule.ranks:
        per_rank = []
        for t, tb in enumerate(tbs):
            idx, k = [], 0
            for op in tb.ops:
                k += max(len({d for d in op.deps if d[0] != t}) - 1, 0)
                idx.append(k)
                k += 1
            per_rank.append(idx)
        out.append(per_rank)
    return out


def trace_measurement(
    trace: np.ndarray,
    schedule: Schedule,
    *,
    time_scale: float,
    topology: Any,
    output_bytes: float,
    expected: Mapping[OpKey, int] | None = None,
    end: str = "link",
    wall_s: float = float("nan"),
) -> Measurement:
    """A :class:`Measurement` of one run of ``schedule`` from the executor's trace of that run.

    Every record is keyed by its sender's ``(rank, threadblock, op)`` (the
    trace's table op index mapped back to the schedule's, :func:`table_op_indices`);
    a key seen more than once (an op whose message was split) gets the
    earliest post and the latest end.

    Args:
        trace: ``TRACE_DTYPE`` records of exactly one run of ``schedule``.
        schedule: what ran.
        time_scale: the link emulation's scale (real seconds times it = emulated seconds).
        topology: the emulated fabric during the run (route latencies for ``end="link"``).
        output_bytes: bytes of one rank's output (``algbw = output_bytes / time_s``).
        expected: bytes of every sending op's message (:func:`expected_sends`); when given, the trace
            must have exactly these ops with exactly these bytes.
        end: ``"link"`` or ``"observed"`` (see the module docstring).
        wall_s: real seconds the call took (kept in :attr:`Measurement.wall_s`).

    Raises:
        ExecutorError: the trace is empty, names an op that does not send to that receiver, lacks a
            sending op, or carries other bytes than expected.
        OptionError: unknown ``end``.
    """
    choose("end", end, END_MODES)
    if len(trace) == 0:
        raise ExecutorError(f"executor trace of schedule {schedule.name!r} is empty (was trace=True set?)")
    src, dst = trace["src"].astype(np.int64), trace["dst"].astype(np.int64)
    n = schedule.num_ranks
    if src.min() < 0 or dst.min() < 0 or src.max() >= n or dst.max() >= n:
        raise ExecutorError(f"executor trace names ranks outside 0..{n - 1} of schedule {schedule.name!r}")
    post = trace["post_ns"].astype(np.int64)
    if end == "link":
        lat = np.zeros((n, n))
        for a, b in {(int(a), int(b)) for a, b in zip(src.tolist(), dst.tolist())}:
            lat[a, b] = topology.path_latency(a, b)
        t_end = (trace["tx_end_ns"].astype(np.int64) - post.min()) * 1e-9 * time_scale + lat[src, dst]
    else:
        t_end = (trace["observed_ns"].astype(np.int64) - post.min()) * 1e-9 * time_scale
    t_start = (post - post.min()) * 1e-9 * time_scale
    spans: dict[OpKey, list[float]] = {}
    got: dict[OpKey, int] = {}
    ranks = schedule.ranks
    to_op = [[{j: i for i, j in enumerate(tb)} for tb in r] for r in table_op_indices(schedule)]
    for i, rec in enumerate(trace):
        r, t, j = int(rec["src"]), int(rec["src_tb"]), int(rec["src_op"])
        if not (0 <= r < len(ranks) and 0 <= t < len(ranks[r])):
            raise ExecutorError(f"trace record from {(r, t, j)} names no threadblock of schedule {schedule.name!r}")
        tb = ranks[r][t]
        o = to_op[r][t].get(j, -1)
        if o < 0 or not tb.ops[o].kind.sends or tb.send_peer != int(rec["dst"]):
            raise ExecutorError(
                f"trace record from rank {r}, threadblock {t}, table op {j} to {int(rec['dst'])} "
                f"is not a send of schedule {schedule.name!r}"
            )
        key = (r, t, o)
        s = spans.get(key)
        if s is None:
            spans[key] = [float(t_start[i]), float(t_end[i])]
        else:
            s[0], s[1] = min(s[0], float(t_start[i])), max(s[1], float(t_end[i]))
        got[key] = got.get(key, 0) + int(rec["bytes"])
    if expected is not None:
        missing = sorted(set(expected) - set(got))
        if missing:
            raise ExecutorError(
                f"executor trace lacks {len(missing)} sending op(s) of {schedule.name!r}, e.g. {missing[0]}"
            )
        wrong = [k for k, b in got.items() if expected.get(k) != b]
        if wrong:
            k = wrong[0]
            raise ExecutorError(f"sending op {k} carried {got[k]} bytes, the schedule says {expected.get(k)}")
    op_times = {k: (v[0], v[1]) for k, v in spans.items()}
    return Measurement(float(t_end.max()), float(output_bytes), op_times, wall_s=wall_s)


class ExecutorRunner:
    """A REACT :data:`~jaxccl.tune.react.measure.Runner` on the emulated CPU executor (see the module docstring).

    Args:
        comm: a CPU :class:`~jaxccl.Communicator` with ``link_emulation=LinkEmulation(..., trace=True)``.
        bytes_per_rank: input bytes of one rank (rounded down to whole ``int32`` elements, a multiple
            of ``2 N`` so every pattern's chunks are equal).
        seed: seeds the random (never all-zero) input.
        end: message end time, ``"link"`` or ``"observed"``.
        check: compare every result bitwise with ``jax.lax`` (raises :class:`ExecutorError` if not equal).

    Attributes:
        runs: collectives run so far; ``installs`` / ``injections``: schedule and topology changes made.
    """

    def __init__(self, comm: Any, bytes_per_rank: float, *, seed: int = 0, end: str = "link", check: bool = True):
        net = getattr(comm, "network", None)
        if net is None:
            raise ExecutorError("ExecutorRunner needs a Communicator with link_emulation=LinkEmulation(trace=True)")
        if not net.config.trace:
            raise ExecutorError("ExecutorRunner needs LinkEmulation(trace=True): per-message times come from the trace")
        choose("end", end, END_MODES)
        n = comm.axis_size
        elems = int(bytes_per_rank) // 4 // (2 * n) * (2 * n)
        if elems < 2 * n:
            raise TuneError(f"bytes_per_rank must be at least {8 * n} (2 N int32 elements), got {bytes_per_rank!r}")
        self.comm = comm
        self.num_ranks = n
        self.elems = elems
        self.end = end
        self.check = check
        self.time_scale = float(net.config.time_scale)
        rng = np.random.default_rng(seed)
        x = rng.integers(-(2**20), 2**20, size=n * elems, dtype=np.int32)
        x[x == 0] = 1  # never zero: a lost contribution always shows
        self.x = x
        self._fns: dict[Collective, tuple[Any, np.ndarray, float]] = {}
        self._installed: dict[Collective, str] = {}
        self._expected: dict[str, dict[OpKey, int]] = {}
        self.runs = self.installs = self.injections = 0

    @classmethod
    def create(
        cls,
        topology: Any,
        bytes_per_rank: float,
        *,
        time_scale: float,
        axis_name: str = "react",
        **kwargs: Any,
    ) -> ExecutorRunner:
        """A runner on a new communicator over the first ``topology.num_gpus`` JAX devices.

        ``kwargs`` go to :class:`ExecutorRunner` (``seed``, ``end``, ``check``).
        """
        import jax
        from jax.sharding import Mesh

        from jaxccl.runtime.communicator import Communicator  # imports JAX

        n = topology.num_gpus
        devices = jax.devices()
        if len(devices) < n:
            raise ExecutorError(f"ExecutorRunner: {n} devices needed, JAX has {len(devices)} (jaxccl.emulate({n}))")
        mesh = Mesh(np.array(devices[:n]), (axis_name,))
        emu = LinkEmulation(time_scale=time_scale, trace=True, measure=False)
        comm = Communicator(mesh, axis_name, topology=topology, backend="cpu", link_emulation=emu)
        return cls(comm, bytes_per_rank, **kwargs)

    @property
    def input_bytes(self) -> int:
        """Bytes of one rank's input."""
        return self.elems * 4

    def _fn(self, coll: Collective) -> tuple[Any, np.ndarray, float]:
        got = self._fns.get(coll)
        if got is not None:
            return got
        import jax
        from jax.sharding import PartitionSpec as P

        from jaxccl.runtime.collectives import all_gather, psum  # imports JAX

        ax, mesh = self.comm.axis_name, self.comm.mesh
        if coll is Collective.ALL_REDUCE:
            mine, ref = (lambda v: psum(v, ax)), (lambda v: jax.lax.psum(v, ax))
            out_bytes = float(self.elems * 4)
        elif coll is Collective.ALL_GATHER:
            mine = lambda v: all_gather(v, ax, tiled=True)  # noqa: E731
            ref = lambda v: jax.lax.all_gather(v, ax, tiled=True)  # noqa: E731
            out_bytes = float(self.elems * 4 * self.num_ranks)
        else:
            raise ScheduleError(f"ExecutorRunner runs all_reduce and all_gather schedules, not {coll.value}")

        def jit(fn: Any) -> Any:
            return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(ax), out_specs=P(ax)))

        want = np.asarray(jit(ref)(self.x))
        got = self._fns[coll] = (jit(mine), want, out_bytes)
        return got

    def prepare(self, schedule: Schedule, topology: Any) -> None:
        """Injects ``topology`` and installs ``schedule`` if they are not the running ones."""
        net = self.comm.network
        if topology is not None and topology.fingerprint != net.topology.fingerprint:
            self.comm.inject(topology)
            self.injections += 1
        coll = schedule.collective
        if self._installed.get(coll) != schedule.digest:
            self.comm.install(coll, schedule)
            self._installed[coll] = schedule.digest
            self.installs += 1

    def __call__(self, schedule: Schedule, topology: Any) -> Measurement:
        """Runs ``schedule`` once on ``topology`` (see the module docstring)."""
        self.prepare(schedule, topology)
        fn, want, out_bytes = self._fn(schedule.collective)
        net = self.comm.network
        net.take_trace()  # whatever ran before is not this run
        with self.comm:
            t0 = time.perf_counter()
            y = fn(self.x)
            y.block_until_ready()
            wall = time.perf_counter() - t0
        trace = net.take_trace()
        self.runs += 1
        if self.check and np.asarray(y).tobytes() != want.tobytes():
            raise ExecutorError(f"schedule {schedule.name!r}: executor result differs from jax.lax (bitwise)")
        expected = self._expected.get(schedule.digest)
        if expected is None:
            expected = self._expected[schedule.digest] = expected_sends(schedule, self.elems, 4)
        return trace_measurement(
            trace,
            schedule,
            time_scale=self.time_scale,
            topology=net.topology,
            output_bytes=out_bytes,
            expected=expected,
            end=self.end,
            wall_s=wall,
        )


def interleaved_runs(
    runner: Any, schedules: Sequence[Schedule], topology: Any, *, runs: int, warmup: int = 1
) -> list[list[Measurement]]:
    """Runs each of ``schedules`` ``runs`` times, interleaved (A B A B ...), after ``warmup`` untimed rounds.

    Interleaving spreads drifts in the host's load evenly over the schedules.
    Returns one list of measurements per schedule.
    """
    if runs < 1:
        raise TuneError(f"runs must be >= 1, got {runs}")
    out: list[list[Measurement]] = [[] for _ in schedules]
    for i in range(warmup + runs):
        for k, s in enumerate(schedules):
            m = runner(s, topology)
            if i >= warmup:
                out[k].append(m)
    return out
