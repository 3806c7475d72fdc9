"""How a :class:`~jaxccl.schedule.Schedule` becomes flows: the simulator's execution model.

The model is MSCCL's (``docs/schedule-ir.md``) seen at flow level:

* **Messages.** The k-th sending op of rank ``a``'s threadblock towards ``b`` on
  channel ``c`` is matched with the k-th receiving op of ``b``'s threadblock from
  ``a`` on ``c``; the pair is one *message* of ``count x chunk bytes`` bytes, and
  one flow over the route ``a -> b`` of the topology (its primary route; see
  :class:`jaxccl.sim.routes.Router` for ECMP). Chunk bytes are
  ``bytes_per_rank / input chunks`` (fluid: no rounding to elements).
* **Threadblocks** run their ops by readiness (``execution="dataflow"``, the
  default), by the executors' rule as :mod:`jaxccl.sim.ordering` ports it: an
  op is *ready* when the earlier ops of its rank that its data needs have
  completed (overlapping chunks with a write, as a program-order run orders
  them) and so has the one dependency the compiled table keeps for it; a
  ``nop`` orders nothing; a threadblock starts an op (of an iteration) only
  once all its ops at least ``LOOKAHEAD`` (256) units before it completed; a
  schedule that deadlocks in program order runs in program order. An op whose
  data is ready never waits behind an unrelated op of its threadblock (no
  head-of-line blocking). ``execution="in_order"`` is MSCCL's original
  runtime: an op waits for all its ``deps`` and for the previous op of its
  threadblock. A sending op
  completes when its flow has pushed the last byte (sends are eager: the sender
  does not wait for the receiving op); a receiving op completes when it is ready
  and the whole message has arrived (last byte sent + the route's latency); a
  fused op (``rcs``, ``rrs``, ``rrcs``) completes when both halves have. Local
  ops (``cpy``, ``re``, ``nop``) take no time; reductions are free (no compute
  model), as in SimAI's network-only runs.
* **Slots.** A message streams into its receiving op when that op is
  running; until then it waits in one of its connection's ``num_slots``
  slots (``None``: unbounded). A message whose receiving op is not running
  and whose connection has no free slot waits for one: a slot frees when the
  receiving op of the message in it starts, and waiting messages take freed
  slots first come, first served. Slots are not bound to sequence numbers,
  so a late message does not hold back later ones.
* **Data dependencies and pipelining.** A rank forwards only data it has: a
  sending op whose data comes from a receive (its own fused receive, a
  ``dep`` on a receiving op, or under dataflow execution an earlier receiving
  op of its threadblock that writes what it reads) starts only once that
  receiving op is ready and the first *pipeline piece* of the incoming
  message has arrived; while the incoming flow is still running, the outgoing
  flow is rate-coupled to it (it cannot get ahead of the data it forwards:
  ``rate / weight`` no larger than its source's, see **Rates**), and the
  forwarding op completes only after the receiving op. This is cut-through
  forwarding at piece granularity. Under ``sharing="tiles"`` a piece is one
  tile of the message (a forward's tile ``t`` waits for tile ``t`` of its
  receive, as in the executors); under ``sharing="messages"`` it is
  ``pipeline_bytes``, the fluid limit of MSCCL/NCCL slicing a chunk into
  protocol-sized steps. ``pipeline_bytes=None`` is store-and-forward (the
  whole message must have arrived) under both. A message no larger than one
  piece is always store-and-forward. Under ``sharing="tiles"`` every
  dependency on a receiving or local op is resolved tile by tile, as the
  executors do (``UnitReady``: tile ``t`` of an op waits for tile ``t`` of
  its dependencies): a receive that reduces into what an earlier receive
  wrote (``rrc`` after ``rrc``) runs alongside it, and a send after such a
  chain streams from every message of the chain. Dependencies on a send, and
  under ``sharing="messages"`` every dependency but a send's on a receive,
  wait for full completion.
* **Tiling (MSCCL's loop).** With ``Job.iterations = P`` the schedule runs
  ``P`` times on ``1/P`` of the buffer, each threadblock going through its ops
  once per iteration, so a threadblock stalled on one op of iteration ``p``
  does not hold back the data of iteration ``p - 1``;
  :func:`auto_iterations` picks MSCCL's count, one protocol step per chunk and
  iteration. Tiling matters for in-order execution; dataflow execution needs
  none, and the default is one iteration.
* **Rates.** Concurrent flows share every link max-min fairly, weighted by the
  bytes of their *tiles* (``sharing="tiles"``, the default): jaxccl's
  executors cut a launch into tiles (``xla_ffi/core/protocol.h``,
  ``ChooseTiles``: the largest message over 64 KiB, at most 256 tiles), a
  threadblock walks its units tile by tile, and a link serves the posted
  tiles of its connections in turn, so every active message advances by one
  tile per turn: its rate is proportional to its tile bytes, and the messages
  of one tree period finish together as the synthesizer plans them.
  ``sharing="messages"`` gives every message an equal share whatever its size
  (the earlier model). A forward's rate is also capped by its sources' (see
  :mod:`jaxccl.sim.engine`); it rises at the pace of the smaller of its own
  weight and its source's.

:func:`compile_jobs` turns jobs into a static event DAG (:class:`Program`);
:mod:`jaxccl.sim.engine` runs it. Node kinds per op: READY, COMPLETE; per
message: LAUNCH (the flow may start), END (last byte sent), ARR (END + the
route latency), GOT (the receiving op has the whole message); per job: START.
A node's time is the max of its predecessors' times (ARR adds the latency; END
comes from the flow simulation). The first-piece condition of a forward is not
a DAG edge but a *gate* on its LAUNCH (``msg_src_*``): the engine opens it at
``first piece sent + latency`` of the source, computed from the source flow's
progress, so that no event is spent on first pieces nobody waits for.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence

import numpy as np

from jaxccl.errors import ArgumentError, ScheduleError, TopologyError
from jaxccl.schedule.ir import Schedule, Threadblock
from jaxccl.sim.ordering import LOOKAHEAD, dataflow_order
from jaxccl.sim.routes import Router
from jaxccl.util.options import choose

__all__ = [
    "DEFAULT_FLOW_BUDGET",
    "DEFAULT_PIPELINE_BYTES",
    "DEFAULT_SLOTS",
    "EXECUTIONS",
    "SHARINGS",
    "Job",
    "Program",
    "auto_iterations",
    "compile_jobs",
]

DEFAULT_PIPELINE_BYTES = 512 * 1024  # NCCL's Simple protocol: 4 MiB buffer / 8 steps per channel
DEFAULT_SLOTS = 8  # MSCCL's slots per connection
DEFAULT_FLOW_BUDGET = 400_000  # messages x iterations that iterations="auto" allows
MAX_AUTO_ITERATIONS = 16
EXECUTIONS = ("dataflow", "in_order")  # how a threadblock runs its ops; see the module docstring
SHARINGS = ("tiles", "messages")  # how flows weigh in max-min link sharing; see the module docstring
# The executor's tiling rule (xla_ffi/core/protocol.h: kMaxTiles, kMinTileBytes, ChooseTiles); the native
# module exports the executor's values as MAX_TILES and MIN_TILE_BYTES, and a test checks these against them.
MAX_TILES = 256
MIN_TILE_BYTES = 64 << 10

# Message node kinds, in block order after the 2 * num_ops op nodes.
LAUNCH, END, ARR, GOT = range(4)
MSG_KINDS = 4


@dataclasses.dataclass(frozen=True)
class Job:
    """One collective to simulate.

    Attributes:
        schedule: what to run.
        bytes_per_rank: bytes of one rank's *input* buffer (AllGather: the
            shard; AllToAll/ReduceScatter: all ``N`` blocks; AllReduce: the
            whole vector).
        ranks: the topology GPU of each schedule rank (default ``0..N-1``).
        start: start time in seconds.
        name: a label for results.
        iterations: run the schedule this many times on ``1/iterations`` of the
            data each, every threadblock going through its ops once per
            iteration, as MSCCL's runtime loops over a large buffer in tiles:
            threadblocks then overlap consecutive ops (op ``i`` of iteration
            ``p + 1`` may run while a later op of iteration ``p`` waits).
    """

    schedule: Schedule
    bytes_per_rank: float
    ranks: Sequence[int] | None = None
    start: float = 0.0
    name: str = ""
    iterations: int = 1


@dataclasses.dataclass
class Program:
    """The static event DAG of a set of jobs (see the module docstring)."""

    num_ops: int
    num_msgs: int
    num_jobs: int
    succ_ptr: np.ndarray  # int64 [num_nodes + 1]
    succ_idx: np.ndarray  # int32/int64 [num_edges]
    pending: np.ndarray  # int32 [num_nodes]: number of predecessors
    msg_bytes: np.ndarray  # float64 [num_msgs]
    msg_fp_bytes: np.ndarray  # float64 [num_msgs]: bytes of the first pipeline piece
    msg_latency: np.ndarray  # float64 [num_msgs]
    msg_weight: np.ndarray  # float64 [num_msgs]: weight in max-min link sharing (tile bytes, or 1)
    msg_path_ptr: np.ndarray  # int64 [num_msgs + 1]
    msg_path_links: np.ndarray  # int64: link ids
    msg_route: np.ndarray  # int64 [num_msgs]: route id (messages with one id cross the same links)
    msg_src_ptr: np.ndarray  # int64 [num_msgs + 1]: stream sources (launch gates and rate coupling)
    msg_src_idx: np.ndarray  # int64
    msg_streamed: np.ndarray  # bool: some forwarding op streams from this message (its FP matters)
    msg_conn: np.ndarray  # int64 connection per message
    num_slots: int | None  # unconsumed messages a connection holds (None: any)
    msg_sender: np.ndarray  # int64 op index per message
    msg_receiver: np.ndarray  # int64 op index per message
    op_job: np.ndarray  # int32 per op
    op_rank: np.ndarray  # int32 schedule rank per op
    op_tb: np.ndarray  # int32 threadblock index within the rank
    op_pos: np.ndarray  # int32 position within the threadblock
    job_start: np.ndarray  # float64 per job
    job_out_bytes: np.ndarray  # float64 per job: one rank's output bytes
    link_capacity: np.ndarray  # float64 per link

    @property
    def num_nodes(self) -> int:
        return self.pending.shape[0]

    def op_node(self, kind: int, op: np.ndarray | int) -> np.ndarray | int:
        """READY (``kind=0``) or COMPLETE (``kind=1``) node of ``op``."""
        return kind * self.num_ops + op

    def msg_node(self, kind: int, msg: np.ndarray | int) -> np.ndarray | int:
        return 2 * self.num_ops + kind * self.num_msgs + msg

    def start_node(self, job: int) -> int:
        return 2 * self.num_ops + MSG_KINDS * self.num_msgs + job

    def describe_op(self, op: int) -> str:
        return (
            f"job {int(self.op_job[op])}: op {int(self.op_pos[op])} of threadblock {int(self.op_tb[op])} "
            f"on rank {int(self.op_rank[op])}"
        )


def auto_iterations(
    schedule: Schedule,
    bytes_per_rank: float,
    *,
    pipeline_bytes: float | None = DEFAULT_PIPELINE_BYTES,
    flow_budget: int = DEFAULT_FLOW_BUDGET,
    max_iterations: int = MAX_AUTO_ITERATIONS,
) -> int:
    """Iterations of MSCCL's loop for ``schedule``: tiles of one pipeline piece per chunk.

    MSCCL runs a schedule over a large buffer in loop iterations that move at
    most one protocol step (``pipeline_bytes``) per chunk:
    ``ceil(chunk bytes / pipeline_bytes)``, here at most ``max_iterations``
    and at most ``flow_budget`` messages in all (at least 1).

    >>> from jaxccl.synth.baselines import ring_allgather
    >>> auto_iterations(ring_allgather(4), 4 << 20)
    8
    """
    if pipeline_bytes is None:
        return 1
    sends = sum(1 for tbs in schedule.ranks for tb in tbs for op in tb.ops if op.kind.sends)
    if not sends:
        return 1
    chunk = float(bytes_per_rank) / schedule.in_chunks
    want = int(np.ceil(chunk / float(pipeline_bytes)))
    return int(max(1, min(want, max_iterations, flow_budget // sends)))


def _placement(job: Job, num_gpus: int) -> np.ndarray:
    n = job.schedule.num_ranks
    if job.ranks is None:
        if n > num_gpus:
            raise TopologyError(f"schedule for {n} ranks does not fit a topology of {num_gpus} GPUs")
        return np.arange(n, dtype=np.int64)
    ranks = np.asarray([int(r) for r in job.ranks], dtype=np.int64)
    if ranks.shape != (n,):
        raise TopologyError(f"placement has {ranks.size} GPUs for a schedule of {n} ranks")
    if ranks.size and (ranks.min() < 0 or ranks.max() >= num_gpus):
        raise TopologyError(f"placement names GPUs outside 0..{num_gpus - 1}")
    if np.unique(ranks).size != n:
        raise TopologyError("placement maps two ranks to the same GPU")
    return ranks


def compile_jobs(
    jobs: Sequence[Job],
    router: Router,
    *,
    pipeline_bytes: float | None = DEFAULT_PIPELINE_BYTES,
    num_slots: int | None = DEFAULT_SLOTS,
    execution: str = "dataflow",
    sharing: str = "tiles",
    max_tiles: int = MAX_TILES,
) -> Program:
    """Builds the event DAG of ``jobs`` on ``router``'s topology.

    ``execution`` is one of :data:`EXECUTIONS`: ``"dataflow"`` (ops wait for
    what the executors' dataflow order makes them wait for, their data and
    their slots) or ``"in_order"`` (for their ``deps`` and the previous op of
    their threadblock); see the module docstring.

    Raises:
        ScheduleError: an op names a missing dependency, a send has no receive
            (or counts differ), a threadblock sends without a peer...
        TopologyError: a placement does not fit the topology.
        OptionError: ``execution`` or ``sharing`` is not one of its choices.
        ArgumentError: a size, count or iteration number out of range.
    """
    if pipeline_bytes is not None and not pipeline_bytes > 0:
        raise ArgumentError(f"pipeline_bytes must be positive or None, got {pipeline_bytes!r}")
    if num_slots is not None and (not isinstance(num_slots, int) or num_slots < 1):
        raise ArgumentError(f"num_slots must be a positive integer or None, got {num_slots!r}")
    choose("execution", execution, EXECUTIONS)
    choose("sharing", sharing, SHARINGS)
    if not isinstance(max_tiles, int) or isinstance(max_tiles, bool) or max_tiles < 1:
        raise ArgumentError(f"max_tiles must be a positive integer, got {max_tiles!r}")
    in_order = execution == "in_order"
    num_gpus = router.topo.num_gpus

    # ---- pass 1: flatten ops (one Python step per op; everything else is numpy)
    # compact typed arrays: a 2048-GPU ring has 4M ops
    op_job, op_rank, op_tb, op_pos = array("i"), array("i"), array("i"), array("i")
    op_flags = array("b")  # bit 0: sends, bit 1: receives
    op_count = array("i")
    dep_op, dep_of = array("q"), array("q")
    window = _Window()  # the executor's lookahead window (dataflow execution)
    send_conn, send_op, recv_conn, recv_op = array("q"), array("q"), array("q"), array("q")
    conns: dict[tuple[int, int, int, int], int] = {}
    job_chunk_bytes: list[float] = []
    job_out_bytes: list[float] = []
    placements: list[np.ndarray] = []
    job_base: list[int] = []
    for j, job in enumerate(jobs):
        s = job.schedule
        if not isinstance(s, Schedule):
            raise ScheduleError(f"job {j}: expected a Schedule, got {type(s).__name__}")
        if not job.bytes_per_rank >= 0:
            raise ArgumentError(f"job {j}: bytes_per_rank must be >= 0, got {job.bytes_per_rank!r}")
        placements.append(_placement(job, num_gpus))
        reps = job.iterations
        if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
            raise ArgumentError(f"job {j}: iterations must be a positive integer, got {reps!r}")
        chunk = float(job.bytes_per_rank) / s.in_chunks
        job_chunk_bytes.append(chunk / reps)
        job_out_bytes.append(chunk * s.out_chunks)
        job_base.append(len(op_job))
        rank_tb_first: list[list[int]] = []
        for r, tbs in enumerate(s.ranks):
            tb_first = np.cumsum([0] + [reps * len(tb.ops) for tb in tbs]).tolist()
            tb_first = [len(op_job) + x for x in tb_first]
            rank_tb_first.append(tb_first)
            send_keys: set[tuple[int, int]] = set()
            recv_keys: set[tuple[int, int]] = set()
            for t, tb in enumerate(tbs):
                sc = rc = -1
                if tb.send_peer >= 0:
                    if (tb.send_peer, tb.channel) in send_keys:
                        raise ScheduleError(
                            f"job {j}: rank {r} has two threadblocks sending to {tb.send_peer} on channel {tb.channel}"
                        )
                    send_keys.add((tb.send_peer, tb.channel))
                    sc = conns.setdefault((j, r, tb.send_peer, tb.channel), len(conns))
                if tb.recv_peer >= 0:
                    if (tb.recv_peer, tb.channel) in recv_keys:
                        raise ScheduleError(
                            f"job {j}: rank {r} has two threadblocks receiving from {tb.recv_peer} "
                            f"on channel {tb.channel}"
                        )
                    recv_keys.add((tb.recv_peer, tb.channel))
                    rc = conns.setdefault((j, tb.recv_peer, r, tb.channel), len(conns))
                if sc < 0 or rc < 0:
                    _check_peers(tb, sc >= 0, rc >= 0, f"job {j}: rank {r} threadblock {t}")
                n_tb_ops = len(tb.ops)
                for rep in range(reps):
                    for i, op in enumerate(tb.ops):
                        kind = op.kind
                        o = len(op_job)
                        flags = (1 if kind.sends else 0) | (2 if kind.receives else 0)
                        if flags & 1:
                            send_conn.append(sc)
                            send_op.append(o)
                        if flags & 2:
                            recv_conn.append(rc)
                            recv_op.append(o)
                        op_job.append(j)
                        op_rank.append(r)
                        op_tb.append(t)
                        op_pos.append(rep * n_tb_ops + i)
                        op_flags.append(flags)
                        op_count.append(op.count)
                        for dt, di in op.deps:
                            if not (0 <= dt < len(tbs) and 0 <= di < len(tbs[dt].ops)):
                                raise ScheduleError(
                                    f"job {j}: rank {r} threadblock {t} op {i} depends on missing op ({dt}, {di})"
                                )
                            if in_order:
                                dep_of.append(o)
                                dep_op.append(tb_first[dt] + rep * len(tbs[dt].ops) + di)
        if not in_order:
            _dataflow_edges(s, reps, rank_tb_first, num_slots, f"job {j}", dep_of, dep_op, window)
    n_ops = len(op_job)
    flags = np.frombuffer(op_flags, dtype=np.int8) if n_ops else np.zeros(0, dtype=np.int8)
    sends = (flags & 1).astype(bool)
    recvs = (flags & 2).astype(bool)
    op_job_a = np.frombuffer(op_job, dtype=np.int32).copy() if n_ops else np.zeros(0, dtype=np.int32)
    op_rank_a = np.frombuffer(op_rank, dtype=np.int32).copy() if n_ops else np.zeros(0, dtype=np.int32)
    op_tb_a = np.frombuffer(op_tb, dtype=np.int32).copy() if n_ops else np.zeros(0, dtype=np.int32)
    op_pos_a = np.frombuffer(op_pos, dtype=np.int32).copy() if n_ops else np.zeros(0, dtype=np.int32)
    op_count_a = np.frombuffer(op_count, dtype=np.int32).astype(np.float64) if n_ops else np.zeros(0)
    deps = _i64(dep_op)
    dep_of_a = _i64(dep_of)

    # ---- messages: k-th send of a connection <-> k-th receive of it
    sc_a, so_a, rc_a, ro_a = _i64(send_conn), _i64(send_op), _i64(recv_conn), _i64(recv_op)
    n_conn = len(conns)
    ns = np.bincount(sc_a, minlength=n_conn)
    nr = np.bincount(rc_a, minlength=n_conn)
    if (ns != nr).any():
        bad = int(np.flatnonzero(ns != nr)[0])
        key = next(k for k, v in conns.items() if v == bad)
        raise ScheduleError(
            f"job {key[0]}: connection rank {key[1]} -> {key[2]} channel {key[3]} has {ns[bad]} sends "
            f"but {nr[bad]} receives"
        )
    s_order = np.argsort(sc_a, kind="stable")  # ops were appended in program order
    r_order = np.argsort(rc_a, kind="stable")
    msg_sender = so_a[s_order]
    msg_receiver = ro_a[r_order]
    msg_conn = sc_a[s_order]
    n_msgs = msg_sender.size
    if n_msgs and (op_count_a[msg_sender] != op_count_a[msg_receiver]).any():
        m = int(np.flatnonzero(op_count_a[msg_sender] != op_count_a[msg_receiver])[0])
        raise ScheduleError(
            f"send/receive count mismatch: {_describe(op_job_a, op_rank_a, op_tb_a, op_pos_a, int(msg_sender[m]))} "
            f"sends {int(op_count_a[msg_sender[m]])} chunks, "
            f"{_describe(op_job_a, op_rank_a, op_tb_a, op_pos_a, int(msg_receiver[m]))} "
            f"receives {int(op_count_a[msg_receiver[m]])}"
        )
        chunk_a = np.asarray(job_chunk_bytes, dtype=np.float64)
    chunk_a = np.asarray(job_chunk_bytes, dtype=np.float64)
    msg_bytes = op_count_a[msg_sender] * chunk_a[op_job_a[msg_sender]] if n_msgs else np.zeros(0)
    msg_fp = msg_bytes.copy() if pipeline_bytes is None else np.minimum(msg_bytes, float(pipeline_bytes))
    if sharing == "tiles":
        msg_weight = _tile_weights(msg_bytes, op_job_a[msg_sender], len(jobs), max_tiles)
    else:
        msg_weight = np.ones(n_msgs)
    if sharing == "tiles" and pipeline_bytes is not None:
        msg_fp = msg_weight.copy()  # a tile is the executor's pipelining unit
    received_by = np.full(n_ops, -1, dtype=np.int64)
    received_by[msg_receiver] = np.arange(n_msgs)
    sent_by = np.full(n_ops, -1, dtype=np.int64)
    sent_by[msg_sender] = np.arange(n_msgs)

    # ---- routes
    gpu_of_op = np.empty(n_ops, dtype=np.int64)
    for j in range(len(jobs)):
        lo = job_base[j]
        hi = job_base[j + 1] if j + 1 < len(jobs) else n_ops
        gpu_of_op[lo:hi] = placements[j][op_rank_a[lo:hi]]
    src_gpu = gpu_of_op[msg_sender]
    dst_gpu = gpu_of_op[msg_receiver]
    pair_key = src_gpu * num_gpus + dst_gpu
    if router.method == "ecmp":
        pair_key = pair_key * (n_conn + 1) + msg_conn
    uniq, inv = np.unique(pair_key, return_inverse=True)
    src_of_pair = (uniq // (n_conn + 1) if router.method == "ecmp" else uniq) // num_gpus
    s_ids, s_counts = np.unique(src_of_pair, return_counts=True)
    router.prepare(dict(zip(s_ids.tolist(), s_counts.tolist())))
    routes = []
    for key in uniq.tolist():
        if router.method == "ecmp":
            pk, salt = divmod(key, n_conn + 1)
        else:
            pk, salt = key, 0
        u, v = divmod(pk, num_gpus)
        routes.append(router.route(int(u), int(v), int(salt)))
    rlen = np.asarray([len(p) for p in routes], dtype=np.int64)
    rptr = np.concatenate([[0], np.cumsum(rlen)])
    rlinks = np.asarray([e for p in routes for e in p], dtype=np.int64)
    rlat = np.asarray([router.route_latency(p) for p in routes], dtype=np.float64)
    mlen = rlen[inv] if n_msgs else np.zeros(0, dtype=np.int64)
    msg_path_ptr = np.concatenate([[0], np.cumsum(mlen)])
    msg_path_links = rlinks[_ranges(rptr[inv], mlen)] if n_msgs else np.zeros(0, dtype=np.int64)
    msg_latency = rlat[inv] if n_msgs else np.zeros(0)
    msg_route = inv.astype(np.int64).reshape(-1) if n_msgs else np.zeros(0, dtype=np.int64)

    # ---- edges
    n_jobs = len(jobs)
    base = 2 * n_ops

    def mnode(kind: int, m: np.ndarray) -> np.ndarray:
        return base + kind * n_msgs + m

    ready = np.arange(n_ops, dtype=np.int64)
    complete = ready + n_ops
    preds: list[np.ndarray] = []
    succs: list[np.ndarray] = []

    n_nodes = base + MSG_KINDS * n_msgs + n_jobs + window.num_nodes
    idx_dtype = np.int32 if n_nodes < 2**31 else np.int64

    def edge(p: np.ndarray, s: np.ndarray) -> None:
        preds.append(np.asarray(p, dtype=idx_dtype))
        succs.append(np.asarray(s, dtype=idx_dtype))

    first = op_pos_a == 0 if in_order else np.ones(n_ops, dtype=bool)
    edge(complete[:-1][~first[1:]], ready[1:][~first[1:]])  # program order
    edge(base + MSG_KINDS * n_msgs + op_job_a[first].astype(np.int64), ready[first])  # job start
    local = ~sends & ~recvs
    if sharing == "tiles":
        # the executors resolve every dependency per tile: an op may follow a receiving or local op
        # tile by tile (a reduction chain rrc -> rrc -> s streams; a send after a send still waits)
        piped = (recvs[deps] | local[deps]) if deps.size else np.zeros(0, dtype=bool)
        stream = sends[dep_of_a] & piped
        chain = ~sends[dep_of_a] & piped
    else:
        stream = sends[dep_of_a] & recvs[deps] if deps.size else np.zeros(0, dtype=bool)
        chain = np.zeros(stream.shape, dtype=bool)
    full = ~stream & ~chain
    edge(complete[deps[full]], ready[dep_of_a[full]])  # control deps
    edge(ready[deps[chain]], ready[dep_of_a[chain]])  # tile-pipelined deps of ops that send nothing...
    edge(complete[deps[chain]], complete[dep_of_a[chain]])  # ...complete after what they follow
    sd_op, sd_dep = dep_of_a[stream], deps[stream]
    edge(ready[sd_dep], mnode(LAUNCH, sent_by[sd_op]))  # stream deps: the receiving op is under way...
    # ...and its first piece is here: a *gate* on the source message, kept by the engine (msg_src_*)
    edge(complete[sd_dep], complete[sd_op])  # the forward completes after the receive
    if chain.any() or local[sd_dep].any():
        g_op, sd_src = _stream_sources(sd_op, sd_dep, dep_of_a[stream | chain], deps[stream | chain], received_by)
    else:
        g_op, sd_src = sd_op, received_by[sd_dep]
    sd_msg = sent_by[g_op]
    m_all = np.arange(n_msgs, dtype=np.int64)
    edge(ready[msg_receiver], mnode(GOT, m_all))
    edge(mnode(ARR, m_all), mnode(GOT, m_all))
    edge(mnode(GOT, m_all), complete[msg_receiver])
    edge(ready[msg_sender], mnode(LAUNCH, m_all))
    edge(mnode(END, m_all), complete[msg_sender])
    edge(mnode(END, m_all), mnode(ARR, m_all))
    fused = recvs[msg_sender]
    f_msg = m_all[fused]
    f_src = received_by[msg_sender[fused]]
    # rcs/rrs/rrcs forward what arrives: a gate on the op's own incoming message (msg_src_*)
    msg_streamed = np.zeros(n_msgs, dtype=bool)  # some forward streams from it
    msg_streamed[sd_src] = True
    msg_streamed[f_src] = True
    edge(ready[local], complete[local])
    w_base = base + MSG_KINDS * n_msgs + n_jobs  # window nodes come last
    edge(complete[_i64(window.done_op)], w_base + _i64(window.done_node))  # a unit is done...
    edge(w_base + _i64(window.chain_from), w_base + _i64(window.chain_from) + 1)  # ...and so are those before it
    edge(w_base + _i64(window.gate_node), ready[_i64(window.gate_op)])  # a unit's window reaches it
    pred = np.concatenate(preds)
    succ = np.concatenate(succs)
    preds.clear()
    succs.clear()
    succ_ptr = np.concatenate([[0], np.cumsum(np.bincount(pred, minlength=n_nodes))]).astype(np.int64)
    pending = np.bincount(succ, minlength=n_nodes).astype(np.int32)
    succ_idx = succ[np.argsort(pred, kind="stable")]
    del pred, succ
    pending[mnode(END, m_all)] += 1
    pending[base + MSG_KINDS * n_msgs : w_base] += 1  # job starts come from the event queue

    src_msg = np.concatenate([sd_msg, f_msg])
    src_src = np.concatenate([sd_src, f_src])
    o2 = np.argsort(src_msg, kind="stable")
    msg_src_idx = src_src[o2]
    msg_src_ptr = np.concatenate([[0], np.cumsum(np.bincount(src_msg, minlength=n_msgs))]).astype(np.int64)

    return Program(
        num_ops=n_ops,
        num_msgs=n_msgs,
        num_jobs=n_jobs,
        succ_ptr=succ_ptr,
        succ_idx=succ_idx,
        pending=pending,
        msg_bytes=msg_bytes,
        msg_fp_bytes=msg_fp,
        msg_latency=msg_latency,
        msg_weight=msg_weight,
        msg_path_ptr=msg_path_ptr,
        msg_path_links=msg_path_links,
        msg_route=msg_route,
        msg_src_ptr=msg_src_ptr,
        msg_src_idx=msg_src_idx,
        msg_streamed=msg_streamed,
        msg_conn=msg_conn,
        num_slots=num_slots,
        msg_sender=msg_sender,
        msg_receiver=msg_receiver,
        op_job=op_job_a,
        op_rank=op_rank_a,
        op_tb=op_tb_a,
        op_pos=op_pos_a,
        job_start=np.asarray([float(j.start) for j in jobs], dtype=np.float64),
        job_out_bytes=np.asarray(job_out_bytes, dtype=np.float64),
        link_capacity=router.capacity,
    )


def tiles_of(largest_message_bytes: float, max_tiles: int = MAX_TILES) -> int:
    """Tiles the executor cuts a launch into: its largest message over 64 KiB, between 1 and 256 (``ChooseTiles``).

    ``max_tiles`` replaces the executor's cap of 256 (for what-if studies).

    >>> tiles_of(128 << 20), tiles_of(1 << 20), tiles_of(1000), tiles_of(128 << 20, max_tiles=32)
    (256, 16, 1, 32)
    """
    return int(min(max(largest_message_bytes // MIN_TILE_BYTES, 1), max_tiles))


def _tile_weights(msg_bytes: np.ndarray, msg_job: np.ndarray, num_jobs: int, max_tiles: int) -> np.ndarray:
    """Each message's tile bytes: its bytes over its job's tile count (:func:`tiles_of`)."""
    if msg_bytes.size == 0:
        return np.zeros(0)
    largest = np.zeros(num_jobs)
    np.maximum.at(largest, msg_job, msg_bytes)
    tiles = np.asarray([tiles_of(b, max_tiles) for b in largest.tolist()], dtype=np.float64)
    # empty messages never become flows; a positive weight keeps the solver's arithmetic clean
    return np.maximum(msg_bytes / tiles[msg_job], 1e-300)


def _stream_sources(
    sd_op: np.ndarray, sd_dep: np.ndarray, p_op: np.ndarray, p_dep: np.ndarray, received_by: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The messages each streaming send follows, through chains of tile-pipelined dependencies.

    ``(sd_op, sd_dep)``: a sending op and a receiving or local op it follows
    tile by tile; ``(p_op, p_dep)``: every such pair, sends or not. An op's
    data is there, tile by tile, as fast as the message it receives (if any)
    and the data of the ops it follows: the sources of a send are the
    received messages of its dependency and, transitively, of theirs.
    Returns ``(op, source message)`` pairs, one per source.
    """
    follows: dict[int, list[int]] = {}
    for o, d in zip(p_op.tolist(), p_dep.tolist()):
        follows.setdefault(o, []).append(d)
    memo: dict[int, frozenset[int]] = {}

    def sources(x: int) -> frozenset[int]:
        stack = [x]
        while stack:
            y = stack[-1]
            pending = [d for d in follows.get(y, ()) if d not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            own = {int(received_by[y])} if received_by[y] >= 0 else set()
            for d in follows.get(y, ()):
                own |= memo[d]
            memo[y] = frozenset(own)
        return memo[x]

    ops: list[int] = []
    srcs: list[int] = []
    for o, d in zip(sd_op.tolist(), sd_dep.tolist()):
        for m in sorted(sources(d)):
            ops.append(o)
            srcs.append(m)
    return np.asarray(ops, dtype=np.int64), np.asarray(srcs, dtype=np.int64)


def _check_peers(tb: Threadblock, has_send_peer: bool, has_recv_peer: bool, where: str) -> None:
    """Raises :class:`ScheduleError` naming the first op of ``tb`` that sends (receives) without a peer."""
    for i, op in enumerate(tb.ops):
        if op.kind.sends and not has_send_peer:
            raise ScheduleError(f"{where} op {i} sends without a send peer")
        if op.kind.receives and not has_recv_peer:
            raise ScheduleError(f"{where} op {i} receives without a receive peer")


class _Window:
    """The executor's lookahead window as DAG nodes (``NextReadyUnit``, :data:`jaxccl.sim.ordering.LOOKAHEAD`).

    A threadblock starts unit ``u`` (iteration ``u // n`` of row ``u % n``) only once all its units up to
    ``u - LOOKAHEAD`` are done. Per threadblock with more units than that, window node ``k`` is "units
    ``0..k`` done": a unit is done when its op completes (a dependency ``nop`` row of the table: when what
    it waits for does), and node ``k - 1`` precedes node ``k``. Node ``u - LOOKAHEAD`` precedes the op of
    unit ``u``.
    """

    def __init__(self) -> None:
        self.num_nodes = 0
        self.done_op, self.done_node = array("q"), array("q")  # complete[op] -> window node
        self.chain_from = array("q")  # window node k -> window node k + 1
        self.gate_node, self.gate_op = array("q"), array("q")  # window node -> ready[op]

    def add(self, units: Sequence[tuple[int, ...]], unit_op: Sequence[int]) -> None:
        """One threadblock: per unit, the ops whose completion makes it done, and its own op (-1: none)."""
        k0 = self.num_nodes
        last = len(units) - LOOKAHEAD
        for u in range(last):
            for o in units[u]:
                self.done_op.append(o)
                self.done_node.append(k0 + u)
            if u:
                self.chain_from.append(k0 + u - 1)
        for u in range(LOOKAHEAD, len(units)):
            if unit_op[u] >= 0:
                self.gate_node.append(k0 + u - LOOKAHEAD)
                self.gate_op.append(unit_op[u])
        self.num_nodes += last


def _dataflow_edges(
    s: Schedule,
    reps: int,
    rank_tb_first: list[list[int]],
    num_slots: int | None,
    where: str,
    dep_of: array,
    dep_op: array,
    window: _Window,
) -> None:
    """The executor's waits of every op of ``s`` as edges ``dep_op -> dep_of`` (per iteration), and its window."""
    try:
        order = dataflow_order(s, num_slots)
    except ScheduleError as e:
        raise ScheduleError(f"{where}: {e}") from None
    for r, tbs in enumerate(s.ranks):
        tb_first = rank_tb_first[r]
        sizes = [len(tb.ops) for tb in tbs]
        for t, waits in enumerate(order.op_waits(r)):
            for rep in range(reps):
                base = tb_first[t] + rep * sizes[t]
                for i, w in enumerate(waits):
                    for dt, di in w:
                        dep_of.append(base + i)
                        dep_op.append(tb_first[dt] + rep * sizes[dt] + di)
        rows = order.ranks[r]
        row_ops = None
        for first, n, _, _ in rows.tbs:
            if reps * n <= LOOKAHEAD:
                continue
            if row_ops is None:
                row_ops = order.row_ops(r)
            units: list[tuple[int, ...]] = []
            unit_op: list[int] = []
            for rep in range(reps):
                for x in range(first, first + n):
                    units.append(tuple(tb_first[dt] + rep * sizes[dt] + di for dt, di in row_ops[x]))
                    unit_op.append(units[-1][0] if rows.op[x] >= 0 else -1)
            window.add(units, unit_op)


def _i64(a: array) -> np.ndarray:
    return np.frombuffer(a, dtype=np.int64).copy() if len(a) else np.zeros(0, dtype=np.int64)


def _describe(job: np.ndarray, rank: np.ndarray, tb: np.ndarray, pos: np.ndarray, op: int) -> str:
    return f"job {int(job[op])} rank {int(rank[op])} threadblock {int(tb[op])} op {int(pos[op])}"


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each ``(s, l)``."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - offsets, lens)
