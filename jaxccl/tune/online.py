"""Online schedule selection on a live communicator (NCCL-BOT Sec. 4 inside a running job).

An :class:`OnlineTuner` keeps one bandit context per (collective, size bucket)
of a communicator. Before a step, :meth:`OnlineTuner.prepare` asks the
:class:`~jaxccl.tune.Selector` which arm (schedule) each context runs and
stages it (a hot-swap at the next call: nothing recompiles on the native
backends); after the step, :meth:`OnlineTuner.record` feeds back the time the
executor measured for that context's launch
(:func:`jaxccl.runtime.native.last_launch_seconds`: from the launch's start,
once every rank's call has arrived, to its last rank's end, so the slowest rank
of the launch, host dispatch not counted; per registry slot, so per size
bucket) as NCCL-BOT's reward ``mu_min / t`` (Eq. 1). Where the communicator's
axis is part of a larger mesh, the groups along the other axes launch the same
slot and the launch that finished last is the one read; a context called
several times per step is read at its last call.

**Several sizes in one program.** On a communicator built with
``size_buckets=True`` every size bucket (powers of two,
:func:`jaxccl.runtime.communicator.size_bucket`) has its own registry slot, so
the contexts of one collective at several sizes in one compiled program each
run their own arm (``comm.install(collective, schedule, nbytes=...)``). Without
size buckets one slot serves each collective: run one context per collective
per step.

**Arms.** Without a ``selector``, the tuner offers jaxccl's catalogue
(:func:`jaxccl.tune.arm_catalog` on the communicator's topology: rings, NCCL's
rail rings, recursive doubling, the synthesized tree packing, direct), the
single-schedule arms only, with the cost model's predictions on the fabric the
tuner believes (:attr:`OnlineTuner.topology`) as the prior. Where a context
asks for exact reductions (``exact_reductions=True``, the default: float
ReduceScatter and AllReduce stay bitwise equal to ``jax.lax``), only arms whose
schedule sums in ascending rank order (``info["ordered_reduction"]``, proved by
the interpreter when installed) are offered.

**With the closed loop.** :meth:`OnlineTuner.follow` subscribes to a
:class:`jaxccl.control.Controller`: after it stages a re-synthesized schedule
(which, installed without a size, every bucket runs from the next call), the
tuner's next :meth:`prepare` makes that schedule the collective's synthesized
arm (it replaces ``"tree"``, or is added as ``"resynth"`` where ``"tree"`` is not
eligible), takes the controller's measured (degraded) topology for its cost
model and restarts that collective's contexts from the new prior. A launch
that ran another table than the one the tuner staged (a swap came between) is
not learned from.

Example:
    >>> tuner = OnlineTuner(comm, policy="ucb1")                      # doctest: +SKIP
    >>> tuner.follow(controller)                                      # doctest: +SKIP
    >>> for step in range(100):                                       # doctest: +SKIP
    ...     arms = tuner.prepare_all([("all_gather", 1 << 20), ("all_gather", 4 << 20)])
    ...     out = train_step(...)                                     # calls jaxccl.all_gather at both sizes
    ...     jax.block_until_ready(out)
    ...     tuner.record_all()
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxccl.schedule.ir import Schedule
from jaxccl.tune.arms import Arm, Context, TuneError, arm_catalog, exact_arm
from jaxccl.tune.bandits.selector import RHO_MAX, Selector
from jaxccl.tune.cost_model import CostModel

__all__ = ["REDUCTIONS", "OnlineTuner"]

#: The collectives whose float results depend on the order of the sums.
REDUCTIONS = ("reduce_scatter", "all_reduce")
_ALIASES = {"psum_scatter": "reduce_scatter", "psum": "all_reduce"}


def _exact_extras(collective: str, topo: Any, taken: set[str]) -> list[Arm]:
    """Rank-ordered arms beside the catalogue's: the ordered ReduceScatter synthesized for ``topo`` (what the
    closed loop re-synthesizes) and the direct rank-ordered AllReduce (a communicator's default)."""
    # Imported here: the synthesizers pull in scipy/HiGHS, which the selector alone does not need.
    from jaxccl.runtime.default_schedules import direct_allreduce
    from jaxccl.synth.ordered_reduce_scatter import ordered_reduce_scatter

    if collective == "reduce_scatter" and "ordered" not in taken:
        return [Arm("ordered", collective, (ordered_reduce_scatter(topo),))]
    if collective == "all_reduce" and "direct" not in taken:
        return [Arm("direct", collective, (direct_allreduce(topo.num_gpus),))]
    return []


def _collective(name: Any) -> str:
    if not isinstance(name, str):
        raise TuneError(f"collective must be a string, got {name!r}")
    return _ALIASES.get(name, name)


def _nbytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TuneError(f"nbytes must be a positive integer, got {value!r}")
    return value


class OnlineTuner:
    """Drives a :class:`~jaxccl.tune.Selector` from a native-backend :class:`~jaxccl.Communicator`.

    Args:
        comm: the communicator whose schedules are chosen (``cpu`` or ``cuda`` backend; ``size_buckets=True``
            for several sizes of a collective in one program).
        selector: a selector with an arm catalogue (``Selector.for_topology``); default: the tuner builds its
            own over jaxccl's catalogue on ``comm.topology`` (needed for :meth:`follow`'s new arms).
        policy: the bandit policy of the tuner's own selector (default NCCL-BOT's UCB1 champion; ``"auto"``:
            the cost model's choice, never learning).
        model: the :class:`~jaxccl.tune.CostModel` of the prior (default: the physical constants).
        rho_max, seed: as for :class:`~jaxccl.tune.Selector`.
        prediction_scale: executor seconds per second the cost model predicts, so that the prior and the
            rewards are on one scale (NCCL-BOT's warm start needs ``mu_hat`` in the reward's units); default
            ``1 / time_scale`` on an emulated fabric (``LinkEmulation(time_scale=...)`` slows every link by
            that factor), else 1.
        exact_reductions: offer only rank-ordered arms for ReduceScatter and AllReduce contexts (and refuse
            another arm from a given ``selector``).

    Raises:
        TuneError: a non-native communicator, no topology without a selector, or a bad argument.
    """

    def __init__(
        self,
        comm: Any,
        selector: Selector | None = None,
        *,
        policy: str | Mapping[str, Any] | None = None,
        model: CostModel | None = None,
        rho_max: float = RHO_MAX,
        seed: int = 0,
        prediction_scale: float | None = None,
        exact_reductions: bool = True,
    ):
        if getattr(comm, "backend", None) not in ("cpu", "cuda"):
            raise TuneError(f"OnlineTuner needs a native backend (cpu, cuda), not {getattr(comm, 'backend', comm)!r}")
        if not isinstance(exact_reductions, bool):
            raise TuneError(f"exact_reductions must be True or False, got {exact_reductions!r}")
        self.comm = comm
        self.exact_reductions = exact_reductions
        self.model = model if model is not None else CostModel()
        if prediction_scale is None:
            network = getattr(comm, "network", None)
            prediction_scale = 1.0 / network.config.time_scale if network is not None else 1.0
        if isinstance(prediction_scale, bool) or not isinstance(prediction_scale, (int, float)):
            raise TuneError(f"prediction_scale must be a positive number, got {prediction_scale!r}")
        if not 0 < prediction_scale < float("inf"):
            raise TuneError(f"prediction_scale must be a positive number, got {prediction_scale!r}")
        self.prediction_scale = float(prediction_scale)
        #: The fabric the cost model predicts on: the communicator's, then the controller's measured one.
        self.topology = comm.topology
        self._own = selector is None
        self._arms: dict[str, list[Arm]] = {}
        if selector is None:
            if comm.topology is None:
                raise TuneError("OnlineTuner: the communicator has no topology to build the arm catalogue for")
            selector = Selector(
                self._arm_names, self._predict, policy=policy, rho_max=rho_max, seed=seed, catalog=self._catalog
            )
        elif policy is not None:
            raise TuneError("OnlineTuner: pass policy= only without a selector (the selector has its own)")
        self.selector = selector
        self._buckets = bool(getattr(comm, "_size_buckets", False))
        self._contexts: dict[tuple[str, int], Context] = {}  # (collective, bucket) -> its context
        self._prepared: dict[tuple[str, int], tuple[str, int]] = {}  # -> (arm, table version it should run)
        self._pending: list[tuple[str, Schedule, Any]] = []  # re-syntheses not applied yet
        self._lock = threading.Lock()
        #: ``(context key, arm, latency in seconds or None)`` per recorded launch (``None``: not learned).
        self.history: list[tuple[str, str, float | None]] = []
        #: Exceptions a step-end callback caught (:meth:`record_error`).
        self.errors: list[str] = []
        #: ``(collective, schedule name)`` of every re-synthesis applied.
        self.resyntheses: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ arms
    def _catalog(self, ctx: Context) -> list[Arm]:
        arms = self._arms.get(ctx.collective)
        if arms is None:
            arms = [a for a in arm_catalog(ctx.collective, self.comm.topology) if len(a.parts) == 1]
            arms += _exact_extras(ctx.collective, self.comm.topology, {a.name for a in arms})
            if self.exact_reductions and ctx.collective in REDUCTIONS:
                arms = [a for a in arms if exact_arm(a)]
            if not arms:
                raise TuneError(f"OnlineTuner: no eligible arm for {ctx.collective}")
            self._arms[ctx.collective] = arms
        if ctx.num_ranks != self.comm.axis_size:
            raise TuneError(f"context {ctx.key} has {ctx.num_ranks} ranks; the communicator {self.comm.axis_size}")
        return arms

    def _arm_names(self, ctx: Context) -> list[str]:
        return [a.name for a in self._catalog(ctx)]

    def _predict(self, ctx: Context) -> dict[str, float]:
        predicted = self.model.predict_context(ctx, self._catalog(ctx), self.topology)
        return {a: t * self.prediction_scale for a, t in predicted.items()}

    def arms(self, collective: str) -> list[str]:
        """The arm names offered now for ``collective``'s contexts."""
        coll = _collective(collective)
        return self._arm_names(Context(coll, self.comm.axis_size, 1))

    # ------------------------------------------------------------------ the closed loop
    def follow(self, controller: Any) -> OnlineTuner:
        """Subscribes to ``controller``'s re-syntheses (see :meth:`on_resynthesis`); returns the tuner."""
        if not self._own:
            raise TuneError("OnlineTuner.follow needs the tuner's own selector (built without selector=)")
        controller.add_resynthesis_hook(self.on_resynthesis)
        return self

    def on_resynthesis(self, collective: str, schedule: Schedule, topology: Any) -> None:
        """Queues a re-synthesized ``schedule`` of ``collective`` for the fabric ``topology``; the next
        :meth:`prepare` makes it the collective's synthesized arm and restarts its contexts from the prior on
        ``topology``. Thread-safe (the controller calls it from its thread or a step-end callback)."""
        if not isinstance(schedule, Schedule):
            raise TuneError(f"on_resynthesis: expected a Schedule, got {type(schedule).__name__}")
        with self._lock:
            self._pending.append((_collective(collective), schedule, topology))

    def _apply_resyntheses(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for coll, schedule, topology in pending:
            if topology is not None:
                self.topology = topology
            if self._own and coll in ("all_gather", "reduce_scatter", "all_reduce"):
                arms = self._catalog(Context(coll, self.comm.axis_size, 1))
                names = [a.name for a in arms]
                new = Arm("tree", coll, (schedule,))
                if not (self.exact_reductions and coll in REDUCTIONS and not exact_arm(new)):
                    name = "tree" if "tree" in names else "resynth"
                    new = Arm(name, coll, (schedule,))
                    self._arms[coll] = [new if a.name == name else a for a in arms] + [new] * (name not in names)
            self.resyntheses.append((coll, schedule.name or schedule.digest[:12]))
            for key, ctx in self._contexts.items():  # the collective's contexts restart from the new prior
                if key[0] == coll:
                    self.selector.reset(ctx)
                    self._prepared.pop(key, None)

    # ------------------------------------------------------------------ a step
    def _key(self, collective: str, nbytes: int) -> tuple[tuple[str, int], Context]:
        coll = _collective(collective)
        nb = _nbytes(nbytes)
        if coll not in ("all_gather", "reduce_scatter", "all_reduce"):
            raise TuneError(f"OnlineTuner: no arms for {coll!r}; it tunes all_gather, reduce_scatter, all_reduce")
        from jaxccl.runtime.communicator import size_bucket  # imports JAX (the runtime layer)

        bucket = size_bucket(nb) if self._buckets else 0
        key = (coll, bucket)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = Context(coll, self.comm.axis_size, nb)
            self._contexts[key] = ctx
        return key, ctx

    def _sized(self, key: tuple[str, int]) -> int | None:
        return key[1] if self._buckets else None

    def prepare(self, collective: str, nbytes: int) -> str:
        """Chooses the arm for ``(collective, nbytes)``'s context and stages its schedule (for the size's bucket
        on a communicator with size buckets); returns the arm's name.

        Raises:
            TuneError: a bad collective or size, an arm made of several schedules, or (``exact_reductions``) an
                arm of a given selector that does not sum in rank order.
        """
        self._apply_resyntheses()
        key, ctx = self._key(collective, nbytes)
        arm = self.selector.choose(ctx)
        parts = self.selector.schedules(ctx, arm)
        if len(parts) != 1 or parts[0].collective.value != ctx.collective:
            raise TuneError(
                f"arm {arm!r} of {ctx.key} has parts {[p.collective.value for p in parts]}; online selection "
                "supports single-schedule arms only"
            )
        schedule = parts[0]
        if self.exact_reductions and ctx.collective in REDUCTIONS and not exact_arm(Arm(arm, ctx.collective, parts)):
            raise TuneError(
                f"arm {arm!r} of {ctx.key} does not sum in rank order (info['ordered_reduction']); with "
                "exact_reductions only rank-ordered arms may run"
            )
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        sized = self._sized(key)
        running = self.comm.schedule(ctx.collective, nbytes=sized)
        if running is None or running.digest != schedule.digest:
            self.comm.install(ctx.collective, schedule, nbytes=sized)
        st = native.swap_state(self.comm.slot(ctx.collective, sized))
        self._prepared[key] = (arm, st["staged_version"] or st["current_version"])
        return arm

    def record(self, collective: str, nbytes: int, arm: str | None = None, latency_s: float | None = None) -> bool:
        """Feeds back the latency of the context's launch that just ran (default: the executor's launch time).

        Returns whether the selector learned from it: not below its size gate, nor when the launch ran another
        table than :meth:`prepare` staged (a swap of the closed loop came between).

        Raises:
            TuneError: a bad collective, size or latency, or ``arm`` unknown to the context.
        """
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)

        key, ctx = self._key(collective, nbytes)
        prepared = self._prepared.pop(key, None)
        if arm is None:
            if prepared is None:
                raise TuneError(f"record({ctx.key}): no arm given and none prepared")
            arm = prepared[0]
        if not self.selector.wants_timing(ctx):
            self.history.append((ctx.key, arm, None))
            return False
        slot = self.comm.slot(ctx.collective, self._sized(key))
        if latency_s is None:
            if prepared is not None and prepared[0] == arm and native.last_launch_version(slot) != prepared[1]:
                self.history.append((ctx.key, arm, None))  # it ran another table: not this arm's sample
                return False
            latency_s = native.last_launch_seconds(slot)
        used = bool(self.selector.observe(ctx, arm, latency_s))
        self.history.append((ctx.key, arm, float(latency_s)))
        return used

    def prepare_all(self, contexts: Iterable[Sequence[Any]]) -> dict[str, str]:
        """:meth:`prepare` for every ``(collective, nbytes)``; returns ``{context key: arm}``."""
        out = {}
        for coll, nb in contexts:
            out[self._key(coll, nb)[1].key] = self.prepare(coll, nb)
        return out

    def record_all(self) -> int:
        """:meth:`record` (executor latencies) for every prepared context; returns how many were learned."""
        learned = 0
        for key in list(self._prepared):
            learned += self.record(key[0], self._contexts[key].nbytes)
        return learned

    def step(self, contexts: Iterable[Sequence[Any]] | None = None) -> None:
        """One step end: :meth:`record_all`, then :meth:`prepare_all` for the contexts known (or ``contexts``),
        so that :func:`jaxccl.control.step_driven.at_step_end` can drive the tuner from a jitted step."""
        self.record_all()
        wanted = list(contexts) if contexts is not None else [(k[0], c.nbytes) for k, c in self._contexts.items()]
        self.prepare_all(wanted)

    def record_error(self, exc: BaseException) -> None:
        """Keeps ``exc`` in :attr:`errors` (what a step-end callback does with the tuner's exceptions)."""
        self.errors.append(f"{type(exc).__name__}: {exc}")

    @property
    def contexts(self) -> list[Context]:
        """The contexts prepared so far, one per (collective, size bucket)."""
        return list(self._contexts.values())
