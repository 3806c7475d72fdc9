"""The demo's AllGather job for the controller's benchmarks: 8 emulated devices, rail 2 x 4, one call per step.

The parameters of ``jaxccl demo``'s MLP (one flat float32 vector, sharded over the 8 devices) are
all-gathered through jaxccl on the emulated fabric each step, as the demo does before its training
step; the training step itself is left out (it does not touch the measured links). ``stall_s``
makes one rank late for the collective: an unordered host callback on the victim's device sleeps
before the AllGather (the injected jitter of a rank that is slow to arrive).

Example::

    job = EmulatedJob.start(time_scale=1e-4)
    job.step()                                       # one AllGather; returns its seconds
    job.step(stall=(3, 0.004))                       # rank 3 arrives 4 ms late
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jaxccl
from jaxccl.demos.closed_loop import NUM_DEVICES, SIZES
from jaxccl.runtime.emulated import LinkEmulation
from jaxccl.topology import rail

PARAMS = sum(a * b for a, b in zip(SIZES, SIZES[1:]))  # the weights of the demo's MLP


@dataclasses.dataclass
class EmulatedJob:
    """A communicator on the emulated rail 2 x 4 with the healthy AllGather installed, and its jitted call."""

    comm: Any
    topology: Any
    healthy: Any  # the schedule synthesized for the healthy fabric
    gather: Any
    shard: Any
    out_bytes: int
    time_scale: float
    _stall: list[tuple[int, float]] = dataclasses.field(default_factory=lambda: [(-1, 0.0)])

    @classmethod
    def start(cls, *, time_scale: float = 1e-4, timestamps: str = "link", window_noise: float = 0.0) -> EmulatedJob:
        jaxccl.emulate(NUM_DEVICES)
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.experimental import io_callback
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("data",))
        topo = rail(hosts=2, gpus_per_host=4)
        comm = jaxccl.Communicator(
            mesh,
            "data",
            topology=topo,
            backend="cpu",
            link_emulation=LinkEmulation(time_scale=time_scale, timestamps=timestamps, window_noise=window_noise),
        )
        healthy = jaxccl.synth.all_gather(topo)
        comm.install("all_gather", healthy)
        stall: list[tuple[int, float]] = [(-1, 0.0)]

        def late(rank: Any) -> Any:
            victim, seconds = stall[0]
            if int(rank) == victim:
                time.sleep(seconds)
            return np.int32(0)

        def body(shard: Any) -> Any:
            token = io_callback(late, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index("data"), ordered=False)
            return jaxccl.all_gather(shard + token.astype(shard.dtype), "data", axis=0, tiled=True)

        gather = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        n = -(-PARAMS // NUM_DEVICES) * NUM_DEVICES
        values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
        shard = jax.device_put(values, NamedSharding(mesh, P("data")))
        job = cls(comm, topo, healthy, gather, shard, n * 4, time_scale, stall)
        with comm:
            gather(shard).block_until_ready()  # compile outside every timeline
        comm.telemetry()
        return job

    def step(self, *, stall: tuple[int, float] | None = None) -> float:
        """One AllGather (with ``stall = (rank, seconds)``, that rank arrives late); returns its seconds."""
        self._stall[0] = stall or (-1, 0.0)
        t0 = time.perf_counter()
        with self.comm:
            self.gather(self.shard).block_until_ready()
        return time.perf_counter() - t0

    def algbw(self, seconds: float) -> float:
        """Emulated bytes/s of one step that took ``seconds``."""
        return self.out_bytes / seconds / self.time_scale

    def version(self) -> int:
        from jaxccl.runtime import native

        return int(native.last_launch_version(self.comm.slot("all_gather")))
