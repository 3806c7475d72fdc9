"""Train a small MLP with FSDP-style sharded weights on 8 emulated devices, with jaxccl and with jax.lax.

Every weight matrix is sharded along its first axis over mesh axis ``data``;
the batch is sharded over the same axis. The forward pass all-gathers each
weight just before it is used (``jaxccl.all_gather``); autodiff turns those
gathers into ``psum_scatter``s of the gradients in the backward pass (the
transpose rule), so every device updates only its own weight shard. The same
model runs a second time with ``jax.lax`` collectives; the losses and the final
weights must be bitwise equal. Exits 1 if they are not.

Usage:
    python examples/train_small.py [--steps 8] [--backend auto|cpu|ppermute]
"""

from __future__ import annotations

import argparse
import sys
import time

import jaxccl

NUM_DEVICES = 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "ppermute"])
    ap.add_argument("--lr", type=float, default=0.5)
    args = ap.parse_args(argv)

    jaxccl.emulate(NUM_DEVICES)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    sizes = (32, 64, 64, 10)  # input, hidden, hidden, classes; every size divides by 8
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in zip(sizes[:-1], sizes[1:])]
    batch = 256
    teacher = rng.standard_normal((sizes[0], sizes[-1])).astype(np.float32)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)

    def make_step(lib):
        def local_loss(shards, xb, yb):
            h = xb
            for i, w in enumerate(shards):
                full = lib.all_gather(w, "data", axis=0, tiled=True)  # FSDP: gather the weight when used
                h = h @ full
                if i < len(shards) - 1:
                    h = jnp.tanh(h)
            logp = jax.nn.log_softmax(h)
            picked = jnp.take_along_axis(logp, yb[:, None], axis=1)
            return -jnp.sum(picked) / batch  # this device's part of the global mean

        def step(shards, xb, yb):
            loss, grads = jax.value_and_grad(local_loss)(shards, xb, yb)  # grads: psum_scatter'ed shards
            new = [w - args.lr * g for w, g in zip(shards, grads)]
            return new, lib.psum(loss, "data")

        return jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=([P("data")] * len(params), P("data"), P("data")),
                out_specs=([P("data")] * len(params), P()),
            )
        )

    sharding = NamedSharding(mesh, P("data"))
    comm = jaxccl.Communicator(mesh, "data", backend=args.backend)

    def train(lib, use_comm: bool):
        step = make_step(lib)
        shards = [jax.device_put(w, sharding) for w in params]
        xb, yb = jax.device_put(x, sharding), jax.device_put(y, sharding)
        losses = []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            if use_comm:
                with comm:
                    shards, loss = step(shards, xb, yb)
            else:
                shards, loss = step(shards, xb, yb)
            losses.append(np.asarray(loss))
        return losses, [np.asarray(w) for w in shards], time.perf_counter() - t0

    ours, w_ours, t_ours = train(jaxccl, True)
    ref, w_ref, t_ref = train(jax.lax, False)

    print(f"MLP {sizes}, FSDP over {NUM_DEVICES} devices, jaxccl backend {comm.backend!r}")
    print(f"{'step':>4}  {'loss (jaxccl)':>14}  {'loss (jax.lax)':>14}  bitwise")
    ok = True
    for i, (a, b) in enumerate(zip(ours, ref)):
        same = a.tobytes() == b.tobytes()
        ok &= same
        print(f"{i:>4}  {float(a):14.8f}  {float(b):14.8f}  {'yes' if same else 'NO'}")
    same_w = all(a.tobytes() == b.tobytes() for a, b in zip(w_ours, w_ref))
    ok &= same_w
    learned = float(ours[-1]) < float(ours[0])
    print(f"final weights bitwise equal: {'yes' if same_w else 'NO'}; loss decreased: {'yes' if learned else 'NO'}")
    print(f"wall time incl. compilation: jaxccl {t_ours:.2f} s, jax.lax {t_ref:.2f} s")
    if not ok:
        print("MISMATCH between jaxccl and jax.lax", file=sys.stderr)
        return 1
    return 0 if learned else 1


if __name__ == "__main__":
    sys.exit(main())
