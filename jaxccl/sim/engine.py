"""The event loop: resolves a :class:`~jaxccl.sim.model.Program` in time order.

State: the time of every DAG node (the max of its predecessors'), the number of
unresolved predecessors of each, and the *active flows* (messages that started
and have not sent their last byte) with remaining bytes, rate and the time they
were last settled.

One iteration takes every event within a relative tolerance of the earliest one
(a batch: synchronous ring steps, all flows of an AllToAll...):

1. *Events*: a flow ends at its current rate (END), a flow's first pipeline
   piece is out while some forward waits for it (a *watch*), a queued node is
   due (ARR = END + route latency; job starts), or a gated launch is due.
2. The resolved nodes propagate through the DAG: successors lose a pending
   predecessor and take the max time; a node left with none resolves. A LAUNCH
   whose gates are open (each source's first piece out + its latency, see
   :mod:`jaxccl.sim.model`) starts a flow unless it needs a slot (its
   receiving op is not running) and its connection has none free: then it
   queues for one (a receiving op that starts frees the slot of the message
   waiting for it and hands it to the first queued message); ARR is queued
   at ``time + latency``.
3. Rates are recomputed max-min fairly, each flow weighted by its
   ``Program.msg_weight`` (its tile bytes under per-tile sharing), only in the
   connected components (flows linked by shared links) of the flows that
   started or ended: allocations of disjoint components are independent. A
   forward keeps at most the pace (rate over weight) of the sources it
   streams from (cut-through cannot outrun the data); when a flow's rate
   changes, the flows streaming from it are re-rated in turn. Flows whose
   rate changed get a new predicted END.

Work per batch is proportional to what changed, not to the number of active
flows: small batches and components run as plain Python over memoryviews of
the DAG arrays, large ones (a whole AllToAll starting) switch to numpy
(vectorized DAG waves, :func:`jaxccl.sim.fairness.max_min_rates`, the flows
of one route that no source caps solved as one). When a
component search meets a component of more than ``_BIG_COMPONENT`` flows
(a tree packing on one rail: every flow shares a NIC with another), all
active flows are solved in one numpy call, and the next searches are
skipped with exponential backoff: solving a union of components is exact,
so this only trades search time for solve size.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time as _time
from collections.abc import Callable

import numpy as np

from jaxccl.errors import ScheduleError, SimulationError
from jaxccl.sim.fairness import max_min_rates
from jaxccl.sim.model import ARR, END, GOT, LAUNCH, MSG_KINDS, Program, _ranges

__all__ = ["EngineStats", "simulate"]

REL_TOL = 1e-9  # events closer than this (relative to the clock) form one batch
_BIG_FRONTIER = 128  # DAG frontiers above this propagate with numpy
_BIG_COMPONENT = 256  # components above this are allocated with numpy
_MAX_ROUNDS = 64  # cap-propagation rounds per batch
_GIANT_BACKOFF = 64  # after a component search hits _BIG_COMPONENT, skip up to this many searches (solve all)
_NUMPY_SET = 48  # flows in multi-flow components above which one numpy call solves them all
_GROUP_ROUTES = True  # numpy solves merge the flows of one route that no source caps (see _rates_np)
_INF = float("inf")
_heappush, _heappop = heapq.heappush, heapq.heappop
_E_NODE, _E_END, _E_WATCH, _E_LAUNCH = 0, 1, 2, 3
_IDLE, _RUN, _DONE = 0, 1, 2


class EngineStats(dict):
    """Counters of one run.

    ``batches``, ``rate_updates``, ``numpy_allocations``, ``max_active``,
    ``wall_s``; ``merged_flows`` counts, over all numpy solves, the flows solved as part
    of a route group rather than alone.
    """


class _Sim:
    def __init__(self, prog: Program, progress: Callable[[float], None] | None, max_wall_s: float | None):
        self.p = prog
        self.progress = progress
        self.max_wall_s = max_wall_s
        n_ops, n_msgs = prog.num_ops, prog.num_msgs
        self.n_msgs = n_msgs
        base = 2 * n_ops
        self.b_launch = base + LAUNCH * n_msgs
        self.b_end = base + END * n_msgs
        self.b_arr = base + ARR * n_msgs
        self.b_got = base + GOT * n_msgs
        self.b_start = base + MSG_KINDS * n_msgs
        self.pending = prog.pending.copy()
        self.tnode = np.zeros(prog.num_nodes, dtype=np.float64)
        self.pv = memoryview(self.pending)
        self.tv = memoryview(self.tnode)
        self.ptr = memoryview(prog.succ_ptr)
        self.sidx = memoryview(prog.succ_idx)
        self.lat = memoryview(prog.msg_latency)
        self.wv = memoryview(prog.msg_weight)
        self.size = memoryview(prog.msg_bytes)
        self.fp_rem = prog.msg_bytes - prog.msg_fp_bytes  # remaining bytes once the first piece is out
        self.fpr = memoryview(self.fp_rem)
        self.src_ptr = memoryview(prog.msg_src_ptr)
        self.src_idx = memoryview(prog.msg_src_idx)
        self.path_ptr = prog.msg_path_ptr
        self.path_links = prog.msg_path_links
        self.ppv = memoryview(prog.msg_path_ptr)
        self.plv = memoryview(prog.msg_path_links)
        self.cap = prog.link_capacity
        self.capl = prog.link_capacity.tolist()
        self.streamed = memoryview(prog.msg_streamed.view(np.uint8))
        # flow state (per message)
        self.state = np.zeros(n_msgs, dtype=np.int8)
        self.rate = np.zeros(n_msgs, dtype=np.float64)
        self.rem = np.zeros(n_msgs, dtype=np.float64)
        self.ft = np.zeros(n_msgs, dtype=np.float64)
        self.ver = np.zeros(n_msgs, dtype=np.int64)
        self.fp_t = np.full(n_msgs, np.nan)  # when the first piece was out (NaN: not yet / unknown)
        self.sv, self.rv, self.remv = memoryview(self.state), memoryview(self.rate), memoryview(self.rem)
        self.ftv, self.verv, self.fpv = memoryview(self.ft), memoryview(self.ver), memoryview(self.fp_t)
        self.conn = memoryview(prog.msg_conn)
        self.num_slots = prog.num_slots
        self.receiver = memoryview(prog.msg_receiver)
        self.n_ops = prog.num_ops
        self.in_slots: dict[int, int] = {}  # connection -> its messages in slots (their receiving ops not running)
        self.slot_queue: dict[int, collections.deque[int]] = {}  # connection -> launched messages without a slot
        self.handed: set[int] = set()  # messages handed a freed slot, about to start
        self.held: dict[int, int] = {}  # receiving op not running yet -> the message waiting in a slot for it
        self.links: dict[int, tuple[int, ...]] = {}  # active flow -> its links
        self.bott: dict[int, float] = {}  # active flow -> smallest capacity on its route
        self.on_link: dict[int, set[int]] = {}  # link -> active flows
        self.ups: dict[int, list[int]] = {}  # active flow -> active flows it streams from
        self.downs: dict[int, set[int]] = {}  # active flow -> active flows streaming from it
        self.waiters: dict[int, list[int]] = {}  # message -> launches waiting for its first piece
        self.gate_left: dict[int, int] = {}  # gated launch -> gates still closed
        self.launch_t: dict[int, float] = {}  # gated launch -> earliest start so far
        self.heap: list[tuple[float, int, int, int, int]] = []
        self._tick = itertools.count().__next__  # FIFO tie-break of equal times
        self.now = 0.0
        self.limit = 0.0
        self.done_msgs = 0
        self.stats = EngineStats(batches=0, rate_updates=0, numpy_allocations=0, merged_flows=0, max_active=0)
        self.t_wall = _time.perf_counter()
        # Solving every active flow is always exact (disjoint components are independent), so after a
        # component search finds a giant component the next few searches are skipped (exponential backoff).
        self._skip_search = 0
        self._backoff = 1
        self._pos = np.full(n_msgs, -1, dtype=np.int64)  # scratch: message -> index in a numpy solve

    # ------------------------------------------------------------------ queue
    def push(self, t: float, kind: int, x: int, ver: int = 0) -> None:
        _heappush(self.heap, (t, self._tick(), kind, x, ver))

    # ------------------------------------------------------------------ gates
    def first_piece(self, u: int) -> float | None:
        """When message ``u``'s first piece was out, if it is by now."""
        t = self.fpv[u]
        if t == t:  # not NaN
            return t
        if self.sv[u] != _RUN:
            return None
        rate = self.rv[u]
        if rate <= 0:
            return None
        t = self.ftv[u] + max(self.remv[u] - self.fpr[u], 0.0) / rate
        if t <= self.limit:
            self.fpv[u] = t
            return t
        return None

    def gate(self, m: int, launched: list[int]) -> None:
        """LAUNCH of ``m`` is resolved in the DAG: check its gates (stream sources)."""
        t = self.tv[self.b_launch + m]
        a, b = self.src_ptr[m], self.src_ptr[m + 1]
        closed = 0
        for k in range(a, b):
            u = self.src_idx[k]
            tf = self.first_piece(u)
            if tf is None:
                w = self.waiters.get(u)
                if w is None:
                    self.waiters[u] = [m]
                    self.watch(u)
                else:
                    w.append(m)
                closed += 1
            else:
                t = max(t, tf + self.lat[u])
        if closed:
            self.gate_left[m] = closed
            self.launch_t[m] = t
        elif t <= self.limit:
            launched.append(m)
            self.tv[self.b_launch + m] = t
        else:
            self.push(t, _E_LAUNCH, m)

    def watch(self, u: int) -> None:
        """Queues the gate-opening event of message ``u``: first piece out + latency (once ``u`` has a rate)."""
        t = self.fpv[u]
        if t != t:  # first piece not out yet: predict it
            if self.sv[u] != _RUN or self.rv[u] <= 0:
                return
            t = self.ftv[u] + max(self.remv[u] - self.fpr[u], 0.0) / self.rv[u]
        self.push(t + self.lat[u], _E_WATCH, u, self.verv[u])

    def open_gates(self, u: int, launched: list[int]) -> None:
        """Message ``u``'s first piece is out (``fp_t`` set): release the launches waiting for it."""
        ws = self.waiters.pop(u, None)
        if not ws:
            return
        t_open = self.fpv[u] + self.lat[u]
        for m in ws:
            t = max(self.launch_t[m], t_open)
            left = self.gate_left[m] - 1
            if left:
                self.gate_left[m] = left
                self.launch_t[m] = t
                continue
            del self.gate_left[m]
            del self.launch_t[m]
            if t <= self.limit:
                launched.append(m)
                self.tv[self.b_launch + m] = t
            else:
                self.push(t, _E_LAUNCH, m)

    def take_slot(self, m: int) -> bool:
        """Whether launched message ``m`` may start now (see the slot rule of :mod:`jaxccl.sim.model`).

        A message whose receiving op is running streams into it and needs no
        slot; otherwise it waits in one of its connection's slots until that op
        starts, or, all slots taken, queues for a slot (first come, first served).
        """
        c = self.conn[m]
        r = self.receiver[m]
        handed = m in self.handed
        if handed:
            self.handed.discard(m)
        if self.pv[r] == 0:  # the receiving op is running
            if handed:
                self.free_slot(c, self.tv[self.b_launch + m])
            return True
        if not handed:
            used = self.in_slots.get(c, 0)
            if used >= self.num_slots:
                q = self.slot_queue.get(c)
                if q is None:
                    self.slot_queue[c] = collections.deque((m,))
                else:
                    q.append(m)
                return False
            self.in_slots[c] = used + 1
        self.held[r] = m
        return True

    def free_slot(self, c: int, t: float) -> None:
        """A slot of connection ``c`` is free at ``t``: the first queued message takes it, or it stays free."""
        q = self.slot_queue.get(c)
        if q:
            nxt = q.popleft()
            if not q:
                del self.slot_queue[c]
            self.tv[self.b_launch + nxt] = t
            self.handed.add(nxt)
            self._launched.append(nxt)
        else:
            self.in_slots[c] -= 1

    def receiver_ready(self, op: int) -> None:
        """Op ``op`` starts: a message waiting in a slot for it streams into it, and its slot is free."""
        m = self.held.pop(op, None)
        if m is not None:
            self.free_slot(self.conn[m], self.tv[op])

    # ------------------------------------------------------------- propagation
    def propagate(self, frontier: list[int], launched: list[int]) -> None:
        """Resolves the successors of ``frontier`` (whose times are final); collects launches."""
        tv, pv, ptr, sidx, lat = self.tv, self.pv, self.ptr, self.sidx, self.lat
        b_launch, b_end, b_arr, b_got = self.b_launch, self.b_end, self.b_arr, self.b_got
        n_ops, held = self.n_ops, self.held
        stack = frontier
        while stack:
            if len(stack) > _BIG_FRONTIER:
                self._propagate_np(np.asarray(stack, dtype=np.int64), launched)
                return
            x = stack.pop()
            tx = tv[x]
            for s in sidx[ptr[x] : ptr[x + 1]]:
                if tv[s] < tx:
                    tv[s] = tx
                left = pv[s] - 1
                pv[s] = left
                if left:
                    continue
                if s < b_launch or s >= b_got:
                    stack.append(s)
                    if s < n_ops and held:
                        self.receiver_ready(s)
                elif s < b_end:
                    self.gate(s - b_launch, launched)
                elif s >= b_arr:  # ARR: END + latency
                    d = lat[s - b_arr]
                    if d > 0:
                        t = tv[s] + d
                        tv[s] = t
                        _heappush(self.heap, (t, self._tick(), _E_NODE, s, 0))
                    else:
                        stack.append(s)
                else:
                    raise AssertionError(f"END node {s} resolved by the DAG")

    def _propagate_np(self, frontier: np.ndarray, launched: list[int]) -> None:
        tnode, pending, prog = self.tnode, self.pending, self.p
        ptr, sidx = prog.succ_ptr, prog.succ_idx
        while frontier.size:
            starts = ptr[frontier]
            lens = ptr[frontier + 1] - starts
            idx = _ranges(starts, lens)
            if idx.size == 0:
                return
            succ = sidx[idx].astype(np.int64)
            np.maximum.at(tnode, succ, np.repeat(tnode[frontier], lens))
            np.subtract.at(pending, succ, 1)
            cand = succ[pending[succ] == 0]
            if cand.size == 0:
                return
            cand = np.unique(cand)
            is_launch = (cand >= self.b_launch) & (cand < self.b_end)
            is_arr = (cand >= self.b_arr) & (cand < self.b_got)
            nxt = cand[~is_launch & ~is_arr]
            if self.held:
                for op in nxt[nxt < self.n_ops].tolist():
                    self.receiver_ready(op)
            for m in (cand[is_launch] - self.b_launch).tolist():
                self.gate(m, launched)
            if is_arr.any():
                dn = cand[is_arr]
                d = prog.msg_latency[dn - self.b_arr]
                tnode[dn] += d
                later = d > 0
                for t, node in zip(tnode[dn[later]].tolist(), dn[later].tolist()):
                    self.push(t, _E_NODE, node)
                if not later.all():
                    nxt = np.concatenate([nxt, dn[~later]])
            frontier = nxt

    # ------------------------------------------------------------------- flows
    def start_flows(self, launched: list[int], seeds: set[int], frontier: list[int]) -> None:
        """Starts the launched messages; empty ones end at once (their END joins ``frontier``)."""
        tv, sv, size = self.tv, self.sv, self.size
        ppv, plv, sp, si = self.ppv, self.plv, self.src_ptr, self.src_idx
        on_link, capl = self.on_link, self.capl
        slots = self.num_slots is not None
        for m in launched:
            if slots and not self.take_slot(m):
                continue
            t = tv[self.b_launch + m]
            if size[m] <= 0:
                sv[m] = _RUN
                self.ftv[m] = t
                self.remv[m] = 0.0
                self.end(m, t, frontier, seeds, active=False)
                continue
            sv[m] = _RUN
            self.remv[m] = size[m]
            self.ftv[m] = t
            self.rv[m] = 0.0
            links = tuple(plv[ppv[m] : ppv[m + 1]])
            self.links[m] = links
            bott = _INF
            for link in links:
                s = on_link.get(link)
                if s is None:
                    on_link[link] = {m}
                else:
                    s.add(m)
                c = capl[link]
                if c < bott:
                    bott = c
            self.bott[m] = bott
            a, b = sp[m], sp[m + 1]
            if b > a:
                ups = [u for u in si[a:b] if sv[u] == _RUN and u in self.links]
                if ups:
                    self.ups[m] = ups
                    for u in ups:
                        d = self.downs.get(u)
                        if d is None:
                            self.downs[u] = {m}
                        else:
                            d.add(m)
            seeds.add(m)

    def end(self, m: int, t: float, frontier: list[int], seeds: set[int], *, active: bool = True) -> None:
        """Message ``m`` sent its last byte at ``t``."""
        e = self.b_end + m
        self.tv[e] = t
        self.pv[e] -= 1
        frontier.append(e)
        self.sv[m] = _DONE
        self.done_msgs += 1
        if self.streamed[m] and self.fpv[m] != self.fpv[m]:
            rate = self.rv[m]
            self.fpv[m] = self.ftv[m] + max(self.remv[m] - self.fpr[m], 0.0) / rate if rate > 0 else t
            self.open_gates(m, self._launched)
        self.remv[m] = 0.0
        if not active:
            return
        del self.bott[m]
        for link in self.links.pop(m):
            s = self.on_link[link]
            s.discard(m)
            seeds.update(s)
        for u in self.ups.pop(m, ()):
            d = self.downs.get(u)
            if d is not None:
                d.discard(m)
        for d in self.downs.pop(m, ()):
            ups = self.ups.get(d)
            if ups is not None:
                ups.remove(m)
                if not ups:
                    del self.ups[d]
            seeds.add(d)
        seeds.discard(m)

    # -------------------------------------------------------------- allocation
    def _search(self, seeds: set[int]) -> list[list[int]] | None:
        """:meth:`components`, skipped (``None``: solve every active flow) for a while after it found a giant one."""
        if self._skip_search:
            self._skip_search -= 1
            return None
        comps = self.components(seeds)
        if comps is None:
            self._skip_search = self._backoff
            self._backoff = min(2 * self._backoff, _GIANT_BACKOFF)
        else:
            self._backoff = 1
        return comps

    def components(self, seeds: set[int]) -> list[list[int]] | None:
        """The connected components (flows sharing links) of ``seeds``; ``None`` when one is too large."""
        links, on_link = self.links, self.on_link
        seen: set[int] = set()
        out = []
        for m in seeds:
            if m in seen:
                continue
            lm = links.get(m)
            if lm is None:
                continue
            seen.add(m)
            for link in lm:
                if len(on_link[link]) > 1:
                    break
            else:
                out.append([m])  # alone on all its links
                continue
            comp = [m]
            stack = [m]
            while stack:
                f = stack.pop()
                for link in links[f]:
                    for g in on_link[link]:
                        if g not in seen:
                            seen.add(g)
                            comp.append(g)
                            stack.append(g)
                if len(comp) > _BIG_COMPONENT:
                    return None
            out.append(comp)
        return out

    def allocate(self, seeds: set[int]) -> None:
        """Re-rates the flows around ``seeds``; then the forwards of any flow whose rate changed.

        A solved set is either the components of ``seeds`` (Python progressive
        filling per component, or one numpy call over their union when large)
        or every active flow (numpy) when the seeds are many. Inside a solved
        set, forwards are coupled to their sources jointly (they freeze with
        them); a source outside it caps the forward at its current rate, and a
        change of that rate re-solves the forward's set in the next round.
        """
        rv, remv, ftv, verv, fpv, fpr = self.rv, self.remv, self.ftv, self.verv, self.fpv, self.fpr
        links, now, bott, ups = self.links, self.now, self.bott, self.ups
        heap, tick = self.heap, self._tick
        rounds = 0
        while seeds:
            rounds += 1
            self.stats["rate_updates"] += 1
            if len(links) > self.stats["max_active"]:
                self.stats["max_active"] = len(links)
            comps = None if len(seeds) > _BIG_COMPONENT else self._search(seeds)
            flows: list[int] = []
            new: list[float] = []
            group: dict[int, int] = {}  # flow -> id of the set it was solved in (jointly coupled inside)
            solved_all = comps is None
            if solved_all:
                act = np.fromiter(links, dtype=np.int64, count=len(links))
                rates = self._rates_np(act)
                changed = rates != self.rate[act]
                flows = act[changed].tolist()
                new = rates[changed].tolist()
            else:
                multi: list[list[int]] = []
                n_multi = 0
                for gid, comp in enumerate(comps, start=1):
                    if len(comp) == 1:
                        f = comp[0]
                        b = bott[f]
                        if f in ups:
                            c = self._cap(f, ())
                            if c < b:
                                b = c
                        flows.append(f)
                        new.append(b)
                        group[f] = gid
                    else:
                        n_multi += len(comp)
                        multi.append(comp)
                if n_multi > _NUMPY_SET:
                    union = [f for comp in multi for f in comp]
                    flows.extend(union)
                    new.extend(self._rates_np(np.asarray(union, dtype=np.int64)).tolist())
                    group.update(dict.fromkeys(union, 0))
                else:
                    for gid, comp in enumerate(multi, start=len(comps) + 1):
                        flows.extend(comp)
                        new.extend(self._rates_py(comp))
                        group.update(dict.fromkeys(comp, gid))
            seeds = set()
            for f, r in zip(flows, new):
                old = rv[f]
                if r == old:
                    continue
                t0 = ftv[f]
                if now > t0:
                    before = remv[f]
                    after = before - old * (now - t0)
                    target = fpr[f]
                    if before > target >= after and fpv[f] != fpv[f] and self.streamed[f]:
                        fpv[f] = t0 + (before - target) / old  # the first piece went out in this segment
                    remv[f] = after
                    ftv[f] = now
                rv[f] = r
                ver = verv[f] + 1
                verv[f] = ver
                _heappush(heap, (ftv[f] + remv[f] / r, tick(), _E_END, f, ver))
                if f in self.waiters:
                    self.watch(f)
                d = self.downs.get(f)
                if d:
                    seeds.update(d)
            if solved_all:
                seeds = set()  # every active forward was solved jointly with its active sources
            elif seeds:
                # a forward solved jointly with all its sources needs no second look
                seeds = {
                    d for d in seeds if d not in group or any(group.get(u, -1) != group[d] for u in ups.get(d, ()))
                }
            if rounds > _MAX_ROUNDS:  # couplings through shared links could ping-pong; stop refining
                break

    def _cap(self, f: int, inside) -> float:
        """The rate cap of a forwarding flow from its sources outside ``inside``: their current paces.

        A forward gets no further ahead than each source, in weighted terms
        (:mod:`jaxccl.sim.fairness`): ``rate[f] <= rate[u] * w[f] / w[u]``.
        """
        us = self.ups.get(f)
        if not us:
            return _INF
        rv, wv = self.rv, self.wv
        wf = wv[f]
        cap = _INF
        for u in us:
            if u not in inside:
                r = rv[u]
                if r > 0:
                    r = r * (wf / wv[u]) if wf != wv[u] else r
                    if r < cap:
                        cap = r
        return cap

    def _rates_py(self, comp: list[int]) -> list[float]:
        """Progressive filling for a small component (as :func:`jaxccl.sim.fairness.max_min_rates`).

        Forwards whose sources are in the component freeze with them; sources
        outside cap them (a private link of the cap's capacity).
        """
        links, cap, wv = self.links, self.capl, self.wv
        inside = set(comp)
        count: dict[int, float] = {}
        rem: dict[int, float] = {}
        cap_of: dict[int, float] = {}
        coupled = []
        for f in comp:
            wf = wv[f]
            for link in links[f]:
                count[link] = count.get(link, 0) + wf
            us = self.ups.get(f)
            if us:
                c = self._cap(f, inside)
                if c < _INF:
                    # the cap is a private link of the flow: key -1 - f never collides with link ids
                    count[-1 - f] = wf
                    rem[-1 - f] = c
                    cap_of[-1 - f] = c
                ins = [u for u in us if u in inside]
                if ins:
                    coupled.append((f, ins))
        for link in count:
            if link >= 0:
                rem[link] = cap[link]
                cap_of[link] = cap[link]
        rate = dict.fromkeys(comp, 0.0)
        unfrozen = set(comp)
        level = 0.0
        while unfrozen:
            delta = min(rem[link] / n for link, n in count.items() if n > 0)
            level += delta
            sat = set()
            for link, n in count.items():
                if n > 0:
                    r = rem[link] - delta * n
                    rem[link] = r
                    if r <= 1e-9 * cap_of[link] + 1e-9 * delta * n:
                        sat.add(link)
            newly = {f for f in unfrozen if -1 - f in sat or any(link in sat for link in links[f])}
            if coupled:
                grew = True
                while grew:
                    grew = False
                    for f, us in coupled:
                        if f in unfrozen and f not in newly and any(u in newly or u not in unfrozen for u in us):
                            newly.add(f)
                            grew = True
            for f in newly:
                wf = wv[f]
                rate[f] = level * wf
                unfrozen.discard(f)
                for link in links[f]:
                    left = count[link] - wf
                    count[link] = left if left > 1e-9 * wf else 0
                if -1 - f in count:
                    count[-1 - f] = 0
            for link in sat:
                rem[link] = 0.0
        return [rate[f] for f in comp]

    def _rates_np(self, act: np.ndarray) -> np.ndarray:
        """Max-min rates of the flows ``act`` with numpy; forwards couple jointly to sources among ``act``.

        Flows that are no forward (nothing caps them but their links) and
        share a route are solved as one flow of their summed weight: they
        cross the same links, so they freeze together at one level, and each
        gets its weight's part of the group's rate (exactly what solving them
        one by one gives). Forwards are solved one by one.
        """
        self.stats["numpy_allocations"] += 1
        weight = self.p.msg_weight[act]
        pos = self._pos
        pos[act] = np.arange(act.size)
        pairs = [(f, u) for f, us in self.ups.items() for u in us]
        pd = pu = out_d = out_r = None
        if pairs:
            pa = np.asarray(pairs, dtype=np.int64)
            pd, pu = pos[pa[:, 0]], pos[pa[:, 1]]
            mine = pd >= 0
            pd, pu, src = pd[mine], pu[mine], pa[mine, 1]
            out = pu < 0
            out_d = pd[out]
            out_r = self.rate[src[out]] * (weight[out_d] / self.p.msg_weight[src[out]])
            pd, pu = pd[~out], pu[~out]
        pos[act] = -1
        # group: flows that are not forwards, by route; every forward alone (a key no route has)
        key = self.p.msg_route[act].copy()
        if pairs:
            key[pd] = -1 - pd
            key[out_d] = -1 - out_d
        uniq, grp = np.unique(key, return_inverse=True)
        grp = grp.reshape(-1)
        n_groups = uniq.size if _GROUP_ROUTES else act.size
        if n_groups < act.size:
            self.stats["merged_flows"] += act.size - n_groups
            rep = np.empty(n_groups, dtype=np.int64)
            rep[grp[::-1]] = np.arange(act.size - 1, -1, -1)  # the first member of each group
            group_weight = np.bincount(grp, weights=weight, minlength=n_groups)
        else:
            grp = rep = np.arange(act.size)
            group_weight = weight
        members = act[rep]
        pp = self.path_ptr
        lens = pp[members + 1] - pp[members]
        link_ids = self.path_links[_ranges(pp[members], lens)]
        fl = np.repeat(np.arange(n_groups), lens)
        link_cap = self.cap
        coupled = (grp[pd], grp[pu]) if pd is not None and pd.size else None
        if out_r is not None:
            ok = out_r > 0
            if ok.any():
                # sources outside ``act`` cap their forwards at their current paces: a private link per forward
                caps = np.full(n_groups, _INF)
                np.minimum.at(caps, grp[out_d[ok]], out_r[ok])
                capped = np.flatnonzero(caps < _INF)
                fl = np.concatenate([fl, capped])
                link_ids = np.concatenate([link_ids, link_cap.size + np.arange(capped.size)])
                link_cap = np.concatenate([link_cap, caps[capped]])
        rates = max_min_rates(fl, link_ids, link_cap, n_groups, coupled=coupled, weight=group_weight)
        if n_groups == act.size:
            return rates
        return rates[grp] * (weight / group_weight[grp])

    # -------------------------------------------------------------------- loop
    def run(self) -> None:
        p = self.p
        for j in range(p.num_jobs):
            node = self.b_start + j
            self.tv[node] = float(p.job_start[j])
            self.push(float(p.job_start[j]), _E_NODE, node)
        heap = self.heap
        sv, verv = self.sv, self.verv
        b_start, b_launch = self.b_start, self.b_launch
        next_report = 0.0
        batches = 0
        while heap:
            t0 = heap[0][0]
            self.now = t0
            self.limit = limit = t0 + REL_TOL * max(abs(t0), 1e-12)
            frontier: list[int] = []
            seeds: set[int] = set()
            launched: list[int] = []
            self._launched = launched
            while heap and heap[0][0] <= limit:
                t, _, kind, x, ver = _heappop(heap)
                if kind == _E_NODE:
                    if x >= b_start:
                        self.pv[x] -= 1
                    frontier.append(x)
                elif kind == _E_END:
                    if ver == verv[x] and sv[x] == _RUN:
                        self.end(x, t, frontier, seeds)
                elif kind == _E_WATCH:
                    if ver == verv[x] and x in self.waiters:
                        if self.fpv[x] != self.fpv[x]:
                            self.fpv[x] = t - self.lat[x]
                        self.open_gates(x, launched)
                else:  # gated launch now due
                    self.tv[b_launch + x] = t
                    launched.append(x)
            batches += 1
            while frontier or launched:
                if frontier:
                    self.propagate(frontier, launched)
                    frontier = []
                if launched:
                    todo, launched = launched, []
                    self._launched = launched
                    self.start_flows(todo, seeds, frontier)
            self.allocate(seeds)
            if batches & 1023 == 0:
                if self.progress is not None and self.n_msgs and self.done_msgs / self.n_msgs >= next_report:
                    self.progress(self.done_msgs / self.n_msgs)
                    next_report = self.done_msgs / self.n_msgs + 0.01
                if self.max_wall_s is not None and _time.perf_counter() - self.t_wall > self.max_wall_s:
                    raise SimulationError(
                        f"simulation exceeded its wall-time limit of {self.max_wall_s:.0f} s at t={t0:.6g} s"
                    )
        self.stats["batches"] = batches
        if self.progress is not None:
            self.progress(1.0)


def simulate(
    prog: Program,
    *,
    progress: Callable[[float], None] | None = None,
    max_wall_s: float | None = None,
) -> tuple[np.ndarray, EngineStats]:
    """Runs the DAG; returns the time of every node and statistics.

    Args:
        prog: from :func:`jaxccl.sim.model.compile_jobs`.
        progress: called now and then with the fraction of messages finished.
        max_wall_s: abort (``RuntimeError``) when the simulation takes longer.

    Raises:
        ScheduleError: the schedule deadlocks (some op can never run); the
            message names the first stuck op.
    """
    sim = _Sim(prog, progress, max_wall_s)
    sim.run()
    n_ops = prog.num_ops
    stuck = np.flatnonzero(sim.pending[n_ops : 2 * n_ops] > 0)
    if stuck.size:
        ready_done = sim.pending[stuck] == 0
        op = int(stuck[ready_done][0]) if ready_done.any() else int(stuck[0])
        raise ScheduleError(f"deadlock: {stuck.size} ops never complete; the first blocked is {prog.describe_op(op)}")
    sim.stats["wall_s"] = _time.perf_counter() - sim.t_wall
    return sim.tnode, sim.stats
