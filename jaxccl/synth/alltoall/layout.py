"""Where every op of an AllToAll plan goes: threadblocks, op indices and dependencies, as arrays.

The layout rule (the one :class:`~jaxccl.schedule.ScheduleBuilder` follows,
computed with arrays): transfers are issued by hop depth, then plan row; per
rank, threadblock 0 is the local copy and the others, one per (peer,
direction), are numbered in order of first use over that sequence, in which
a transfer touches its sender before its receiver; ops of a threadblock keep
the issue order; the send of hop ``j >= 1`` waits for the receive of hop
``j - 1`` (the same message, on the same rank).

:func:`layout` computes it from scratch; :func:`layout_delta` computes the
layout of a plan derived from an earlier one (rows taken over, rows dropped,
rows added) from that plan's layout, in time proportional to what changed:
a threadblock whose events are unchanged keeps them where they are in the
arrays, and only the threadblocks that lose or gain an event get their
lists rebuilt, appended at the end. So a :class:`Layout`'s event arrays may
hold unused entries between the groups' ranges (``msg == -1``);
:meth:`Layout.compact` gives the dense canonical form, which is what
:func:`layout` returns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from jaxccl.synth.alltoall.planning import Plan

# A delta layout is compacted when its arrays hold more than this many entries per op.
MAX_SLACK = 2.0


def concat_ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(lo[i], hi[i])``.

    >>> concat_ranges(np.array([0, 5]), np.array([2, 8])).tolist()
    [0, 1, 5, 6, 7]
    """
    length = hi - lo
    return np.repeat(lo - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))


@dataclasses.dataclass(frozen=True)
class Hops:
    """Every hop of some messages, in issue order (hop depth, then message): who sends to whom."""

    msg: np.ndarray
    depth: np.ndarray
    frm: np.ndarray
    to: np.ndarray


def hops(p: Plan, rows: np.ndarray | None = None) -> Hops:
    """Every hop of the messages (all, or the plan rows ``rows``, sorted), in issue order."""
    width = p.gpus.shape[1]
    # Issue order: by hop depth, then message (the transposed mask's nonzeros come out in that order).
    count = p.hops if rows is None else p.hops[rows]
    depth, msg = np.nonzero(np.arange(width - 1)[:, None] < count[None, :])
    if rows is not None:
        msg = rows[msg]
    return Hops(msg=msg, depth=depth, frm=p.gpus[msg, depth], to=p.gpus[msg, depth + 1])


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every op of a plan with its place.

    An event is hop ``depth`` of plan row ``msg``, its send (``kind`` 0) or
    its receive (1); the op's buffers, offsets and count follow from the
    plan. ``group_*`` describe the threadblocks other than the local one
    (index 0), sorted by (rank, threadblock): group ``g`` is threadblock
    ``group_tb[g]`` (``1 .. T`` per rank) of rank ``group_rank[g]``, and its
    op ``i`` is event ``group_lo[g] + i`` (up to ``group_hi[g]``). A send
    that waits has ``dep_tb``/``dep_op`` (else -1). Entries outside every
    group's range are unused (``msg == -1``, no dependency).
    """

    msg: np.ndarray
    depth: np.ndarray
    kind: np.ndarray
    dep_tb: np.ndarray
    dep_op: np.ndarray
    group_rank: np.ndarray
    group_tb: np.ndarray
    group_peer: np.ndarray
    group_kind: np.ndarray
    group_lo: np.ndarray
    group_hi: np.ndarray

    @property
    def num_events(self) -> int:
        """Ops in the groups (the unused entries not counted)."""
        return int((self.group_hi - self.group_lo).sum())

    def events(self) -> np.ndarray:
        """The event indices of all groups, in group order (the dense order)."""
        return concat_ranges(self.group_lo, self.group_hi)

    @functools.cached_property
    def _groups_by_lo(self) -> tuple[np.ndarray, np.ndarray]:
        by_lo = np.argsort(self.group_lo, kind="stable")
        return by_lo, self.group_lo[by_lo]

    def group_of(self, events: np.ndarray) -> np.ndarray:
        """The group holding each of ``events`` (which must lie in some group's range)."""
        by_lo, lo_sorted = self._groups_by_lo
        return by_lo[np.searchsorted(lo_sorted, events, side="right") - 1]

    def compact(self) -> tuple[Layout, np.ndarray]:
        """The dense form (events in group order, nothing unused) and, per its event, the event here."""
        idx = self.events()
        size = self.group_hi - self.group_lo
        lo = np.cumsum(size) - size
        dense = Layout(
            msg=self.msg[idx],
            depth=self.depth[idx],
            kind=self.kind[idx],
            dep_tb=self.dep_tb[idx],
            dep_op=self.dep_op[idx],
            group_rank=self.group_rank,
            group_tb=self.group_tb,
            group_peer=self.group_peer,
            group_kind=self.group_kind,
            group_lo=lo,
            group_hi=lo + size,
        )
        return dense, idx


def layout(n: int, p: Plan) -> Layout:
    """The layout of plan ``p`` for ``n`` ranks, from scratch (dense; see the module docstring)."""
    t = hops(p)
    k = t.msg.size
    # Events: 2i = send of transfer i on its sender, 2i + 1 = its receive on its receiver.
    rank = np.empty(2 * k, dtype=np.int64)
    peer = np.empty(2 * k, dtype=np.int64)
    rank[0::2], rank[1::2] = t.frm, t.to
    peer[0::2], peer[1::2] = t.to, t.frm
    kind = np.tile(np.array([0, 1]), k)
    conn = (rank * n + peer) * 2 + kind
    # Events grouped by connection, in issue order within each (a stable sort).
    by_conn = np.argsort(conn, kind="stable")
    sc = conn[by_conn]
    starts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]]) if sc.size else np.zeros(0, dtype=np.int64)
    sizes = np.diff(np.r_[starts, sc.size])
    first_event = by_conn[starts]
    u_rank = sc[starts] // (2 * n)
    # Connections of a rank in order of first use: that order is the threadblock order.
    order = np.lexsort((first_event, u_rank))
    ranks_sorted = u_rank[order]
    tb_of_conn = np.empty(starts.size, dtype=np.int64)
    tb_of_conn[order] = 1 + (np.arange(order.size) - np.searchsorted(ranks_sorted, ranks_sorted, side="left"))
    ev = by_conn[concat_ranges(starts[order], starts[order] + sizes[order])]
    size_s = sizes[order]
    lo = np.r_[0, np.cumsum(size_s)[:-1]].astype(np.int64) if size_s.size else np.zeros(0, dtype=np.int64)
    hi = lo + size_s
    op_sorted = np.arange(ev.size) - np.repeat(lo, size_s)
    conn_of_event = np.empty(ev.size, dtype=np.int64)
    conn_of_event[by_conn] = np.repeat(np.arange(starts.size), sizes)
    tb = tb_of_conn[conn_of_event]
    op_idx = np.empty(ev.size, dtype=np.int64)
    op_idx[ev] = op_sorted
    recv_event = 2 * np.arange(k) + 1
    hop_event = np.full((p.gpus.shape[0], max(p.gpus.shape[1] - 1, 1)), -1, dtype=np.int64)
    hop_event[t.msg, t.depth] = recv_event
    dep_event = np.where(t.depth > 0, hop_event[t.msg, np.maximum(t.depth - 1, 0)], -1)
    dep_tb = np.full(2 * k, -1, dtype=np.int64)
    dep_op = np.full(2 * k, -1, dtype=np.int64)
    dep_tb[0::2] = np.where(dep_event >= 0, tb[np.maximum(dep_event, 0)], -1)
    dep_op[0::2] = np.where(dep_event >= 0, op_idx[np.maximum(dep_event, 0)], -1)
    half = ev // 2  # the transfer of each event
    return Layout(
        msg=t.msg[half],
        depth=t.depth[half],
        kind=kind[ev],
        dep_tb=dep_tb[ev],
        dep_op=dep_op[ev],
        group_rank=ranks_sorted,
        group_tb=tb_of_conn[order],
        group_peer=peer[first_event[order]],
        group_kind=kind[first_event[order]],
        group_lo=lo,
        group_hi=hi,
    )


def keeps_order(p: Plan, old_plan: Plan) -> bool:
    """Whether ``p`` takes over rows of ``old_plan`` in their order (what :func:`layout_delta` relies on)."""
    if p.prev_row is None:
        return False
    taken = p.prev_row[p.prev_row >= 0]
    return bool(taken.size == 0 or (taken.max() < old_plan.src.size and np.all(np.diff(taken) > 0)))


def layout_delta(n: int, p: Plan, old: Layout, old_plan: Plan) -> tuple[Layout, np.ndarray, tuple]:
    """:func:`layout` of ``p`` computed from the layout of the plan it was planned from (``p.prev_row``).

    ``p`` must take over ``old_plan``'s rows in their order (:func:`keeps_order`).
    Events of messages taken over keep their entries; a group (connection)
    that loses or gains an event gets its list rebuilt (ordered by the key
    ``depth * M + row``, as the issue sequence orders them) and appended;
    groups are renumbered by first use. Dependencies are re-targeted only
    where the receive they wait for moved (its group was rebuilt or renumbered).

    Returns ``(layout, src, reuse)``: the layout (with unused entries, see
    :class:`Layout`; :meth:`Layout.compact` of it equals :func:`layout` of
    ``p``); per entry, the entry of ``old`` with the same op (the same hop
    of the same message with the same dependency), or -1; and
    ``(new groups, old groups)``, the groups whose ops are all the old
    group's, in order (their threadblocks can be taken over as they are).
    """
    m_new = p.src.size
    old_rows = old_plan.src.size
    prev_row = p.previous_rows().copy()
    prev_row[prev_row >= old_rows] = -1
    kept = np.flatnonzero(prev_row >= 0)
    # Row in p of each old row; the extra last entry maps unused entries (msg -1) to -1.
    old_to_new = np.full(old_rows + 1, -1, dtype=np.int64)
    old_to_new[prev_row[kept]] = kept
    e_old, g_old = old.msg.size, old.group_lo.size
    msg = old_to_new[old.msg]
    dead = np.flatnonzero((msg < 0) & (old.msg >= 0))  # events of dropped messages

    # Events of the new messages: 2j = send of transfer j, 2j + 1 = its receive.
    t = hops(p, np.flatnonzero(prev_row < 0))
    k = t.msg.size
    i_rank = np.empty(2 * k, dtype=np.int64)
    i_peer = np.empty(2 * k, dtype=np.int64)
    i_rank[0::2], i_rank[1::2] = t.frm, t.to
    i_peer[0::2], i_peer[1::2] = t.to, t.frm
    i_conn = (i_rank * n + i_peer) * 2 + np.tile(np.array([0, 1]), k)
    # Their connections: an old group, or a new one.
    g_conn = (old.group_rank * n + old.group_peer) * 2 + old.group_kind
    i_group = np.full(2 * k, -1, dtype=np.int64)
    if g_old and k:
        by_conn = np.argsort(g_conn)
        i_group = by_conn[np.minimum(np.searchsorted(g_conn[by_conn], i_conn), g_old - 1)]
        i_group = np.where(g_conn[i_group] == i_conn, i_group, -1)
    fresh_conn, fresh_inv = np.unique(i_conn[i_group < 0], return_inverse=True)
    i_group[i_group < 0] = g_old + fresh_inv.ravel()
    g_all = g_old + fresh_conn.size
    touched = np.zeros(g_all, dtype=bool)
    if dead.size:
        touched[old.group_of(dead)] = True
    touched[i_group] = True
    t_old = np.flatnonzero(touched[:g_old])

    # Rebuilt lists: the touched old groups' surviving events and the new events, by key.
    gone = concat_ranges(old.group_lo[t_old], old.group_hi[t_old])  # their old entries become unused
    gone_group = np.repeat(t_old, old.group_hi[t_old] - old.group_lo[t_old])
    alive_old = msg[gone] >= 0
    o_ev, o_group = gone[alive_old], gone_group[alive_old]
    m_group = np.r_[o_group, i_group]
    m_key = np.r_[old.depth[o_ev] * m_new + msg[o_ev], np.repeat(t.depth * m_new + t.msg, 2)]
    m_src = np.r_[o_ev, -1 - np.arange(2 * k)]  # >= 0: an old entry; < 0: new event -1 - m_src
    order = np.argsort(m_group * (int(m_key.max(initial=0)) + 1) + m_key, kind="stable")  # by (group, key)
    m_group, m_key, m_src = m_group[order], m_key[order], m_src[order]
    m_lo = np.searchsorted(m_group, np.arange(g_all), side="left")
    m_hi = np.searchsorted(m_group, np.arange(g_all), side="right")
    old_size = old.group_hi - old.group_lo
    size = np.where(touched, m_hi - m_lo, np.r_[old_size, np.zeros(fresh_conn.size, dtype=np.int64)])
    g_lo = np.where(touched, e_old + m_lo, np.r_[old.group_lo, np.zeros(fresh_conn.size, dtype=np.int64)])

    # Groups of a rank in order of first use (the key of their first event).
    first_key = np.full(g_all, -1, dtype=np.int64)
    untouched_old = np.flatnonzero(~touched[:g_old])
    first_ev = old.group_lo[untouched_old]
    first_key[untouched_old] = old.depth[first_ev] * m_new + msg[first_ev]
    has = np.flatnonzero(touched & (size > 0))
    first_key[has] = m_key[m_lo[has]]
    g_rank = np.r_[old.group_rank, fresh_conn // (2 * n)]
    alive = np.flatnonzero(size > 0)
    span = int(first_key.max(initial=0)) + 1
    g_order = alive[np.argsort(g_rank[alive] * span + first_key[alive], kind="stable")]  # by (rank, first key)
    ranks_sorted = g_rank[g_order]
    tb_sorted = 1 + (np.arange(g_order.size) - np.searchsorted(ranks_sorted, ranks_sorted, side="left"))
    tb_of = np.full(g_all, -1, dtype=np.int64)  # the new threadblock index of every group
    tb_of[g_order] = tb_sorted

    # The arrays: old entries (the rebuilt groups' ones unused now), then the rebuilt lists.
    from_old = m_src >= 0
    o_at, i_at = np.flatnonzero(from_old), np.flatnonzero(~from_old)
    o_src, i_ev = m_src[o_at], -1 - m_src[i_at]
    n_app = m_src.size

    def appended(old_col: np.ndarray, new_col: np.ndarray) -> np.ndarray:
        out = np.empty(n_app, dtype=np.int64)
        out[o_at] = old_col[o_src]
        out[i_at] = new_col
        return out

    a_msg = appended(msg, t.msg[i_ev // 2])
    a_depth = appended(old.depth, t.depth[i_ev // 2])
    a_kind = appended(old.kind, i_ev % 2)
    msg[gone] = -1
    msg = np.concatenate([msg, a_msg])
    depth = np.concatenate([old.depth, a_depth])
    kind = np.concatenate([old.kind, a_kind])
    dep_tb = np.concatenate([old.dep_tb, np.full(n_app, -1, dtype=np.int64)])
    dep_op = np.concatenate([old.dep_op, np.full(n_app, -1, dtype=np.int64)])
    dep_tb[gone] = -1
    dep_op[gone] = -1
    src = np.arange(e_old + n_app, dtype=np.int64)
    src[e_old:] = -1
    src[gone] = -1
    src[e_old + o_at] = o_src

    # Where the old entries of rebuilt groups went (op index in their new list).
    pos_of_old = np.full(e_old, -1, dtype=np.int64)
    pos_of_old[o_src] = o_at - m_lo[m_group[o_at]]
    first_of_rank = np.searchsorted(old.group_rank, np.arange(n), side="left")
    retarget = touched[:g_old] | (tb_of[:g_old] != old.group_tb)  # receives there may have moved

    def moved_target(ev: np.ndarray, rank: np.ndarray):
        """New (tb, op) of the receive each old forwarded send ``ev`` (on ``rank``) waits for."""
        tg = first_of_rank[rank] + old.dep_tb[ev] - 1
        op = np.where(touched[tg], pos_of_old[np.maximum(old.group_lo[tg] + old.dep_op[ev], 0)], old.dep_op[ev])
        return tb_of[tg], op, retarget[tg]

    # Forwarded sends in groups that kept their entries: re-target where the receive moved.
    fwd = np.flatnonzero(dep_tb[:e_old] >= 0)
    rebuilt = touched.copy()
    if fwd.size:
        # A send at hop j is on the j-th GPU its message visits.
        f_rank = old_plan.gpus[old.msg[fwd], old.depth[fwd]]
        may = retarget[first_of_rank[f_rank] + old.dep_tb[fwd] - 1]
        fwd, f_rank = fwd[may], f_rank[may]
    if fwd.size:
        tb_new, op_new, _ = moved_target(fwd, f_rank)
        changed = np.flatnonzero((tb_new != dep_tb[fwd]) | (op_new != dep_op[fwd]))
        ev = fwd[changed]
        dep_tb[ev], dep_op[ev] = tb_new[changed], op_new[changed]
        src[ev] = -1
        if ev.size:
            rebuilt[old.group_of(ev)] = True
    # Forwarded sends in the rebuilt lists.
    a_fwd = np.flatnonzero((a_kind == 0) & (a_depth > 0))
    if a_fwd.size:
        rank = g_rank[m_group[a_fwd]]
        is_old = from_old[a_fwd]
        f_old, f_new = a_fwd[is_old], a_fwd[~is_old]
        tb_new, op_new, _ = moved_target(m_src[f_old], rank[is_old])
        dep_tb[e_old + f_old], dep_op[e_old + f_old] = tb_new, op_new
        keep_op = (tb_new == old.dep_tb[m_src[f_old]]) & (op_new == old.dep_op[m_src[f_old]])
        src[e_old + f_old[~keep_op]] = -1
        # A new message's send waits for its previous hop's receive, also a new event.
        j = -1 - m_src[f_new]
        width = int(t.depth.max()) + 1 if k else 1
        recv_of = np.full(m_new * width, -1, dtype=np.int64)
        recv_of[t.msg * width + t.depth] = 2 * np.arange(k) + 1
        target = recv_of[t.msg[j // 2] * width + t.depth[j // 2] - 1]
        at = np.empty(2 * k, dtype=np.int64)
        at[i_ev] = i_at
        where = at[target]
        grp = m_group[where]
        dep_tb[e_old + f_new], dep_op[e_old + f_new] = tb_of[grp], where - m_lo[grp]

    lay = Layout(
        msg=msg,
        depth=depth,
        kind=kind,
        dep_tb=dep_tb,
        dep_op=dep_op,
        group_rank=ranks_sorted,
        group_tb=tb_sorted,
        group_peer=np.r_[old.group_peer, (fresh_conn // 2) % n][g_order],
        group_kind=np.r_[old.group_kind, fresh_conn % 2][g_order],
        group_lo=g_lo[g_order],
        group_hi=g_lo[g_order] + size[g_order],
    )
    kept_groups = np.flatnonzero(~rebuilt[g_order] & (g_order < g_old))
    reuse = (kept_groups, g_order[kept_groups])
    if msg.size > MAX_SLACK * max(lay.num_events, 1):
        lay, idx = lay.compact()
        src = src[idx]
    return lay, src, reuse
