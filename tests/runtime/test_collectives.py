"""jaxccl collectives vs jax.lax: bitwise equality under jax.jit, both backends, and the error paths."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl
from jaxccl.schedule import Buffer
from jaxccl.synth import baselines

BACKENDS = ("cpu", "ppermute")
DTYPES = (np.float32, jnp.bfloat16, np.int32)


def _mesh(n: int, names=("d",), shape=None) -> Mesh:
    devs = np.array(jax.devices()[:n])
    return Mesh(devs.reshape(shape or (n,)), names)


def _data(shape, dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


def _cases(lib, ax: str) -> dict:
    """(case name, dtype name) -> function of the per-device block; ``lib`` is jaxccl or jax.lax."""
    f32, bf16, i32 = "float32", "bfloat16", "int32"
    return {
        ("all_gather axis=0 tiled", f32): lambda v: lib.all_gather(v, ax, axis=0, tiled=True),
        ("all_gather axis=1 stacked", f32): lambda v: lib.all_gather(v, ax, axis=1, tiled=False),
        ("all_gather axis=-1 tiled", f32): lambda v: lib.all_gather(v, ax, axis=-1, tiled=True),
        ("all_to_all 1->2 tiled", f32): lambda v: lib.all_to_all(v, ax, 1, 2, tiled=True),
        ("all_to_all 2->0 untiled", f32): lambda v: lib.all_to_all(_split_view(v, ax), ax, 2, 0, tiled=False),
        ("psum_scatter dim=1 tiled", f32): lambda v: lib.psum_scatter(v, ax, scatter_dimension=1, tiled=True),
        ("psum_scatter dim=2 untiled", f32): lambda v: lib.psum_scatter(_split_view(v, ax), ax, scatter_dimension=2),
        ("psum", f32): lambda v: lib.psum(v, ax),
        ("all_gather axis=0 tiled", bf16): lambda v: lib.all_gather(v, ax, axis=0, tiled=True),
        ("psum_scatter dim=1 tiled", bf16): lambda v: lib.psum_scatter(v, ax, scatter_dimension=1, tiled=True),
        ("psum", bf16): lambda v: lib.psum(v, ax),
        ("all_to_all 1->0 tiled", i32): lambda v: lib.all_to_all(v, ax, 1, 0, tiled=True),
        ("psum_scatter dim=1 tiled", i32): lambda v: lib.psum_scatter(v, ax, scatter_dimension=1, tiled=True),
        ("psum", i32): lambda v: lib.psum(v, ax),
    }


def _split_view(v, ax):
    """A view of v whose dim 2 has the axis size (for the untiled variants)."""
    n = jax.lax.axis_size(ax)
    return v[:, :, :n]


BLOCK = (4, 24, 8)  # per device; 24 splits over every axis size tested, 8 >= every axis size


@functools.cache
def _program(lib_name: str, n: int, names: tuple, shape: tuple | None, ax: str):
    """One jitted shard_map computing every case (compiled once, reused by the tests)."""
    lib = jaxccl if lib_name == "jaxccl" else jax.lax
    mesh = _mesh(n, names, shape)
    spec, reduced = P(*names), P(*[a for a in names if a != ax])
    cases = _cases(lib, ax)
    if len(names) > 1:  # 2-D meshes: one case per collective (+ the bf16 psum), to keep compile time down
        keep = {"all_gather axis=1 stacked", "all_to_all 1->2 tiled", "psum_scatter dim=1 tiled", "psum"}
        cases = {k: f for k, f in cases.items() if k[0] in keep and (k[1] == "float32" or k[0] == "psum")}

    def body(inputs):
        return {f"{c} {d}": fn(inputs[d]) for (c, d), fn in cases.items()}

    out_specs = {f"{c} {d}": (reduced if c == "psum" else spec) for c, d in cases}
    return mesh, jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=out_specs))


def _run_both(backend: str, n: int, names: tuple, shape: tuple | None, ax: str, x: dict) -> tuple[dict, dict]:
    mesh, mine = _program("jaxccl", n, names, shape, ax)
    _, ref = _program("lax", n, names, shape, ax)
    with jaxccl.Communicator(mesh, ax, backend=backend):
        got = mine(x)
    return got, ref(x)


def _inputs(mesh_shape: tuple[int, ...], seed: int) -> dict:
    """Global inputs: a BLOCK per device, tiled along the leading dims by the mesh shape."""
    shape = tuple(b * (mesh_shape[i] if i < len(mesh_shape) else 1) for i, b in enumerate(BLOCK))
    return {np.dtype(t).name: _data(shape, t, seed + i) for i, t in enumerate(DTYPES)}


def _compare(got: dict, want: dict) -> list[str]:
    bad = []
    for k in want:
        a, b = np.asarray(got[k]), np.asarray(want[k])
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            bad.append(k)
    return bad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bitwise_equal_to_lax(backend, n):
    got, want = _run_both(backend, n, ("d",), None, "d", _inputs((n,), seed=n))
    assert set(got) == set(want)
    assert _compare(got, want) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ax", ["x", "y"])
def test_2d_mesh_collective_over_one_axis(backend, ax):
    got, want = _run_both(backend, 8, ("x", "y"), (2, 4), ax, _inputs((2, 4), seed=7))
    assert _compare(got, want) == []


# ---------------------------------------------------------------------------------------------- errors
def _trace(fn, n=4, shape=(16, 8), dtype=np.float32, out_specs=None):
    """Traces ``fn`` inside shard_map (no compilation): trace-time errors surface here."""
    mesh = _mesh(n)
    out_specs = P("d") if out_specs is None else out_specs
    return jax.eval_shape(
        jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=out_specs), jax.ShapeDtypeStruct(shape, dtype)
    )


def test_wrong_axis_name_names_the_axes_in_scope():
    with pytest.raises(NameError, match=r"unbound axis name 'data'.*axes in scope: \('d',\)"):
        _trace(lambda v: jaxccl.all_gather(v, "data"))
    with pytest.raises(NameError, match="no named axes are in scope"):
        jaxccl.psum(np.ones(3, np.float32), "d")


def test_refused_where_jax_lax_refuses():
    # lax.psum has no type for groups under check_vma=True; lax.all_gather(to="invarying") takes no groups.
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        _trace(lambda v: jaxccl.psum(v, "d", axis_index_groups=[[0, 1], [2, 3]]))
    with pytest.raises(NotImplementedError, match="axis_index_groups"):
        _trace(lambda v: jaxccl.all_gather(v, "d", to="invarying", axis_index_groups=[[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match="to='sideways'"):
        _trace(lambda v: jaxccl.all_gather(v, "d", to="sideways"))
    with pytest.raises(NotImplementedError, match="to='reduced'"):
        _trace(lambda v: jaxccl.all_gather(v, "d", to="reduced"))
    with pytest.raises(NotImplementedError, match="vmap/pmap axes are not supported"):
        _trace(lambda v: jax.vmap(lambda u: jaxccl.all_gather(u, "v"), axis_name="v")(v))


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ([[0, 1], [2]], "same size"),
        ([[0, 1], [1, 2]], "exactly once"),
        ([[0, 1, 2, 3, 4]], "exactly once"),
        ([], "must not be empty"),
    ],
)
def test_bad_axis_index_groups(groups, match):
    with pytest.raises(ValueError, match=match):
        _trace(lambda v: jaxccl.all_gather(v, "d", axis_index_groups=groups))


@pytest.mark.parametrize("fn", ["psum", "pmax", "pmin", "pmean"])
def test_reductions_take_uneven_groups_and_check_them(fn):
    reduce = getattr(jaxccl, fn)
    uneven = [[0, 1, 2], [3]]
    out = jax.eval_shape(
        jax.shard_map(
            lambda v: reduce(v, "d", axis_index_groups=uneven),
            mesh=_mesh(4),
            in_specs=P("d"),
            out_specs=P("d"),
            check_vma=False,
        ),
        jax.ShapeDtypeStruct((16, 8), np.float32),
    )
    assert out.shape == (16, 8)
    for groups, match in (([[0, 1, 2], [2, 3]], "exactly once"), ([[0, 1, 2, 3], []], "must not be empty")):
        with pytest.raises(ValueError, match=match):
            _trace(lambda v: reduce(v, "d", axis_index_groups=groups))  # noqa: B023
    # Under check_vma=True lax.psum refuses groups, and lax.pmax/pmin type their result as invariant
    # although the groups' results differ: refused alike, with the fix named.
    with pytest.raises(NotImplementedError, match="check_vma=False"):
        _trace(lambda v: reduce(v, "d", axis_index_groups=uneven))


@pytest.mark.parametrize("fn", ["all_gather", "psum_scatter"])
def test_shape_changing_collectives_refuse_uneven_groups_as_lax(fn):
    with pytest.raises(ValueError, match=f"same size.*jax.lax.{fn}"):
        _trace(lambda v: getattr(jaxccl, fn)(v, "d", axis_index_groups=[[0, 1, 2], [3]]))
    with pytest.raises(ValueError, match="same size.*jax.lax.all_to_all"):
        _trace(lambda v: jaxccl.all_to_all(v, "d", 0, 0, axis_index_groups=[[0, 1, 2], [3]]))


def test_bad_axis_tuples():
    with pytest.raises(ValueError, match="more than once"):
        _trace(lambda v: jaxccl.all_gather(v, ("d", "d")))
    with pytest.raises(NameError, match="unbound axis name 'e'"):
        _trace(lambda v: jaxccl.psum(v, ("d", "e")))


def test_non_divisible_sizes():
    with pytest.raises(ValueError, match="split_axis 1 has size 6.*not divisible by the size 4 of axis 'd'"):
        _trace(lambda v: jaxccl.all_to_all(v, "d", 1, 0, tiled=True), shape=(16, 6))
    with pytest.raises(ValueError, match=r"size of split_axis 1 \(6\) must equal the size 4"):
        _trace(lambda v: jaxccl.all_to_all(v, "d", 1, 0), shape=(16, 6))
    with pytest.raises(ValueError, match="scatter_dimension 1 has size 6.*not divisible by the size 4"):
        _trace(lambda v: jaxccl.psum_scatter(v, "d", scatter_dimension=1, tiled=True), shape=(16, 6))
    with pytest.raises(ValueError, match=r"size of scatter_dimension 1 \(6\) must equal the size 4"):
        _trace(lambda v: jaxccl.psum_scatter(v, "d", scatter_dimension=1), shape=(16, 6))
    with pytest.raises(ValueError, match="scatter_dimension=2 is out of range for an operand with 2 dimension"):
        _trace(lambda v: jaxccl.psum_scatter(v, "d", scatter_dimension=2), shape=(16, 6))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])  # more cases: tests/schedule/test_reductions.py
def test_unsupported_reduction_dtypes(dtype):
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=f"dtype {name} is not supported for reductions"):
        _trace(lambda v: jaxccl.psum(v, "d"), dtype=dtype, out_specs=P())
    with pytest.raises(TypeError, match=f"dtype {name}"):
        _trace(lambda v: jaxccl.psum_scatter(v, "d", tiled=True), dtype=dtype)


def test_pytrees_map_over_leaves():
    mesh = _mesh(4)
    tree = {"a": _data((8, 4), np.float32, 1), "b": [_data((8,), np.int32, 2)]}
    f = jax.jit(
        jax.shard_map(lambda t: jaxccl.all_gather(t, "d", tiled=True), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    g = jax.jit(
        jax.shard_map(lambda t: jax.lax.all_gather(t, "d", tiled=True), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )
    got, want = f(tree), g(tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
    )


# --------------------------------------------------------------------- the ppermute lowering of any schedule
def _relay_all_gather(n: int):
    """Rank r's chunk goes to r+1's scratch, which keeps it and forwards it to everybody else."""
    from jaxccl.schedule import ScheduleBuilder

    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=1, scratch_chunks=1)
    for r in range(n):
        b.copy(r, (Buffer.INPUT, 0), (Buffer.OUTPUT, r))
    for r in range(n):
        hop = (r + 1) % n
        got = b.transfer(r, hop, (Buffer.INPUT, 0), (Buffer.SCRATCH, 0))
        b.copy(hop, (Buffer.SCRATCH, 0), (Buffer.OUTPUT, r), after=[got])
        for d in range(n):
            if d not in (r, hop):
                b.transfer(hop, d, (Buffer.SCRATCH, 0), (Buffer.OUTPUT, r), after=[got])
    return b.build(name="relay_allgather")


ANY_SCHEDULES = {
    # name: (schedule factory for N=4, lax reference on the flat buffer, elements per rank, dtype)
    "ring_allgather C=3, uneven chunks": (
        lambda: baselines.ring_allgather(4, channels=3),
        lambda v: jax.lax.all_gather(v, "d", tiled=True),
        10,
        np.float32,
    ),
    "recursive doubling": (
        lambda: baselines.recursive_doubling_allgather(4),
        lambda v: jax.lax.all_gather(v, "d", tiled=True),
        6,
        np.float32,
    ),
    "relay through scratch": (
        lambda: _relay_all_gather(4),
        lambda v: jax.lax.all_gather(v, "d", tiled=True),
        5,
        np.float32,
    ),
    "ring reduce_scatter C=2": (
        lambda: baselines.ring_reduce_scatter(4, channels=2),
        lambda v: jax.lax.psum_scatter(v, "d", tiled=True),
        4 * 6,
        np.int32,
    ),
    "ring all_reduce C=2": (
        lambda: baselines.ring_allreduce(4, channels=2),
        lambda v: jax.lax.psum(v, "d"),
        13,
        np.int32,
    ),
    "binary tree all_reduce": (
        lambda: baselines.binary_tree_allreduce(4),
        lambda v: jax.lax.psum(v, "d"),
        7,
        np.int32,
    ),
    "double binary tree all_reduce": (
        lambda: baselines.double_binary_tree_allreduce(4),
        lambda v: jax.lax.psum(v, "d"),
        9,
        np.int32,
    ),
}


@pytest.mark.parametrize("name", sorted(ANY_SCHEDULES))
def test_ppermute_backend_runs_any_schedule(name):
    """Integer data makes any summation order exact, so unordered schedules are comparable bitwise too."""
    from jaxccl.runtime.ppermute_backend import run_schedule

    make, ref, elems, dtype = ANY_SCHEDULES[name]
    schedule = make().validate()
    mesh = _mesh(4)
    x = _data((4 * elems,), dtype, seed=11)
    reduces_all = schedule.collective.value == "all_reduce"
    spec = P() if reduces_all else P("d")
    got = jax.jit(
        jax.shard_map(lambda v: run_schedule(schedule, v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    )(x)
    want = jax.jit(jax.shard_map(ref, mesh=mesh, in_specs=P("d"), out_specs=spec))(x)
    got = np.asarray(got)
    if reduces_all:  # every rank holds the sum; P("d") concatenated the 4 copies
        assert all(c.tobytes() == np.asarray(want).tobytes() for c in np.split(got, 4))
    else:
        assert got.tobytes() == np.asarray(want).tobytes()


def test_round_plan_uses_partial_permutations():
    from jaxccl.runtime.rounds import plan

    for s in (baselines.direct_alltoall(8), baselines.ordered_allreduce(8), _relay_all_gather(5)):
        p = plan(s, 16)
        sent = 0
        for rnd in p.rounds:
            for ex in rnd.exchanges:
                for perm in ex.perms:
                    srcs, dsts = [a for a, _ in perm], [b for _, b in perm]
                    assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
                    sent += len(perm)
        messages = sum(1 for tbs in s.ranks for tb in tbs for op in tb.ops if op.kind.sends)
        assert sent == messages
    # a direct all-to-all needs N-1 ppermutes, each a cyclic shift
    assert plan(baselines.direct_alltoall(8), 16).num_ppermutes == 7


def test_edge_colouring_is_proper_with_max_degree_colours():
    from jaxccl.runtime.rounds import _edge_colouring

    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 9))
        edges = [(int(a), int(b)) for a, b in rng.integers(0, n, size=(int(rng.integers(1, 40)), 2)) if a != b]
        if not edges:
            continue
        colours = _edge_colouring(edges)
        degree = max(
            max(sum(1 for e in edges if e[0] == u) for u in range(n)),
            max(sum(1 for e in edges if e[1] == v) for v in range(n)),
        )
        assert max(colours) + 1 == degree
        for c in set(colours):
            cls = [e for e, k in zip(edges, colours) if k == c]
            assert len({a for a, _ in cls}) == len(cls) and len({b for _, b in cls}) == len(cls)


def test_round_plan_rejects_unmatched_messages():
    from jaxccl.errors import ScheduleError
    from jaxccl.runtime.rounds import plan
    from jaxccl.schedule import Op, OpKind, Schedule, Threadblock

    lonely_send = Threadblock((Op(OpKind.SEND, Buffer.INPUT, 0, Buffer.OUTPUT, 0),), send_peer=1)
    s = Schedule("all_gather", 2, 1, ((lonely_send,), ()))
    with pytest.raises(ScheduleError, match="1 sending ops but 0 receiving"):
        plan(s, 4)
