"""A gray-failure drill on real links: a NIC cut live, detected, routed around and hot-swapped across processes.

:func:`run_drill` builds a :mod:`jaxccl.labs.rail` lab (one process per rank,
each with its own shaped NIC), starts a JAX job in it and, for each cycle: runs AllGather steps
with the :class:`~jaxccl.control.process_loop.ProcessLoop`, cuts one rank's NIC live with
``tc`` between two steps, keeps stepping until the re-synthesized schedule is current in every
process, then measures the stale and the recovered schedule on the cut network, interleaved
(each staged everywhere in turn at an agreed call), and restores the NIC. Every AllGather
result is compared bitwise with ``jax.lax.all_gather``'s of the same input.

Process 0 reports what happened as one JSON line (``RESULT {...}``); :func:`run_drill` returns
it with the harness's times of each cut, which share the clock of the events
(``time.monotonic_ns``). Used by ``tests/distributed/test_multiprocess_loop.py`` and
``benchmarks/multiprocess/reaction.py``.

Worker: ``python -m jaxccl.labs.drill '<config json>' <signal folder>`` (started by
:func:`run_drill`).

>>> DrillConfig().num_ranks
4
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxccl import synth
from jaxccl.control.process_loop import ProcessLoop
from jaxccl.distributed.launch import initialize_from_env
from jaxccl.distributed.transport import ProcessTransport, attach, local_shards, stage_agreed
from jaxccl.errors import ArgumentError, DeadlineError, NetlabError
from jaxccl.labs.netlab import LinkShape
from jaxccl.labs.rail import RailLab, rank_rail, transport_options_from_env

RESULT_PREFIX = "RESULT "


@dataclasses.dataclass(frozen=True)
class DrillConfig:
    """What a drill runs.

    Attributes:
        hosts: emulated hosts (network namespaces).
        gpus_per_host: ranks per host (one process each).
        rate_mbit: every NIC's rate while healthy.
        cut_factor: the cut NIC carries ``rate_mbit / cut_factor``.
        victim: the rank whose NIC is cut (never 0: process 0 holds the job's coordinator).
        shard_bytes: AllGather input per rank (float32).
        healthy_steps: steps before the cut (the change detector learns every link's noise from the first 5).
        max_steps: steps after the cut before giving up on a swap.
        reps: interleaved stale/recovered rounds measured on the cut network.
        calls_per_rep: timed AllGathers per schedule and round.
        cycles: cut, recover, measure, restore; this many times.
        timeout_s: deadline of every wait on another process inside the loop.
        gamma: Algorithm 1's threshold.
        confirm: flagged samples before a re-synthesis.
        alpha: EWMA smoothing factor.
    """

    hosts: int = 2
    gpus_per_host: int = 2
    rate_mbit: float = 100.0
    cut_factor: float = 5.0
    victim: int = 1
    shard_bytes: int = 1 << 20
    healthy_steps: int = 7
    max_steps: int = 30
    reps: int = 3
    calls_per_rep: int = 2
    cycles: int = 1
    timeout_s: float = 60.0
    gamma: float = 0.15
    confirm: int = 2
    alpha: float = 0.5

    @property
    def num_ranks(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def shape(self) -> LinkShape:
        return LinkShape(rate_mbit=self.rate_mbit)

    @property
    def cut_shape(self) -> LinkShape:
        return LinkShape(rate_mbit=self.rate_mbit / self.cut_factor)


# ---------------------------------------------------------------------- the harness


def _signal(folder: Path, name: str, text: str = "") -> None:
    tmp = folder / f".{name}"
    tmp.write_text(text)
    tmp.rename(folder / name)  # atomic: the worker never reads half a file


def _wait_signal(folder: Path, name: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    path = folder / name
    while not path.exists():
        if time.monotonic() > deadline:
            raise DeadlineError(f"drill: the harness did not signal {name!r} within {timeout_s} s")
        time.sleep(0.005)
    return path.read_text()


def run_drill(config: DrillConfig, *, timeout_s: float = 300.0, log_dir: Path | None = None) -> dict[str, Any]:
    """Runs a drill in a fresh lab (removed afterwards, also on failure) and returns process 0's report.

    The report holds, per cycle, the loop's events, the cut's time (``cut_ns``), the healthy,
    stale and recovered AllGather times, and ``bitwise_ok`` (every process's results equal to
    ``jax.lax``). ``outputs`` holds every process's output; with ``log_dir``, each is also
    written whole to ``log_dir/process-<i>.log`` (also when the drill fails).

    Raises:
        NetlabError: namespaces are not available here, or a process failed or reported nothing.
        ArgumentError: ``config.victim`` is not a rank other than 0.
    """
    if not 1 <= config.victim < config.num_ranks:
        raise ArgumentError(f"drill: victim must be a rank in 1..{config.num_ranks - 1}, got {config.victim}")
    cut_ns: list[int] = []
    lab = RailLab(config.hosts, config.gpus_per_host, config.shape)
    with tempfile.TemporaryDirectory(prefix="jaxccl-drill-") as tmp, lab:
        folder = Path(tmp)

        def cut_and_restore(procs: list[subprocess.Popen]) -> None:
            for line in procs[0].stdout:
                seen.append(line)
                if line.startswith("CUT "):
                    lab.shape(config.victim, config.cut_shape)
                    cut_ns.append(time.monotonic_ns())
                    _signal(folder, f"cut-{line.split()[1]}", str(cut_ns[-1]))
                elif line.startswith("RESTORE "):
                    lab.shape(config.victim, config.shape)
                    _signal(folder, f"restored-{line.split()[1]}")
                elif line.startswith(RESULT_PREFIX):
                    report.update(json.loads(line[len(RESULT_PREFIX) :]))

        report: dict[str, Any] = {}
        seen: list[str] = []  # process 0's output, read here as it comes
        argv = [sys.executable, "-m", "jaxccl.labs.drill", json.dumps(dataclasses.asdict(config)), tmp]
        results = lab.launch(argv, timeout_s=timeout_s, during=cut_and_restore)
    outputs = ["".join(seen) + results[0].output] + [r.output for r in results[1:]]
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        for i, out in enumerate(outputs):
            (Path(log_dir) / f"process-{i}.log").write_text(out)
    if any(r.returncode != 0 for r in results) or not report:
        tails = "\n----\n".join(
            f"process {r.process_id} (rc {r.returncode}):\n{out[-3000:]}" for r, out in zip(results, outputs)
        )
        raise NetlabError(f"drill failed:\n{tails}")
    for cycle, ns in zip(report["cycles"], cut_ns):
        cycle["cut_ns"] = ns
    report["outputs"] = outputs
    report["lab_prefix"] = lab.lab.prefix
    report["bitwise_ok"] = all("BITWISE ok" in out for out in outputs)
    return report


# ---------------------------------------------------------------------- one process of the job


class _Worker:
    def __init__(self, config: DrillConfig, folder: Path):
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxccl.runtime import native  # the native module, loaded on demand
        from jaxccl.runtime.collectives import all_gather  # imports JAX
        from jaxccl.runtime.communicator import Communicator  # imports JAX

        self.config, self.folder = config, folder
        self.me = jax.process_index()
        self.transport = ProcessTransport.bootstrap(timeout_s=config.timeout_s, options=transport_options_from_env())
        n = jax.device_count()
        mesh = Mesh(np.array(jax.devices()), ("d",))
        attach(self.transport, mesh, "d")
        self.topology = rank_rail(config.hosts, config.gpus_per_host, config.shape)
        self.comm = Communicator(mesh, "d", topology=self.topology, backend="cpu")
        self.healthy = synth.all_gather(self.topology)
        self.comm.install("all_gather", self.healthy)
        self.slot = self.comm.slot("all_gather")
        self.native = native

        def gathered(collective):
            body = lambda v: collective(v, "d", axis=0, tiled=True)  # noqa: E731
            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

        self.ours = gathered(all_gather)
        rows = config.shard_bytes // (4 * 256)
        sharding = NamedSharding(mesh, P("d"))
        self.inputs = []
        for seed in (11, 12):  # the same global data in every process, never all zero
            raw = np.random.default_rng(seed).standard_normal((n * rows, 256)).astype(np.float32)
            self.inputs.append(jax.make_array_from_callback(raw.shape, sharding, lambda idx, raw=raw: raw[idx]))
        reference = gathered(jax.lax.all_gather)
        self.expected = [self._shards(reference(x)) for x in self.inputs]
        self.mismatches = 0
        self.calls = 0

    @staticmethod
    def _shards(y: Any) -> list[bytes]:
        return [s.tobytes() for s in local_shards(y)]

    def call(self) -> float:
        """One checked AllGather; its time in seconds."""
        x = self.calls % len(self.inputs)
        t0 = time.perf_counter()
        try:
            with self.comm:
                y = self.ours(self.inputs[x])
                y.block_until_ready()
        except Exception:
            print(f"FAILED call {self.calls}, registry {self.native.swap_state(self.slot)}", flush=True)
            raise
        seconds = time.perf_counter() - t0
        self.mismatches += self._shards(y) != self.expected[x]
        self.calls += 1
        return seconds

    def algbw(self, seconds: float) -> float:
        return self.config.num_ranks * self.config.shard_bytes / seconds

    def stage(self, schedule: Any, round_id: str) -> None:
        stage_agreed(self.comm, "all_gather", schedule, round_id=round_id, margin=0, timeout_s=self.config.timeout_s)

    def cycle(self, c: int) -> dict[str, Any]:
        cfg = self.config
        loop = ProcessLoop(
            self.comm,
            margin=0,
            timeout_s=cfg.timeout_s,
            alpha=cfg.alpha,
            key_prefix=f"jaxccl/drill/{c}",
            gamma=cfg.gamma,
            confirm=cfg.confirm,
        )
        healthy, loop_ms = [], []

        def loop_step() -> None:
            t0 = time.perf_counter()
            loop.step()
            loop_ms.append((time.perf_counter() - t0) * 1e3)

        for _ in range(cfg.healthy_steps):
            healthy.append(self.call())
            loop_step()
        if self.me == 0:
            print(f"CUT {c}", flush=True)
            _wait_signal(self.folder, f"cut-{c}", cfg.timeout_s)
        version = self.native.swap_state(self.slot)["current_version"]
        after_cut, swapped_at = [], None
        for k in range(cfg.max_steps):
            after_cut.append(self.call())
            loop_step()
            if swapped_at is None and self.native.swap_state(self.slot)["current_version"] != version:
                swapped_at = k  # the same call in every process: the swap point is agreed
            if swapped_at is not None and k >= swapped_at + 2:  # the controller records the activation
                break
        recovered = self.comm.schedule("all_gather")
        timed: dict[str, list[float]] = {"stale": [], "recovered": []}
        if swapped_at is not None:
            for rep in range(cfg.reps):
                for name, schedule in (("stale", self.healthy), ("recovered", recovered)):
                    self.stage(schedule, f"drill/{c}/{rep}/{name}")
                    self.call()  # the agreed transition call
                    timed[name] += [self.call() for _ in range(cfg.calls_per_rep)]
        if self.me == 0:
            print(f"RESTORE {c}", flush=True)
            _wait_signal(self.folder, f"restored-{c}", cfg.timeout_s)
        self.stage(self.healthy, f"drill/{c}/restore")
        self.call()
        return {
            "events": [e.to_dict() for e in loop.events],
            "swapped_after_steps": swapped_at,
            "recovered_schedule": recovered.name,
            "healthy_s": healthy,
            "after_cut_s": after_cut,
            "stale_s": timed["stale"],
            "recovered_s": timed["recovered"],
            "loop_errors": len(loop.errors),
            "loop_step_ms": loop_ms,
        }

    def run(self) -> bool:
        cycles = [self.cycle(c) for c in range(self.config.cycles)]
        ok = self.mismatches == 0
        print(f"BITWISE {'ok' if ok else 'MISMATCH'} {self.calls} calls, {self.mismatches} mismatches", flush=True)
        if self.me == 0:
            for c in cycles:
                for key in ("healthy", "stale", "recovered"):
                    times = c[f"{key}_s"]
                    c[f"algbw_{key}"] = self.algbw(statistics.median(times)) if times else None
            print(RESULT_PREFIX + json.dumps({"config": dataclasses.asdict(self.config), "cycles": cycles}), flush=True)
        self.comm.close()
        self.transport.close()
        return ok


def main(argv: list[str]) -> int:
    config = DrillConfig(**json.loads(argv[0]))
    initialize_from_env(local_devices=1, timeout_s=config.timeout_s)
    ok = _Worker(config, Path(argv[1])).run()
    import jax

    jax.distributed.shutdown()  # a barrier: the coordinator (process 0) leaves last
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
