"""jaxccl's analytic cost model: the predicted time of every arm of a context, and its runner-up margin.

NCCL-BOT (Sec. 4) seeds its bandits with NCCL's cost model; this is
jaxccl's counterpart, an alpha-beta model evaluated hop by hop along the
schedule IR:

* Every message (the k-th send of a connection matched with its k-th
  receive, as in ``docs/schedule-ir.md``) crosses the topology's primary
  route and costs ``alpha + bytes / beta`` with
  ``alpha = latency_scale x (route latency) + hop_overhead_s`` and
  ``beta = bw_efficiency x (route bottleneck capacity)``.
* Ops run in threadblock order and wait for their ``deps``; a receive ends
  when its message has arrived; a forwarding send (``rcs``/``rrs``/``rrcs``,
  or a send that depends on a receive) starts once the first protocol piece
  (``piece_bytes``) of its input has arrived and cannot finish before that
  input has (cut-through forwarding). The longest such chain is the
  *critical path* ``CP(n)``.
* Contention is only bounded, not simulated: ``LB(n)`` is the most loaded
  link's bytes over its (efficiency-scaled) capacity.
* A schedule's predicted time is ``base_s + max(CP(n), LB(n))``; an arm's is
  the sum over its parts.

The four constants are calibrated (:func:`calibrate`) by a grid search on
measured (here: simulated) latencies of healthy topologies only; the model
never sees a pool it is scored on. What it leaves out -- max-min sharing of
links between concurrent flows, slot back-pressure -- is where it goes wrong.

Example:
    >>> from jaxccl.topology import rail
    >>> from jaxccl.tune.arms import Context, arm_catalog
    >>> topo = rail(hosts=2, gpus_per_host=4)
    >>> model = CostModel()
    >>> pred = model.predict_context(Context("all_gather", 8, 1 << 30), arm_catalog("all_gather", topo), topo)
    >>> min(pred, key=pred.get)
    'tree'
    >>> round(margin(pred), 3) >= 0
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxccl.schedule.ir import Schedule
from jaxccl.sim.routes import Router
from jaxccl.topology import Topology
from jaxccl.tune.arms import Arm, Context, TuneError

__all__ = ["DEFAULT_GRID", "CostModel", "CostParams", "calibrate", "margin"]

PIECE_BYTES = 512 * 1024  # NCCL's Simple protocol: a 4 MiB channel buffer in 8 steps


@dataclasses.dataclass(frozen=True)
class CostParams:
    """The model's constants (see the module docstring)."""

    latency_scale: float = 1.0
    hop_overhead_s: float = 0.0
    bw_efficiency: float = 1.0
    base_s: float = 0.0
    piece_bytes: float = PIECE_BYTES

    def __post_init__(self) -> None:
        for name in ("latency_scale", "hop_overhead_s", "base_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise TuneError(f"CostParams.{name} must be a finite number >= 0, got {v!r}")
        for name in ("bw_efficiency", "piece_bytes"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise TuneError(f"CostParams.{name} must be a finite number > 0, got {v!r}")

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostParams:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise TuneError(f"unknown cost-model parameter(s) {unknown}; expected {sorted(fields)}")
        return cls(**{k: float(v) for k, v in data.items()})


# A grid around the physical constants; calibration picks the point that fits best.
DEFAULT_GRID: dict[str, tuple[float, ...]] = {
    "latency_scale": (0.75, 1.0, 1.25, 1.5, 2.0),
    "hop_overhead_s": (0.0, 0.1e-6, 0.25e-6, 0.5e-6, 1e-6),
    "bw_efficiency": (0.6, 0.7, 0.8, 0.9, 1.0),
    "base_s": (0.0, 0.5e-6, 1e-6, 2e-6, 5e-6),
}


# ----------------------------------------------------------------------------- structure
@dataclasses.dataclass
class _Structure:
    """A schedule's ops in topological order, with its messages (topology-independent)."""

    num_ranks: int
    in_chunks: int
    order: list[int]  # op ids, topological
    prev: list[int]  # previous op in the threadblock or -1
    deps: list[tuple[int, ...]]  # non-streaming deps (completion)
    streams: list[tuple[int, ...]]  # messages a sending op forwards from
    out_msg: list[int]  # message an op sends, or -1
    in_msg: list[int]  # message an op receives, or -1
    msg_src: np.ndarray  # sender rank per message
    msg_dst: np.ndarray  # receiver rank per message
    msg_count: np.ndarray  # chunks per message


_STRUCTS: dict[str, _Structure] = {}
_STRUCTS_MAX = 256


def _structure(s: Schedule) -> _Structure:
    hit = _STRUCTS.get(s.digest)
    if hit is not None:
        return hit
    ids: dict[tuple[int, int, int], int] = {}
    ops = []
    for r, tbs in enumerate(s.ranks):
        for t, tb in enumerate(tbs):
            for i, op in enumerate(tb.ops):
                ids[(r, t, i)] = len(ops)
                ops.append((r, t, i, tb, op))
    n = len(ops)
    prev = [-1] * n
    out_msg = [-1] * n
    in_msg = [-1] * n
    sends: dict[tuple[int, int, int], list[int]] = {}
    recvs: dict[tuple[int, int, int], list[int]] = {}
    for o, (r, t, i, tb, op) in enumerate(ops):
        if i:
            prev[o] = o - 1
        if op.kind.sends:
            if tb.send_peer < 0:
                raise TuneError(f"schedule {s.name!r}: rank {r} threadblock {t} op {i} sends without a send peer")
            sends.setdefault((r, tb.send_peer, tb.channel), []).append(o)
        if op.kind.receives:
            if tb.recv_peer < 0:
                raise TuneError(f"schedule {s.name!r}: rank {r} threadblock {t} op {i} receives without a peer")
            recvs.setdefault((tb.recv_peer, r, tb.channel), []).append(o)
    src, dst, cnt = [], [], []
    for key, so in sends.items():
        ro = recvs.get(key, [])
        if len(ro) != len(so):
            raise TuneError(f"schedule {s.name!r}: connection {key} has {len(so)} sends and {len(ro)} receives")
        for a, b in zip(so, ro):
            m = len(src)
            out_msg[a], in_msg[b] = m, m
            src.append(key[0])
            dst.append(key[1])
            cnt.append(ops[a][4].count)
    deps: list[tuple[int, ...]] = []
    streams: list[tuple[int, ...]] = []
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for o, (r, _t, _i, _tb, op) in enumerate(ops):
        hard, stream = [], []
        if op.kind.sends and op.kind.receives:
            stream.append(in_msg[o])
        for dt, di in op.deps:
            d = ids.get((r, dt, di))
            if d is None:
                raise TuneError(f"schedule {s.name!r}: rank {r} op depends on missing op ({dt}, {di})")
            if op.kind.sends and ops[d][4].kind.receives:
                stream.append(in_msg[d])
            else:
                hard.append(d)
            succ[d].append(o)
            indeg[o] += 1
        deps.append(tuple(hard))
        streams.append(tuple(stream))
        if prev[o] >= 0:
            succ[prev[o]].append(o)
            indeg[o] += 1
    recv_of_msg = [-1] * len(src)
    for o in range(n):
        if in_msg[o] >= 0:
            recv_of_msg[in_msg[o]] = o
    for a in range(n):
        m = out_msg[a]
        if m >= 0:
            succ[a].append(recv_of_msg[m])
            indeg[recv_of_msg[m]] += 1
    queue = deque(o for o in range(n) if indeg[o] == 0)
    order = []
    while queue:
        o = queue.popleft()
        order.append(o)
        for x in succ[o]:
            indeg[x] -= 1
            if indeg[x] == 0:
                queue.append(x)
    if len(order) != n:
        raise TuneError(f"schedule {s.name!r} has a dependency cycle ({n - len(order)} ops never become ready)")
    st = _Structure(
        s.num_ranks,
        s.in_chunks,
        order,
        prev,
        deps,
        streams,
        out_msg,
        in_msg,
        np.asarray(src, dtype=np.int64),
        np.asarray(dst, dtype=np.int64),
        np.asarray(cnt, dtype=np.float64),
    )
    if len(_STRUCTS) >= _STRUCTS_MAX:
        _STRUCTS.pop(next(iter(_STRUCTS)))
    _STRUCTS[s.digest] = st
    return st


_ROUTERS: dict[str, Router] = {}


def _router(topo: Topology) -> Router:
    key = topo.fingerprint
    r = _ROUTERS.get(key)
    if r is None:
        r = Router(topo)
        if len(_ROUTERS) >= 16:
            _ROUTERS.pop(next(iter(_ROUTERS)))
        _ROUTERS[key] = r
    return r


def _routes(st: _Structure, topo: Topology) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per message: route latency, route bottleneck capacity; per link: chunks carried."""
    if st.num_ranks > topo.num_gpus:
        raise TuneError(f"schedule for {st.num_ranks} ranks does not fit a topology of {topo.num_gpus} GPUs")
    router = _router(topo)
    nm = st.msg_src.size
    lat = np.zeros(nm)
    cap = np.full(nm, np.inf)
    load = np.zeros(router.capacity.size)
    pairs: dict[tuple[int, int], tuple[float, float, tuple[int, ...]]] = {}
    for m in range(nm):
        u, v = int(st.msg_src[m]), int(st.msg_dst[m])
        hit = pairs.get((u, v))
        if hit is None:
            links = router.route(u, v)
            hit = (router.route_latency(links), float(router.capacity[list(links)].min()) if links else np.inf, links)
            pairs[(u, v)] = hit
        lat[m], cap[m] = hit[0], hit[1]
        if hit[2]:
            load[list(hit[2])] += st.msg_count[m]
    per_cap = load / router.capacity
    return lat, cap, per_cap


def _critical_path(
    st: _Structure,
    lat: np.ndarray,
    cap: np.ndarray,
    chunk: np.ndarray,
    latency_scale: np.ndarray,
    hop_overhead: np.ndarray,
    efficiency: np.ndarray,
    piece: float,
) -> np.ndarray:
    """Contention-free alpha-beta critical path; every array broadcasts to the result's shape."""
    shape = np.broadcast(chunk, latency_scale, hop_overhead, efficiency).shape
    zero = np.zeros(shape)
    complete: list[np.ndarray | None] = [None] * len(st.prev)
    nm = st.msg_src.size
    arr: list[np.ndarray | None] = [None] * nm
    fp_arr: list[np.ndarray | None] = [None] * nm
    for o in st.order:
        p = st.prev[o]
        t = complete[p] if p >= 0 else zero
        for d in st.deps[o]:
            t = np.maximum(t, complete[d])
        done = t
        m = st.out_msg[o]
        if m >= 0:
            beta = efficiency * cap[m]
            nbytes = st.msg_count[m] * chunk
            push = nbytes / beta
            fp_push = np.minimum(nbytes, piece) / beta
            alpha = latency_scale * lat[m] + hop_overhead
            launch = t
            for src in st.streams[o]:
                launch = np.maximum(launch, fp_arr[src])
            end = launch + push
            for src in st.streams[o]:
                end = np.maximum(end, arr[src] + fp_push)
            arr[m] = end + alpha
            fp_arr[m] = launch + fp_push + alpha
            done = np.maximum(done, end)
        m = st.in_msg[o]
        if m >= 0:
            done = np.maximum(done, arr[m])
        complete[o] = done
    out = zero
    for c in complete:
        out = np.maximum(out, c)
    return out


# ----------------------------------------------------------------------------- the model
class CostModel:
    """Predicts arm latencies from the topology (see the module docstring).

    Args:
        params: the calibrated constants (default: the physical ones, no overheads).
    """

    def __init__(self, params: CostParams | None = None):
        self.params = params or CostParams()

    def predict(self, arm: Arm, topo: Topology, nbytes: int | Sequence[int] | np.ndarray) -> np.ndarray:
        """Predicted seconds of ``arm`` on ``topo`` for message size(s) ``nbytes`` (one per size).

        Raises:
            TuneError: negative sizes, or a schedule that does not fit ``topo``.
        """
        sizes = np.atleast_1d(np.asarray(nbytes, dtype=np.float64))
        if (sizes < 0).any() or not np.isfinite(sizes).all():
            raise TuneError(f"message sizes must be finite and >= 0, got {nbytes!r}")
        p = self.params
        return self._predict_grid(arm, topo, sizes, [p])[0]

    def predict_context(self, context: Context, arms: Iterable[Arm], topo: Topology) -> dict[str, float]:
        """``{arm name: predicted seconds}`` for one context, in the arms' order."""
        ctx = Context.coerce(context)
        out = {}
        for arm in arms:
            if arm.collective != ctx.collective:
                raise TuneError(f"arm {arm.name!r} runs {arm.collective}, the context is {ctx.collective}")
            if arm.num_ranks != ctx.num_ranks:
                raise TuneError(f"arm {arm.name!r} has {arm.num_ranks} ranks, the context {ctx.num_ranks}")
            out[arm.name] = float(self.predict(arm, topo, ctx.nbytes)[0])
        return out

    def _predict_grid(self, arm: Arm, topo: Topology, sizes: np.ndarray, grid: Sequence[CostParams]) -> np.ndarray:
        """Predictions for every parameter set of ``grid``: shape ``(len(grid), len(sizes))``."""
        ls = np.asarray([g.latency_scale for g in grid])[:, None]
        ho = np.asarray([g.hop_overhead_s for g in grid])[:, None]
        eff = np.asarray([g.bw_efficiency for g in grid])[:, None]
        base = np.asarray([g.base_s for g in grid])[:, None]
        pieces = {g.piece_bytes for g in grid}
        if len(pieces) != 1:
            raise TuneError("a calibration grid must use one piece_bytes")
        piece = pieces.pop()
        total = np.zeros((len(grid), sizes.size))
        for part in arm.parts:
            st = _structure(part)
            lat, cap, per_cap = _routes(st, topo)
            probe = Context(arm.collective, part.num_ranks, 1)
            chunk = (sizes * probe.part_bytes(part.collective) / st.in_chunks)[None, :]
            cp = _critical_path(st, lat, cap, chunk, ls, ho, eff, piece) if st.order else np.zeros_like(total)
            lb = chunk * (float(per_cap.max()) if per_cap.size else 0.0) / eff
            total = total + base + np.maximum(cp, lb)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"params": self.params.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        if not isinstance(data, Mapping) or "params" not in data:
            raise TuneError("cost-model JSON must be an object with 'params'")
        return cls(CostParams.from_dict(data["params"]))


def margin(predictions: Mapping[str, float | None] | Sequence[float | None]) -> float:
    """The runner-up margin ``m = mu(2) / mu(1) - 1`` of the two best defined predictions (NCCL-BOT Sec. 3).

    ``inf`` when fewer than two predictions are defined.

    >>> margin({"ring": 3.0, "tree": 2.0, "direct": None})
    0.5
    """
    values = predictions.values() if isinstance(predictions, Mapping) else predictions
    defined = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if any(v <= 0 for v in defined):
        raise TuneError(f"predicted times must be positive, got {defined}")
    if len(defined) < 2:
        return math.inf
    return defined[1] / defined[0] - 1.0


def calibrate(
    samples: Iterable[tuple[Arm, Topology, Sequence[int], Sequence[float]]],
    *,
    grid: Mapping[str, Sequence[float]] | None = None,
) -> tuple[CostModel, dict[str, Any]]:
    """Fits the model's constants by grid search: least squares in ``log(predicted / measured)``.

    Args:
        samples: ``(arm, topology, sizes, measured seconds per size)``; pass only
            contexts the model may learn from (jaxccl calibrates on the healthy
            4- and 8-host rails, never on a pool it is scored on).
        grid: values to try per parameter (default :data:`DEFAULT_GRID`).

    Returns:
        ``(model, report)``; the report holds the grid, the chosen point, its RMS
        log error and the error of the uncalibrated physical constants.
    """
    spec = dict(DEFAULT_GRID if grid is None else grid)
    unknown = sorted(set(spec) - {"latency_scale", "hop_overhead_s", "bw_efficiency", "base_s"})
    if unknown:
        raise TuneError(f"unknown calibration parameter(s) {unknown}")
    names = ["latency_scale", "hop_overhead_s", "bw_efficiency", "base_s"]
    values = [tuple(spec.get(k, (getattr(CostParams(), k),))) for k in names]
    points = [CostParams(*combo) for combo in itertools.product(*values)]
    model = CostModel()
    sq = np.zeros(len(points))
    count = 0
    for arm, topo, sizes, measured in samples:
        sizes_a = np.asarray(sizes, dtype=np.float64)
        meas = np.asarray(measured, dtype=np.float64)
        if sizes_a.shape != meas.shape or (meas <= 0).any():
            raise TuneError(f"calibration sample for {arm.name!r}: sizes and positive times must match")
        pred = model._predict_grid(arm, topo, sizes_a, points)  # noqa: SLF001
        sq += (np.log(pred / meas[None, :]) ** 2).sum(axis=1)
        count += sizes_a.size
    if not count:
        raise TuneError("calibrate() needs at least one sample")
    best = int(np.argmin(sq))
    physical = CostParams()
    phys_idx = next((i for i, p in enumerate(points) if p == physical), None)
    report = {
        "grid": {k: list(v) for k, v in zip(names, values)},
        "params": points[best].to_dict(),
        "rms_log_error": float(np.sqrt(sq[best] / count)),
        "rms_log_error_physical": None if phys_idx is None else float(np.sqrt(sq[phys_idx] / count)),
        "samples": count,
    }
    return CostModel(points[best]), report
