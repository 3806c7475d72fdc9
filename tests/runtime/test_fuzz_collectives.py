"""Property-based fuzzing of the collectives' arguments against jax.lax.

For random shapes, dtypes, axes, ``tiled`` and split/concat/scatter dimensions
(valid and invalid): when ``jax.lax`` accepts a call, jaxccl returns a result
bitwise equal to it; when ``jax.lax`` refuses it, jaxccl refuses it too, with an
exception rather than a crash or a wrong answer. Reductions are drawn from the
dtypes jaxccl reduces bitwise like XLA:CPU (float32, bfloat16, int32).

Each example compiles two small programs, so CI runs a derandomized few dozen;
``JAXCCL_FUZZ=long`` runs many more (``benchmarks/correctness/fuzz.py``).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from programs import collective

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jaxccl  # noqa: E402

N = 4
MESH = Mesh(np.array(jax.devices()[:N]), ("d",))
COMM = jaxccl.Communicator(MESH, "d", backend="cpu")

settings.register_profile(
    "ci-collectives", max_examples=30, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile(
    "long-collectives", max_examples=2_000, deadline=None, suppress_health_check=list(HealthCheck)
)
PROFILE = "long-collectives" if os.environ.get("JAXCCL_FUZZ") == "long" else "ci-collectives"

MOVE_DTYPES = [np.float32, np.float16, jnp.bfloat16, np.int32, np.int8, np.uint8, np.int64]
SUM_DTYPES = [np.float32, jnp.bfloat16, np.int32]


def _run(lib, coll, x, kw):
    def body(v):
        return collective(lib, coll, v, axis=kw["axis"], tiled=kw["tiled"], split=kw["split"], concat=kw["concat"])

    return np.asarray(jax.jit(jax.shard_map(body, mesh=MESH, in_specs=P("d"), out_specs=P("d")))(x))


@st.composite
def cases(draw):
    coll = draw(st.sampled_from(["all_gather", "all_to_all", "psum_scatter", "psum"]))
    dtype = draw(st.sampled_from(SUM_DTYPES if coll.startswith("psum") else MOVE_DTYPES))
    ndim = draw(st.integers(1, 3))
    # Shapes of the per-device block; the leading dimension is multiplied by N for the global array.
    shape = [draw(st.sampled_from([1, 2, 3, 4, 8])) for _ in range(ndim)]
    kw = {
        "axis": draw(st.integers(-ndim - 1, ndim)),  # includes out-of-range values
        "tiled": draw(st.booleans()),
        "split": draw(st.integers(-1, ndim)),
        "concat": draw(st.integers(-1, ndim)),
    }
    seed = draw(st.integers(0, 2**16))
    return coll, np.dtype(dtype), shape, kw, seed


@settings.get_profile(PROFILE)
@given(cases())
def test_collective_arguments_agree_with_lax(case):
    coll, dtype, shape, kw, seed = case
    rng = np.random.default_rng(seed)
    full = (shape[0] * N, *shape[1:])
    if np.issubdtype(dtype, np.integer):
        x = rng.integers(-50, 50, size=full).astype(dtype) if dtype.kind == "i" else rng.integers(1, 200, full)
        x = np.asarray(x).astype(dtype)
    else:
        x = (rng.standard_normal(full) + 0.5).astype(dtype)
    try:
        want = _run(jax.lax, coll, x, kw)
    except Exception:  # noqa: BLE001 - jax.lax refused this call: jaxccl must refuse it as well
        with pytest.raises(Exception), COMM:  # noqa: B017
            _run(jaxccl, coll, x, kw)
        return
    with COMM:
        got = _run(jaxccl, coll, x, kw)
    assert got.dtype == want.dtype and got.shape == want.shape, (coll, dtype, shape, kw)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (coll, dtype, shape, kw)
