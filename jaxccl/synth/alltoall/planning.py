"""Planning AllToAll messages: class ranges and scratch offsets of rounded paths.

Layout (``docs/schedule-ir.md``): with ``C = chunks_per_period`` (the common
chunk count ``K`` of the rounding), input chunk ``d*C + c`` of rank ``s`` must
end up as output chunk ``s*C + c`` of rank ``d``. Commodity ``(s, d)`` sends
its ``C`` chunk classes over its paths: a path carrying ``n`` chunks takes
``n`` consecutive classes ``[c0, c0 + n)`` as one message of ``count = n``.

A physical path is reduced to the GPUs on it: switches are not ranks, so
``s -> nvswitch -> g`` or ``s -> ToR -> g`` is one logical transfer. A path
through intermediate GPUs forwards through their scratch buffer, and the
scratch range keeps the chunk classes (its offset is ``c0`` modulo ``C``).

A :class:`Plan` holds the messages (one per route), their class ranges and
scratch offsets; :mod:`.emission` turns it into the schedule IR.

Incremental planning (warm starts). :func:`plan_incremental` keeps the
class ranges and scratch offsets of every commodity whose routes did not
change (read back from the previous schedule's ``info["paths"]``) and gives
the changed ones fresh scratch above them; :func:`plan_delta` does the same
when the caller knows which commodities changed (a local repair), without
comparing the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxccl.errors import ScheduleError
from jaxccl.synth.alltoall.columns import ColumnPool
from jaxccl.synth.alltoall.network import Network
from jaxccl.synth.alltoall.routes import _columns, decode_column, encode_column


@dataclasses.dataclass(frozen=True)
class Plan:
    """The messages of a rounded solution (one per route), as arrays, grouped by commodity.

    A cold plan orders them by ``(src, dst, start)``; an incremental one keeps
    the previous rows' order and puts new commodities' rows last.

    Attributes:
        gpus: ``(M, W)`` the GPUs each message visits, source first, -1 padded.
        hops: ``(M,)`` transfers of each message (GPUs visited - 1).
        start: ``(M,)`` its first chunk class ``c0``.
        count: ``(M,)`` its chunks.
        src, dst: ``(M,)`` the commodity's endpoints.
        scratch: ``(M, max(W - 2, 1))`` scratch offset at the ``j+1``-th GPU it visits (-1 where none).
        scratch_chunks: scratch buffer size per rank.
        pid: ``(M,)`` path id of each message in the column pool (-1 if unknown).
        kept: ``(M,)`` the message was taken over from a previous plan.
        prev_row: ``(M,)`` its row in that plan (-1 if not taken over).
    """

    gpus: np.ndarray
    hops: np.ndarray
    start: np.ndarray
    count: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    scratch: np.ndarray
    scratch_chunks: int
    pid: np.ndarray
    kept: np.ndarray
    prev_row: np.ndarray | None = None

    def previous_rows(self) -> np.ndarray:
        """``prev_row``, or all -1."""
        return np.full(self.src.size, -1, dtype=np.int64) if self.prev_row is None else self.prev_row


def gpu_sequences(net: Network, paths: np.ndarray) -> np.ndarray:
    """``(M, W)`` the GPUs along each path (rows of -1 padded arcs), source first, -1 padded."""
    if paths.shape[0] == 0:
        return np.zeros((0, 2), dtype=np.int64)
    valid = paths >= 0
    safe = np.where(valid, paths, 0)
    heads = np.where(valid & net.advances[safe], net.head[safe], -1)
    seq = np.concatenate([net.tail[safe[:, 0]][:, None], heads], axis=1)
    return _left_justify(seq, (seq >= 0) & (seq < net.num_gpus))


def _left_justify(seq: np.ndarray, keep: np.ndarray) -> np.ndarray:
    order = np.argsort(~keep, axis=1, kind="stable")
    out = np.take_along_axis(np.where(keep, seq, -1), order, axis=1)
    width = max(int(keep.sum(axis=1).max()) if keep.size else 0, 2)
    if out.shape[1] < width:
        out = np.pad(out, ((0, 0), (0, width - out.shape[1])), constant_values=-1)
    return out[:, :width]


def _cumcount(keys: np.ndarray) -> np.ndarray:
    """For each entry, how many earlier entries have the same key."""
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    first = np.r_[True, sk[1:] != sk[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(sk.size), 0))
    out = np.empty(keys.size, dtype=np.int64)
    out[order] = np.arange(sk.size) - group_start
    return out


def _starts(comm: np.ndarray, count: np.ndarray) -> np.ndarray:
    """First class of each row: the running chunk count within its commodity (rows grouped by commodity)."""
    if comm.size == 0:
        return np.zeros(0, dtype=np.int64)
    first = np.r_[True, comm[1:] != comm[:-1]]
    csum = np.cumsum(count) - count
    return csum - np.maximum.accumulate(np.where(first, csum, 0))


def _intermediates(gpus: np.ndarray, hops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(message, position)`` of every intermediate GPU (position j: the ``j+1``-th GPU visited)."""
    width = gpus.shape[1]
    if width <= 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.nonzero(np.arange(1, width - 1)[None, :] < hops[:, None])


def _allocate(
    gpus: np.ndarray,
    hops: np.ndarray,
    start: np.ndarray,
    count: np.ndarray,
    scratch: np.ndarray,
    todo: np.ndarray,
    n: int,
    c: int,
) -> int:
    """Fills ``scratch`` for the messages in ``todo`` (in order); returns the scratch periods used.

    Per rank and chunk class, a message takes the first period ``q`` above
    everything already allocated (the given offsets of the other messages)
    whose classes ``[c0, c0 + n)`` are all free: offset ``q * C + c0``.
    """
    msg, pos = _intermediates(gpus, hops)  # sorted by message, then position
    next_period = np.zeros((n, c), dtype=np.int64)
    is_todo = np.zeros(gpus.shape[0], dtype=bool)
    is_todo[todo] = True
    given = ~is_todo[msg]
    top = 0  # periods the given offsets use, anywhere
    if given.any():
        m, p = msg[given], pos[given]
        g, q = gpus[m, p + 1], scratch[m, p] // c
        top = int(q.max()) + 1
        # Only the ranks where a message of todo stops over need their free periods.
        need = np.zeros(n, dtype=bool)
        need[gpus[msg[~given], pos[~given] + 1]] = True
        keep = need[g]
        m, g, q = m[keep], g[keep], q[keep]
        for k in range(int(count[m].max(initial=0))):  # every class each given message occupies
            sel = k < count[m]
            np.maximum.at(next_period, (g[sel], (start[m] + k)[sel]), q[sel] + 1)
    sel = ~given
    msg, pos = msg[sel], pos[sel]
    if msg.size:
        if todo.size > 1 and np.any(np.diff(todo) < 0):  # allocate in the order of todo
            turn_of = np.zeros(gpus.shape[0], dtype=np.int64)
            turn_of[todo] = np.arange(todo.size)
            order = np.lexsort((pos, turn_of[msg]))
            msg, pos = msg[order], pos[order]
        g = gpus[msg, pos + 1]
        if c == 1 or np.all(count[msg] == 1):
            # One class per message: each takes the next free period of its class, in order.
            cls = start[msg]
            q = next_period[g, cls] + _cumcount(g * c + cls)
            scratch[msg, pos] = q * c + cls
            np.maximum.at(next_period, (g, cls), q + 1)
        else:
            # The greedy is sequential per rank but independent across ranks: one round per message index.
            turn = _cumcount(g)
            classes = np.arange(c)[None, :]
            for t in range(int(turn.max()) + 1):
                sel = np.flatnonzero(turn == t)
                gg, m_ = g[sel], msg[sel]
                lo = start[m_][:, None]
                mask = (classes >= lo) & (classes < lo + count[m_][:, None])
                q = np.where(mask, next_period[gg], -1).max(axis=1)
                next_period[gg] = np.where(mask, (q + 1)[:, None], next_period[gg])
                scratch[m_, pos[sel]] = q * c + start[m_]
    return max(top, int(next_period.max()) if next_period.size else 0)


def _messages(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray):
    """``(gpus, hops, start, count)`` of rounded rows sorted by commodity."""
    gpus = gpu_sequences(net, pool.paths[pid])
    hops = (gpus >= 0).sum(axis=1) - 1
    count = np.asarray(count, dtype=np.int64)
    return gpus, hops, _starts(comm, count), count


def plan(net: Network, pool: ColumnPool, comm: np.ndarray, pid: np.ndarray, count: np.ndarray, chunks: int) -> Plan:
    """Messages, class ranges and scratch offsets of rounded rows ``(commodity, path, chunks)`` sorted by commodity."""
    n, c = net.num_gpus, int(chunks)
    gpus, hops, start, count = _messages(net, pool, comm, pid, count)
    scratch = np.full((gpus.shape[0], max(gpus.shape[1] - 2, 1)), -1, dtype=np.int64)
    periods = _allocate(gpus, hops, start, count, scratch, np.arange(gpus.shape[0]), n, c)
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=comm // n,
        dst=comm % n,
        scratch=scratch,
        scratch_chunks=periods * c,
        pid=np.asarray(pid, dtype=np.int64),
        kept=np.zeros(gpus.shape[0], dtype=bool),
    )


def plan_columns(p: Plan) -> dict[str, list]:
    """The plan's class ranges and scratch offsets as JSON columns (added to ``info["paths"]``)."""
    valid = p.scratch >= 0
    return {"start": encode_column(p.start), "scratch": encode_column(p.scratch[valid])}


def previous_plan(paths: Mapping[str, Any], n: int, c: int) -> Plan | None:
    """The plan a schedule of this module was emitted from, read back from its ``info["paths"]``.

    None if the table lacks the class ranges and scratch offsets (``start``,
    ``scratch``) or does not fit ``n`` ranks and ``c`` chunks.
    """
    if "start" not in paths or "scratch" not in paths:
        return None
    try:
        src, dst, count, nodes, route, offset = _columns(paths)
        start, flat_scratch = decode_column(paths["start"]), decode_column(paths["scratch"])
    except ScheduleError:
        return None
    r = src.size
    if start.size != r or r == 0:
        return None
    is_gpu = np.array([isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in nodes])
    gpu_of = np.array([v if g else -1 for v, g in zip(nodes, is_gpu)], dtype=np.int64)
    length = np.diff(offset)
    width = int(length.max())
    seq = np.full((r, width), -1, dtype=np.int64)
    row = np.repeat(np.arange(r), length)
    seq[row, np.arange(route.size) - offset[row]] = gpu_of[route]
    gpus = _left_justify(seq, seq >= 0)
    hops = (gpus >= 0).sum(axis=1) - 1
    if np.any(hops < 1) or np.any(gpus[:, 0] != src) or np.any(gpus[np.arange(r), hops] != dst):
        return None
    if np.any(start < 0) or np.any(start + count > c):
        return None
    scratch = np.full((r, max(gpus.shape[1] - 2, 1)), -1, dtype=np.int64)
    msg, pos = _intermediates(gpus, hops)
    if msg.size != flat_scratch.size:
        return None
    scratch[msg, pos] = flat_scratch
    top = int((scratch.max() // c) + 1) * c if msg.size else 0
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=count,
        src=src,
        dst=dst,
        scratch=scratch,
        scratch_chunks=top,
        pid=np.full(r, -1, dtype=np.int64),
        kept=np.ones(r, dtype=bool),
    )


def plan_incremental(
    net: Network,
    pool: ColumnPool,
    comm: np.ndarray,
    pid: np.ndarray,
    count: np.ndarray,
    chunks: int,
    prev: Plan,
    prev_arcs: np.ndarray | None = None,
) -> Plan:
    """Like :func:`plan`, but commodities routed exactly as in ``prev`` keep its class ranges and scratch.

    A commodity is kept when its rows and ``prev``'s rows for it are the same
    multiset of (route, chunks) with no repeats; the others get class ranges
    in row order and scratch above everything the kept ones occupy. The kept
    rows keep their previous order and the others come last (as in :func:`plan_delta`). Routes
    are compared as GPU sequences, or, when ``prev_arcs`` gives ``prev``'s
    routes as arcs of the same network, as arc sequences (then only the
    changed rows are turned into GPU sequences).
    """
    n, c = net.num_gpus, int(chunks)
    comm = np.asarray(comm, dtype=np.int64)
    pid = np.asarray(pid, dtype=np.int64)
    count = np.asarray(count, dtype=np.int64)
    src, dst = comm // n, comm % n
    comm_old = prev.src * n + prev.dst
    if prev_arcs is not None and prev_arcs.shape[0] == prev.src.size:
        gpus_all, new_rows, old_rows = None, pool.paths[pid], prev_arcs
    else:
        gpus_all = gpu_sequences(net, pool.paths[pid])
        new_rows, old_rows = gpus_all, prev.gpus
    width = max(new_rows.shape[1], old_rows.shape[1])
    new_rows = _pad_columns(new_rows, width)
    old_rows = _pad_columns(old_rows, width)
    k_new = _row_keys(new_rows, src, dst, count)
    k_old = _row_keys(old_rows, prev.src, prev.dst, prev.count)
    # Per commodity: an order-free digest of its rows, and whether some row repeats.
    dig_new, rows_new = _digests(comm, k_new, n)
    dig_old, rows_old = _digests(comm_old, k_old, n)
    unique_new = np.bincount(comm[np.unique(k_new, return_index=True)[1]], minlength=n * n) == rows_new
    same = (dig_new == dig_old) & (rows_new == rows_old) & (rows_new > 0) & unique_new
    keep = same[comm]
    # Kept rows take prev's row with the same key (unique within the commodity); checked exactly.
    kept_rows = np.flatnonzero(keep)
    first_old = np.full(n * n, -1, dtype=np.int64)
    if comm_old.size:
        starts = np.flatnonzero(np.r_[True, comm_old[1:] != comm_old[:-1]])
        first_old[comm_old[starts]] = starts
    match = first_old[comm[kept_rows]]  # right for commodities of one row
    multi = np.flatnonzero(rows_new[comm[kept_rows]] > 1)
    if multi.size:
        sel = np.flatnonzero(rows_old[comm_old] > 1)
        order_old = sel[np.argsort(k_old[sel], kind="stable")]
        where = np.minimum(np.searchsorted(k_old[order_old], k_new[kept_rows[multi]]), order_old.size - 1)
        match[multi] = order_old[where]
    equal = (k_old[match] == k_new[keep]) & (prev.src[match] == src[keep]) & (prev.dst[match] == dst[keep])
    equal &= (prev.count[match] == count[keep]) & np.all(old_rows[match] == new_rows[keep], axis=1)
    if not equal.all():  # a hash collision: those commodities are planned afresh
        bad = np.zeros(n * n, dtype=bool)
        bad[comm[kept_rows[~equal]]] = True
        keep &= ~bad[comm]
        match = match[~bad[comm[kept_rows]]]
        kept_rows = np.flatnonzero(keep)
    todo = np.flatnonzero(~keep)
    gpus_todo = gpu_sequences(net, pool.paths[pid[todo]]) if gpus_all is None else gpus_all[todo]
    wide = max(gpus_todo.shape[1] - 2, prev.scratch.shape[1], prev.gpus.shape[1] - 2, 1)
    gpus = np.full((pid.size, wide + 2), -1, dtype=np.int64)
    gpus[kept_rows, : prev.gpus.shape[1]] = prev.gpus[match]
    gpus[todo, : gpus_todo.shape[1]] = gpus_todo
    hops = (gpus >= 0).sum(axis=1) - 1
    start = np.empty(pid.size, dtype=np.int64)
    start[kept_rows] = prev.start[match]
    start[todo] = _starts(comm[todo], count[todo])
    scratch = np.full((pid.size, wide), -1, dtype=np.int64)
    scratch[kept_rows, : prev.scratch.shape[1]] = prev.scratch[match]
    periods = _allocate(gpus, hops, start, count, scratch, todo, n, c)
    prev_row = np.full(pid.size, -1, dtype=np.int64)
    prev_row[kept_rows] = match
    # The kept rows in their previous order, then the new ones by (src, dst, start): see plan_delta.
    fresh = prev_row < 0
    order = np.lexsort((start, dst, src, np.where(fresh, 0, prev_row), fresh))
    return Plan(
        gpus=gpus[order],
        hops=hops[order],
        start=start[order],
        count=count[order],
        src=src[order],
        dst=dst[order],
        scratch=scratch[order],
        scratch_chunks=periods * c,
        pid=pid[order],
        kept=keep[order],
        prev_row=prev_row[order],
    )


def plan_delta(
    net: Network,
    pool: ColumnPool,
    prev: Plan,
    kept: np.ndarray,
    comm: np.ndarray,
    pid: np.ndarray,
    count: np.ndarray,
    chunks: int,
) -> Plan:
    """``prev`` with only the rows ``kept`` of it, then new rows ``(commodity, path, chunks)`` sorted by commodity.

    The new rows' commodities must be exactly those that lost their rows;
    they get class ranges in row order and scratch above everything the
    kept rows occupy (as :func:`plan_incremental` does, without comparing
    the kept rows: the caller knows they are unchanged). Kept rows keep
    their order and have ``pid = -1``; the new ones come last (so rows stay
    grouped by commodity, not sorted: the routes table keeps this order).
    """
    n, c = net.num_gpus, int(chunks)
    kept = np.asarray(kept, dtype=np.int64)
    comm = np.asarray(comm, dtype=np.int64)
    pid = np.asarray(pid, dtype=np.int64)
    count = np.asarray(count, dtype=np.int64)
    gpus_new = gpu_sequences(net, pool.paths[pid])
    start_new = _starts(comm, count)
    # The new rows go after the kept ones: the issue order is by hop depth, then row, so a new message's
    # transfers queue behind the kept ones of the same depth instead of shifting them (and their dependents).
    m = kept.size + comm.size
    at = kept.size + np.arange(comm.size)
    is_new = np.zeros(m, dtype=bool)
    is_new[at] = True
    k_old = kept.size  # the kept rows are rows [0, k_old); np.take: row gathers are 5x faster than fancy indexing
    wide = max(gpus_new.shape[1] - 2, prev.scratch.shape[1], prev.gpus.shape[1] - 2, 1)
    gpus = np.full((m, wide + 2), -1, dtype=np.int64)
    gpus[:k_old, : prev.gpus.shape[1]] = np.take(prev.gpus, kept, axis=0)
    gpus[k_old:, : gpus_new.shape[1]] = gpus_new

    def merged(old_col: np.ndarray, new_col: np.ndarray) -> np.ndarray:
        return np.concatenate([np.take(old_col, kept), new_col])

    hops = np.concatenate([np.take(prev.hops, kept), (gpus_new >= 0).sum(axis=1) - 1])
    start = merged(prev.start, start_new)
    cnt = merged(prev.count, count)
    scratch = np.full((m, wide), -1, dtype=np.int64)
    scratch[:k_old, : prev.scratch.shape[1]] = np.take(prev.scratch, kept, axis=0)
    periods = _allocate(gpus, hops, start, cnt, scratch, at, n, c)
    prev_row = np.full(m, -1, dtype=np.int64)
    prev_row[:k_old] = kept
    row_pid = np.full(m, -1, dtype=np.int64)
    row_pid[at] = pid
    return Plan(
        gpus=gpus,
        hops=hops,
        start=start,
        count=cnt,
        src=merged(prev.src, comm // n),
        dst=merged(prev.dst, comm % n),
        scratch=scratch,
        scratch_chunks=periods * c,
        pid=row_pid,
        kept=~is_new,
        prev_row=prev_row,
    )


def _pad_columns(rows: np.ndarray, width: int) -> np.ndarray:
    if rows.shape[1] >= width:
        return rows
    return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=-1)


_ROW_MULT = np.random.default_rng(0xA11).integers(1, 2**62, size=256, dtype=np.int64).astype(np.uint64) | np.uint64(1)


def _row_keys(rows: np.ndarray, src: np.ndarray, dst: np.ndarray, count: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of (route, src, dst, chunks)."""
    cols = np.concatenate([rows.astype(np.int64) + 1, src[:, None], dst[:, None], count[:, None]], axis=1)
    mult = _ROW_MULT
    if cols.shape[1] > mult.size:
        mult = np.random.default_rng(cols.shape[1]).integers(1, 2**62, size=cols.shape[1], dtype=np.int64)
        mult = mult.astype(np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        return (cols.astype(np.uint64) * mult[: cols.shape[1]]).sum(axis=1, dtype=np.uint64)


def _digests(comm: np.ndarray, keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per commodity (rows grouped by commodity): the sum of its mixed row keys, and its row count."""
    dig = np.zeros(n * n, dtype=np.uint64)
    rows = np.zeros(n * n, dtype=np.int64)
    if comm.size == 0:
        return dig, rows
    first = np.flatnonzero(np.r_[True, comm[1:] != comm[:-1]])
    with np.errstate(over="ignore"):
        dig[comm[first]] = np.add.reduceat(keys * np.uint64(0x9E3779B97F4A7C15), first)
    rows[comm[first]] = np.diff(np.r_[first, comm.size])
    return dig, rows
