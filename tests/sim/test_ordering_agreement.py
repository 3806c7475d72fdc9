"""The simulator's dataflow order (jaxccl.sim.ordering) is the executor's (xla_ffi/core), through the native module.

What is compared:

* **Rows and waits** (``native.program_rows``, the programs ``core/program_builder.h`` builds): per rank,
  every row of the table (the dependency ``nop`` rows included) with its kind, dependency, waits and
  messages, the threadblocks, the messages per connection and the program-order fallback. The executor
  uses the same waits in every tile (tile ``t`` of an op waits for tile ``t`` of its waits), so these are
  the op-level wait sets of every tile; ``op_waits`` (what the simulator's DAG uses) is checked against
  the native rows with the dependency ``nop`` rows resolved.
* **Unit order** (``native.next_ready_unit``, ``NextReadyUnit`` of ``core/protocol.h``): runs of whole
  tables over 1..3 tiles and several lookahead windows (the executor's 256 included, on a program longer
  than that), where at every step both pick the same unit and the same first unfinished unit from the
  same flags.

The simulator models an op as one piece of work per iteration (not per tile); its DAG uses the op-level
waits above per iteration and the window at unit granularity (iteration-major units, as tiles are).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxccl.schedule import Buffer, Op, OpKind, Schedule, Threadblock
from jaxccl.schedule.table import compile_table
from jaxccl.sim import ordering
from jaxccl.sim.ordering import ALL_DONE, LOOKAHEAD, NONE_READY, dataflow_order, next_ready_unit, unit_of, unit_ready
from jaxccl.synth import baselines

native = pytest.importorskip("jaxccl.runtime.native")

I, O, S = Buffer.INPUT, Buffer.OUTPUT, Buffer.SCRATCH


# ---------------------------------------------------------------------------------------------- schedules
def random_schedule(rng: random.Random) -> Schedule:
    """A structurally valid schedule (the table compiles and parses), not necessarily race- or deadlock-free.

    Ranks on a ring (channel 0: send to the next rank, receive from the previous one, fused ops), one
    direct connection on channel 1, local threadblocks; every op kind, dependencies across threadblocks
    (several per op, so that the table inserts dependency ``nop`` rows) and on earlier ops of the own
    threadblock, ``nop`` ops; small buffers so that ops collide on chunks.
    """
    n = rng.randint(2, 4)
    scratch = rng.randint(0, 3)
    size = {I: n, O: n, S: scratch}
    ring_count = rng.randint(1, 2)
    ring_sends = [rng.randint(0, 4) for _ in range(n)]
    direct = tuple(rng.sample(range(n), 2)) if rng.random() < 0.6 else None
    direct_count, direct_msgs = rng.randint(1, 2), rng.randint(1, 3)
    # per rank: (send_peer, recv_peer, channel, sends, receives, count of its messages)
    specs: list[list[tuple[int, int, int, int, int, int]]] = []
    for r in range(n):
        tbs = [((r + 1) % n, (r - 1) % n, 0, ring_sends[r], ring_sends[(r - 1) % n], ring_count)]
        if direct is not None and r == direct[0]:
            tbs.append((direct[1], -1, 1, direct_msgs, 0, direct_count))
        if direct is not None and r == direct[1]:
            tbs.append((-1, direct[0], 1, 0, direct_msgs, direct_count))
        tbs += [(-1, -1, 0, 0, 0, 1)] * rng.randint(0, 2)
        rng.shuffle(tbs)
        specs.append(tbs)

    def rng_range(bufs: tuple[Buffer, ...], count: int) -> tuple[Buffer, int] | None:
        usable = [b for b in bufs if size[b] >= count]
        if not usable:
            return None
        b = rng.choice(usable)
        return b, rng.randint(0, size[b] - count)

    ranks = []
    for r in range(n):
        plans = []
        for _, _, _, ks, kr, _ in specs[r]:
            fused = rng.randint(0, min(ks, kr))
            kinds = ["F"] * fused + ["S"] * (ks - fused) + ["R"] * (kr - fused) + ["L"] * rng.randint(0, 5)
            rng.shuffle(kinds)
            plans.append(kinds)
        tbs = []
        for t, ((sp, rp, ch, _, _, k), kinds) in enumerate(zip(specs[r], plans)):
            ops = []
            for i, what in enumerate(kinds):
                deps: list[tuple[int, int]] = []
                if rng.random() < 0.35:
                    for _ in range(rng.randint(1, 3)):
                        dt = rng.randrange(len(plans))
                        top = i if dt == t else len(plans[dt])
                        if top:
                            deps.append((dt, rng.randrange(top)))
                src = rng_range((I, O, S), k)
                dst = rng_range((O, S), k)
                if what == "S":
                    op = Op(OpKind.SEND, *src, count=k, deps=tuple(deps))
                elif what == "R":
                    kind = rng.choice((OpKind.RECV, OpKind.RECV_REDUCE_COPY))
                    op = Op(kind, *(src if kind is OpKind.RECV_REDUCE_COPY else (None, 0)), *dst, k, tuple(deps))
                elif what == "F":
                    kind = rng.choice((OpKind.RECV_COPY_SEND, OpKind.RECV_REDUCE_SEND, OpKind.RECV_REDUCE_COPY_SEND))
                    if kind is OpKind.RECV_COPY_SEND:
                        op = Op(kind, None, 0, *dst, k, tuple(deps))
                    elif kind is OpKind.RECV_REDUCE_SEND:
                        op = Op(kind, *src, None, 0, k, tuple(deps))
                    else:
                        op = Op(kind, *src, *dst, k, tuple(deps))
                else:
                    kind = rng.choice((OpKind.COPY, OpKind.REDUCE, OpKind.NOP))
                    c = rng.randint(1, 2)
                    ls, ld = rng_range((I, O, S), c), rng_range((O, S), c)
                    if kind is OpKind.NOP or ls is None or ld is None:
                        op = Op(OpKind.NOP, count=0, deps=tuple(deps))
                    else:
                        op = Op(kind, *ls, *ld, c, tuple(deps))
                ops.append(op)
            tbs.append(Threadblock(tuple(ops), send_peer=sp, recv_peer=rp, channel=ch))
        ranks.append(tuple(tbs))
    return Schedule("all_to_all", n, 1, tuple(ranks), scratch_chunks=scratch)


def synthesized() -> list[Schedule]:
    from jaxccl.synth.allgather import allgather
    from jaxccl.synth.alltoall import alltoall
    from jaxccl.topology import rail

    out = []
    for n in (2, 3, 4, 8):
        for make in (
            baselines.ring_allgather,
            baselines.direct_alltoall,
            baselines.ring_reduce_scatter,
            baselines.direct_reduce_scatter,
            baselines.ring_allreduce,
            baselines.ordered_allreduce,
            baselines.binary_tree_allreduce,
            baselines.double_binary_tree_allreduce,
        ):
            out.append(make(n))
    out.append(baselines.recursive_doubling_allgather(8))
    topo = rail(hosts=2, gpus_per_host=4)
    out += [allgather(topo), alltoall(topo)]
    return out


def long_schedule(rows: int) -> Schedule:
    """Rank 0 receives first (a message rank 1 posts only after ``rows`` copies) and then has ``rows`` copies
    that do not wait for it: only the window holds them back."""
    copies = tuple(Op(OpKind.COPY, I, 0, S, c) for c in range(rows))
    r0 = Threadblock((Op(OpKind.RECV, None, 0, O, 0),) + copies, recv_peer=1)
    r1 = Threadblock(copies + (Op(OpKind.SEND, S, rows - 1),), send_peer=0)
    return Schedule("all_gather", 2, 1, ((r0,), (r1,)), scratch_chunks=rows)


# --------------------------------------------------------------------------------------- comparisons
def compare_rows(s: Schedule, num_slots: int) -> ordering.DataflowOrder:
    """Asserts that the port's rows, waits and messages are the native builder's; returns the port's."""
    order = dataflow_order(s, num_slots)
    want = native.program_rows(compile_table(s, num_slots=num_slots))
    assert order.in_order == want["in_order"]
    assert list(order.conn_msgs) == want["conn_msgs"]
    assert order.num_slots == want["num_slots"]
    for r, (rows, w) in enumerate(zip(order.ranks, want["ranks"])):
        where = f"{s.name or 'schedule'} rank {r}"
        assert rows.tbs == w["tbs"], where
        assert [rows.kind(x).code for x in range(len(rows.op))] == w["kind"], where
        assert list(rows.dep) == w["dep"], where
        assert [list(x) for x in rows.waits] == w["waits"], where
        assert list(rows.send_msg) == w["send_msg"], where
        assert list(rows.recv_msg) == w["recv_msg"], where
        assert order.op_waits(r) == native_op_waits(s, r, w), where
    return order


def native_op_waits(s: Schedule, r: int, rows: dict) -> list[list[tuple[tuple[int, int], ...]]]:
    """The native rows' waits per op of the schedule: dependency and waits, the dependency nop rows the table
    puts in front of an op (one per cross-threadblock dependency but the last) replaced by what they wait for."""
    owner: dict[int, tuple[int, int]] = {}
    for t, tb in enumerate(s.ranks[r]):
        x = rows["tbs"][t][0]
        for i, op in enumerate(tb.ops):
            x += max(len({d for d in op.deps if d[0] != t}) - 1, 0)
            owner[x] = (t, i)
            x += 1

    def ops(x: int) -> set[tuple[int, int]]:
        if x in owner:
            return {owner[x]}
        return set().union(*(ops(y) for y in rows["waits"][x] + ([rows["dep"][x]] if rows["dep"][x] >= 0 else [])))

    out: list[list[tuple[tuple[int, int], ...]]] = [[] for _ in s.ranks[r]]
    for x in sorted(owner):
        got = set().union(*(ops(y) for y in rows["waits"][x] + ([rows["dep"][x]] if rows["dep"][x] >= 0 else [])))
        out[owner[x][0]].append(tuple(sorted(got)))
    return out


class ArrayProbe:
    """The Python side of the flags the native ``next_ready_unit`` reads."""

    def __init__(self, done: np.ndarray, posted: np.ndarray, consumed: np.ndarray, rows: int, stride: int, slots: int):
        self._done, self._posted, self._consumed = done, posted, consumed
        self.rows, self.stride, self.slots = rows, stride, slots

    def done(self, tile: int, row: int) -> bool:
        return bool(self._done[tile * self.rows + row])

    def posted(self, conn: int, msg: int) -> bool:
        return bool(self._posted[conn * self.stride + msg])

    def slot_free(self, conn: int, msg: int) -> bool:
        return bool(self._consumed[conn * self.stride + msg - self.slots])


def run_units(s: Schedule, rng: random.Random, *, tiles: int, lookahead: int, num_slots: int) -> dict[str, int]:
    """Runs ``s`` unit by unit, threadblocks in random turns; at every turn the native ``NextReadyUnit`` and
    the port must pick the same unit. Returns counts: units run, and turns where the window held back a
    ready unit."""
    table = compile_table(s, num_slots=num_slots)
    parsed = native.parse_table(table)
    order = dataflow_order(s, num_slots)
    stride = max([tiles * m for m in order.conn_msgs] + [1])
    posted = np.zeros(len(order.conn_msgs) * stride, np.int32)
    consumed = np.zeros_like(posted)
    done = [np.zeros(tiles * len(rows.op), np.int32) for rows in order.ranks]
    first = {(r, t): 0 for r, rows in enumerate(order.ranks) for t in range(len(rows.tbs))}
    live = sorted(first)
    counts = {"units": 0, "held": 0}
    while live:
        moved = False
        for r, t in rng.sample(live, len(live)):
            rows = order.ranks[r]
            probe = ArrayProbe(done[r], posted, consumed, len(rows.op), stride, num_slots)
            got = native.next_ready_unit(parsed, r, t, tiles, first[r, t], done[r], posted, consumed,
                                         lookahead=lookahead)  # fmt: skip
            want = next_ready_unit(order, r, t, tiles, first[r, t], probe, lookahead)
            assert got == want, (s.name, r, t, first[r, t], got, want)
            unit, first[r, t] = got
            if unit == ALL_DONE:
                live.remove((r, t))
                continue
            end = rows.tbs[t][1] * tiles
            if unit == NONE_READY:
                counts["held"] += any(
                    unit_ready(order, r, t, unit_of(order, r, t, v), probe)
                    for v in range(first[r, t] + lookahead, end)
                    if not probe.done(v // rows.tbs[t][1], rows.tbs[t][0] + v % rows.tbs[t][1])
                )
                continue
            u = unit_of(order, r, t, unit)
            done[r][u.tile * len(rows.op) + u.row] = 1
            _, _, sc, rc = rows.tbs[t]
            if u.recv_msg >= 0:
                consumed[rc * stride + u.recv_msg] = 1
            if u.send_msg >= 0:
                posted[sc * stride + u.send_msg] = 1
            counts["units"] += 1
            moved = True
        if not moved:
            break  # both agree that nothing is ready: the table deadlocks
    return counts


# ---------------------------------------------------------------------------------------------- tests
def test_the_port_has_the_executors_constants():
    assert (LOOKAHEAD, ALL_DONE, NONE_READY) == (native.LOOKAHEAD, native.ALL_DONE, native.NONE_READY)


def test_random_schedules_have_the_executors_rows_and_waits():
    seen = {"nop_rows": 0, "nops": 0, "cross_tb_waits": 0, "in_order": 0, "dataflow": 0}
    for seed in range(300):
        rng = random.Random(seed)
        s = random_schedule(rng)
        for slots in (1, 2, 8):
            order = compare_rows(s, slots)
            seen["in_order" if order.in_order else "dataflow"] += 1
            for rows in order.ranks:
                seen["nop_rows"] += sum(1 for x in range(len(rows.op)) if rows.op[x] < 0)
                seen["nops"] += sum(1 for op in rows.ops if op is not None and op.kind is OpKind.NOP)
                seen["cross_tb_waits"] += sum(1 for x, w in enumerate(rows.waits) for y in w
                                              if rows.tb[y] != rows.tb[x])  # fmt: skip
    assert all(v > 20 for v in seen.values()), seen  # the corpus exercises what it is meant to


@pytest.mark.parametrize("s", synthesized(), ids=lambda s: f"{s.name}-{s.collective.value}-{s.num_ranks}")
def test_synthesized_schedules_have_the_executors_rows_and_waits(s):
    for slots in (1, 8):
        compare_rows(s, slots)


def test_random_schedules_run_units_in_the_executors_order():
    held = units = 0
    for seed in range(60):
        rng = random.Random(1000 + seed)
        s = random_schedule(rng)
        for tiles, lookahead in ((1, LOOKAHEAD), (2, 1), (3, 2), (2, 3), (3, 7)):
            got = run_units(s, rng, tiles=tiles, lookahead=lookahead, num_slots=rng.choice((1, 2, 8)))
            held += got["held"]
            units += got["units"]
    assert units > 1000 and held > 20, (units, held)


@pytest.mark.parametrize("s", [baselines.ring_allreduce(4), baselines.double_binary_tree_allreduce(5)],
                         ids=lambda s: s.name)  # fmt: skip
def test_synthesized_schedules_run_units_in_the_executors_order(s):
    rng = random.Random(7)
    for tiles in (1, 3):
        assert run_units(s, rng, tiles=tiles, lookahead=LOOKAHEAD, num_slots=2)["units"] > 0


def test_a_program_longer_than_the_window_runs_in_the_executors_order():
    s = long_schedule(LOOKAHEAD + 40)
    for tiles in (1, 2):
        got = run_units(s, random.Random(tiles), tiles=tiles, lookahead=LOOKAHEAD, num_slots=8)
        assert got["units"] == tiles * (2 * (LOOKAHEAD + 40) + 2)
        assert got["held"] > 0  # the copies beyond the window waited for the receive


def test_the_simulator_holds_units_beyond_the_window():
    from jaxccl.sim.engine import simulate
    from jaxccl.sim.model import Job, compile_jobs
    from jaxccl.sim.routes import Router
    from jaxccl.topology import Topology

    rows = LOOKAHEAD + 40
    sends = tuple(Op(OpKind.SEND, I, 0) for _ in range(rows))
    r0 = Threadblock((Op(OpKind.RECV, None, 0, O, 1),) + sends, send_peer=1, recv_peer=1)
    r1 = Threadblock((Op(OpKind.SEND, I, 0),) + tuple(Op(OpKind.RECV, None, 0, O, 0) for _ in range(rows)),
                     send_peer=0, recv_peer=0)  # fmt: skip
    s = Schedule("all_gather", 2, 1, ((r0,), (r1,)))
    link = [(0, 1, 1e9, 1e-6), (1, 0, 1e9, 1e-6)]
    prog = compile_jobs([Job(s, 1e6)], Router(Topology.from_edges(2, link)))
    t, _ = simulate(prog)
    ready = t[: prog.num_ops]
    complete = t[prog.num_ops : 2 * prog.num_ops]
    # rank 0's first op receives; its sends do not wait for it, but those beyond the window do
    assert ready[1] < complete[0] and ready[LOOKAHEAD - 1] < complete[0]
    assert ready[LOOKAHEAD] >= complete[0] and ready[rows] >= complete[0]


def test_bad_arguments_are_refused_by_both():
    from jaxccl.errors import ExecutorError, ScheduleError

    s = baselines.ring_allgather(3)
    order = dataflow_order(s)
    flags = np.zeros(3 * 2, np.int32)
    for rank, tb, tiles, first, lookahead in ((3, 0, 1, 0, 1), (0, 1, 1, 0, 1), (0, 0, 0, 0, 1), (0, 0, 1, 9, 1),
                                              (0, 0, 1, 0, 0)):  # fmt: skip
        with pytest.raises(ScheduleError):
            next_ready_unit(order, rank, tb, tiles, first, ArrayProbe(flags, flags, flags, 4, 1, 8), lookahead)
        with pytest.raises(ExecutorError):
            native.next_ready_unit(s, rank, tb, tiles, first, np.zeros(4 * max(tiles, 1)), flags, flags,
                                   lookahead=lookahead)  # fmt: skip
    with pytest.raises(ScheduleError, match="depends on missing op"):
        dataflow_order(Schedule("all_gather", 1, 1, ((Threadblock((Op(OpKind.NOP, count=0, deps=((0, 0),)),)),),)))
