"""A small transformer on a 2-D mesh (data x model), written with jax.lax, run through jax.lax and through jaxccl.

The model is plain JAX: token embedding (tied with the output layer), pre-norm
decoder blocks (causal multi-head attention and a GELU MLP), RMS norms. It is
sharded two ways on a ``data x model`` mesh of 8 CPU devices (2 x 4 by
default) inside one ``jax.shard_map``:

- **tensor parallelism over ``model``** (Megatron style): the QKV and first
  MLP matrices are split by columns (heads / hidden units), the attention
  output and second MLP matrices by rows; each block ends in a
  ``lax.psum(..., "model")``. Autodiff adds the backward all-reduces of the
  column-parallel layers (the transposes of JAX's implicit ``pvary``).
- **FSDP over ``data``**: the batch and every weight are split over ``data``;
  each weight is all-gathered (``lax.all_gather(..., "data", tiled=True)``)
  just before use, and autodiff turns those gathers into ``psum_scatter``s of
  the gradients, so every device updates only its shard.

The gradient norm for clipping is a ``lax.psum`` over both axes at once,
``("data", "model")``, and the logged loss a ``lax.pmean`` over ``data``.
The training step contains only ``jax.lax`` collectives; ``jaxccl.offload``
runs the same step with every one of them replaced by jaxccl's. The two loss
curves (and the final weights) must be bitwise equal; the script exits 1 if
they are not.

Usage:
    python examples/transformer.py [--steps 20] [--backend auto|cpu|ppermute] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import jaxccl

NUM_DEVICES = 8


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and mesh sizes; every sharded dimension divides by its mesh axis."""

    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    head_dim: int = 8
    d_ff: int = 64
    layers: int = 2
    seq: int = 16
    batch: int = 8
    data: int = 2  # mesh axis sizes: data x model = 8 devices
    model: int = 4
    lr: float = 0.3
    clip: float = 1.0


# Which dims of each weight the mesh axes split: (FSDP dim over "data", TP dim over "model" or None).
_LAYOUT = {
    "embed": (0, None),  # [vocab, d]
    "ln_f": (0, None),  # [d]
    "ln1": (0, None),
    "ln2": (0, None),
    "wqkv": (0, 2),  # [d, 3, heads * head_dim]: columns (heads) over model
    "wo": (1, 0),  # [heads * head_dim, d]: rows over model
    "w1": (0, 1),  # [d, d_ff]: columns over model
    "w2": (1, 0),  # [d_ff, d]: rows over model
}


def param_shapes(cfg: Config) -> dict[str, Any]:
    """Global shapes of the parameters: top-level arrays and a list of per-layer dicts."""
    hd = cfg.heads * cfg.head_dim
    layer = {
        "ln1": (cfg.d_model,),
        "wqkv": (cfg.d_model, 3, hd),
        "wo": (hd, cfg.d_model),
        "ln2": (cfg.d_model,),
        "w1": (cfg.d_model, cfg.d_ff),
        "w2": (cfg.d_ff, cfg.d_model),
    }
    return {"embed": (cfg.vocab, cfg.d_model), "ln_f": (cfg.d_model,), "layers": [layer] * cfg.layers}


def _spec(name: str, ndim: int):
    from jax.sharding import PartitionSpec as P

    fsdp, tp = _LAYOUT[name]
    dims = [None] * ndim
    dims[fsdp] = "data"
    if tp is not None:
        dims[tp] = "model"
    return P(*dims)


def param_specs(cfg: Config) -> dict[str, Any]:
    """The PartitionSpec of every parameter (same tree as :func:`param_shapes`)."""
    shapes = param_shapes(cfg)
    top = {k: _spec(k, len(shapes[k])) for k in ("embed", "ln_f")}
    layers = [{k: _spec(k, len(s)) for k, s in layer.items()} for layer in shapes["layers"]]
    return {**top, "layers": layers}


def init_params(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """Random parameters (numpy, float32): scaled normals for matrices, ones for norm scales."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def make(name: str, shape: tuple[int, ...]):
        if name.startswith("ln"):
            return np.ones(shape, np.float32)
        fan_in = shape[0] if name != "wo" else cfg.heads * cfg.head_dim
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    shapes = param_shapes(cfg)
    return {
        "embed": make("embed", shapes["embed"]),
        "ln_f": make("ln_f", shapes["ln_f"]),
        "layers": [{k: make(k, s) for k, s in layer.items()} for layer in shapes["layers"]],
    }


def make_batches(cfg: Config, steps: int, seed: int = 1):
    """Token sequences with a learnable rule (next = (3 * token + 1) mod vocab, with 10% noise)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        toks = np.zeros((cfg.batch, cfg.seq + 1), np.int32)
        toks[:, 0] = rng.integers(0, cfg.vocab, cfg.batch)
        for t in range(cfg.seq):
            noise = rng.random(cfg.batch) < 0.1
            nxt = (3 * toks[:, t] + 1) % cfg.vocab
            toks[:, t + 1] = np.where(noise, rng.integers(0, cfg.vocab, cfg.batch), nxt)
        out.append(toks)
    return out


def make_mesh(cfg: Config):
    """The ``data x model`` mesh of the first ``cfg.data * cfg.model`` devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = np.array(jax.devices()[: cfg.data * cfg.model]).reshape(cfg.data, cfg.model)
    return Mesh(devices, ("data", "model"))


def make_step(cfg: Config, mesh):
    """One training step, ``(params, tokens) -> (new params, loss)``, a jitted-ready shard_map (jax.lax only)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    def gather(w, name):  # FSDP: the full (over data) weight, still split over model
        return lax.all_gather(w, "data", axis=_LAYOUT[name][0], tiled=True)

    def rms(x, scale):
        return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    def block(p, x):
        b, s, _ = x.shape
        heads = cfg.heads // cfg.model
        h = rms(x, gather(p["ln1"], "ln1"))
        qkv = jnp.einsum("bsd,dkh->bskh", h, gather(p["wqkv"], "wqkv"))
        q, k, v = (qkv[:, :, i].reshape(b, s, heads, cfg.head_dim) for i in range(3))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim))
        att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, jnp.float32(-1e9))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, s, heads * cfg.head_dim)
        x = x + lax.psum(o @ gather(p["wo"], "wo"), "model")
        h = rms(x, gather(p["ln2"], "ln2"))
        u = jax.nn.gelu(h @ gather(p["w1"], "w1"))
        return x + lax.psum(u @ gather(p["w2"], "w2"), "model")

    def local_loss(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        embed = gather(params["embed"], "embed")
        x = embed[inputs]
        for p in params["layers"]:
            x = block(p, x)
        logits = rms(x, gather(params["ln_f"], "ln_f")) @ embed.T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def step(params, tokens):
        loss, grads = jax.value_and_grad(local_loss)(params, tokens)
        grads = jax.tree.map(lambda g: g / cfg.data, grads)  # the gathers' transposes summed over data
        leaves = jax.tree.leaves_with_path(grads)
        sharded = sum(jnp.sum(g * g) for path, g in leaves if _LAYOUT[_name(path)][1] is not None)
        replicated = sum(jnp.sum(g * g) for path, g in leaves if _LAYOUT[_name(path)][1] is None)
        norm = jnp.sqrt(lax.psum(sharded, ("data", "model")) + lax.psum(replicated, "data"))
        scale = cfg.lr * jnp.minimum(1.0, cfg.clip / norm)
        new = jax.tree.map(lambda w, g: w - scale * g, params, grads)
        return new, lax.pmean(loss, "data")

    specs = param_specs(cfg)
    return jax.shard_map(step, mesh=mesh, in_specs=(specs, P("data")), out_specs=(specs, P()))


def _name(path) -> str:
    return str(path[-1].key)


def train(cfg: Config, steps: int, *, via: str, backend: str = "auto") -> tuple[list[float], Any, float]:
    """Trains ``steps`` steps from the same start; returns (losses, final params, seconds per step after the first).

    ``via="lax"`` runs the step as written; ``via="jaxccl"`` runs it through
    ``jaxccl.offload`` with communicators of ``backend`` for every axis (and
    axis pair) the step uses.
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding

    mesh = make_mesh(cfg)
    step = make_step(cfg, mesh)
    if via == "jaxccl":
        comms = [jaxccl.Communicator(mesh, axes, backend=backend) for axes in ("data", "model", ("data", "model"))]
        step = jaxccl.offload(step, comm=comms)
    elif via != "lax":
        raise ValueError(f"via must be 'lax' or 'jaxccl', got {via!r}")
    step = jax.jit(step, donate_argnums=0)
    place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    params = jax.tree.map(place, init_params(cfg), param_specs(cfg))
    losses, t0 = [], None
    for i, tokens in enumerate(make_batches(cfg, steps)):
        params, loss = step(params, place(tokens, jax.sharding.PartitionSpec("data")))
        losses.append(np.float32(loss))
        if i == 0:
            t0 = time.perf_counter()
    per_step = (time.perf_counter() - t0) / max(steps - 1, 1)
    return losses, jax.tree.map(np.asarray, params), per_step


def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two pytrees of arrays have the same structure, shapes, dtypes and bytes."""
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "ppermute"])
    ap.add_argument("--json", help="write the loss curves and the verdict here")
    args = ap.parse_args(argv)
    jaxccl.emulate(NUM_DEVICES)

    cfg = Config()
    ref_losses, ref_params, ref_dt = train(cfg, args.steps, via="lax")
    losses, params, dt = train(cfg, args.steps, via="jaxccl", backend=args.backend)
    same = bitwise_equal(losses, ref_losses) and bitwise_equal(params, ref_params)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        print(f"step {i:3d}  loss jax.lax {a:.7f}  jaxccl {b:.7f}{'' if a.tobytes() == b.tobytes() else '  DIFFERENT'}")
    print(f"seconds per step: jax.lax {ref_dt:.4f}, jaxccl {dt:.4f} (see benchmarks/executor/transformer_step.py)")
    print("loss curves and final weights bitwise equal" if same else "MISMATCH between jax.lax and jaxccl")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": dataclasses.asdict(cfg),
                    "backend": args.backend,
                    "loss_lax": [float(v) for v in ref_losses],
                    "loss_jaxccl": [float(v) for v in losses],
                    "bitwise_equal": same,
                },
                f,
                indent=2,
            )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
