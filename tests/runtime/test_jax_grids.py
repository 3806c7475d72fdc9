"""JAX's own collective test grids, re-expressed: each case runs through jax.lax and through jaxccl, bitwise.

The parameter grids follow the collective tests of JAX's ``pmap_test``,
``shard_map_test`` and ``batching_test`` (gather axes and tiling, scatter
dimensions, split/concat axes, negative axes, several mesh axes, axis-index
groups, invariant gathers, trees, grad/jvp/transpose, vmap), written inside
``jax.shard_map`` (where jaxccl runs) and compared bit for bit with
``jax.lax`` on random data, on the ``cpu`` (native executor) and ``ppermute``
backends. Each family of cases is one jitted program per library, to keep
compile time down. Dtype grids live with the reduction tests.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxccl

BACKENDS = ("cpu", "ppermute")
EVEN_ODD = ((0, 2, 4, 6), (1, 3, 5, 7))
PAIRS_APART = ((0, 4), (1, 5), (2, 6), (3, 7))
REVERSED_HALVES = ((3, 2, 1, 0), (7, 6, 5, 4))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _data(shape, dtype=np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    # Magnitudes spread over many decades: any change of summation order shows in the bits.
    scale = np.logspace(-4, 4, int(np.prod(shape))).reshape(shape)
    return (rng.standard_normal(shape) * scale).astype(dtype)


@contextlib.contextmanager
def _communicators(mesh: Mesh, keys, backend: str):
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(jaxccl.Communicator(mesh, key, backend=backend))
        yield


def _assert_bitwise(got, want) -> None:
    got_leaves, want_leaves = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    bad = []
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype or a.tobytes() != b.tobytes():
            bad.append(jax.tree_util.keystr(path))
    assert bad == []


def _compare(family, backend: str, *args) -> None:
    """``family(lib)`` -> (mesh, communicator keys, jitted program of ``args``); jaxccl vs jax.lax."""
    mesh, keys, ref = family(lax)
    _, _, mine = family(jaxccl)
    want = ref(*args)
    with _communicators(mesh, keys, backend):
        got = mine(*args)
    _assert_bitwise(got, want)


def _smap(mesh, body, in_specs, out_specs, check_vma=True):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


# ------------------------------------------------------------------ pmap_test: one axis of 8
ONE_AXIS = _mesh((8,), ("i",))


@functools.cache
def _gather_family(lib):
    """all_gather: axis in {0, 1, -1, last+1}, tiled or stacked; a bool operand (pmap_test's Gather* grid)."""
    cases = {
        f"axis={axis} tiled={tiled}": functools.partial(lib.all_gather, axis_name="i", axis=axis, tiled=tiled)
        for axis, tiled in [(0, False), (1, False), (-1, False), (3, False), (0, True), (1, True), (-1, True)]
    }

    def body(x, b):
        out = {name: fn(x) for name, fn in cases.items()}
        out["bool stacked"] = lib.all_gather(b, "i")
        out["bool tiled axis=-1"] = lib.all_gather(b, "i", axis=-1, tiled=True)
        return out

    return ONE_AXIS, ["i"], _smap(ONE_AXIS, body, (P("i"), P("i")), P("i"))


@functools.cache
def _scatter_family(lib):
    """psum_scatter: scatter_dimension in {0, 1, 2, -1}, tiled or not (ReduceScatter* grid).

    jax.lax 0.10 lowers a negative scatter_dimension inside shard_map to invalid StableHLO, so its reference
    for ``-1`` is the equivalent ``2``.
    """

    def dim(d: int) -> int:
        return d % 3 if lib is lax else d

    cases = {
        f"dim={d} tiled={t}": functools.partial(lib.psum_scatter, axis_name="i", scatter_dimension=dim(d), tiled=t)
        for d in (0, 1, 2, -1)
        for t in (False, True)
    }
    return ONE_AXIS, ["i"], _smap(ONE_AXIS, lambda x: {k: f(x) for k, f in cases.items()}, P("i"), P("i"))


@functools.cache
def _all_to_all_family(lib):
    """all_to_all: every (split, concat) of a 3-D block, tiled and untiled, negative axes (AllToAll* grid)."""
    cases = {}
    for split in (0, 1, 2):
        for concat in (0, 1, 2):
            cases[f"{split}->{concat} tiled"] = functools.partial(
                lib.all_to_all, axis_name="i", split_axis=split, concat_axis=concat, tiled=True
            )
            cases[f"{split}->{concat}"] = functools.partial(
                lib.all_to_all, axis_name="i", split_axis=split, concat_axis=concat
            )
    # jax.lax 0.10 crashes lowering negative axes inside shard_map: its reference uses the equivalent ones.
    neg = (lambda a: a % 3) if lib is lax else (lambda a: a)
    cases["-3->-1"] = functools.partial(lib.all_to_all, axis_name="i", split_axis=neg(-3), concat_axis=neg(-1))
    cases["-2->-3 tiled"] = functools.partial(
        lib.all_to_all, axis_name="i", split_axis=neg(-2), concat_axis=neg(-3), tiled=True
    )
    return ONE_AXIS, ["i"], _smap(ONE_AXIS, lambda x: {k: f(x) for k, f in cases.items()}, P("i"), P("i"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_grid(backend):
    _compare(_gather_family, backend, _data((64, 8, 3), seed=1), _data((64, 5), np.bool_, seed=2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_scatter_grid(backend):
    _compare(_scatter_family, backend, _data((64, 8, 8), seed=3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_grid(backend):
    _compare(_all_to_all_family, backend, _data((64, 8, 8), seed=4))


@functools.cache
def _tree_family(lib):
    """Collectives over pytrees of different dtypes (CollectivesWithTreesOfDifferentDtypes)."""

    def body(t):
        return {
            "psum": lib.psum(t, "i"),
            "all_gather": lib.all_gather(t, "i", tiled=True),
            "all_to_all": lib.all_to_all(t, "i", 0, 0),
        }

    spec = {"a": P("i"), "b": P("i")}
    out = {"psum": {"a": P(), "b": P()}, "all_gather": spec, "all_to_all": spec}
    return ONE_AXIS, ["i"], _smap(ONE_AXIS, body, (spec,), out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trees_of_different_dtypes(backend):
    _compare(_tree_family, backend, {"a": _data((64, 3), seed=5), "b": _data((64, 3), np.int32, seed=6)})


# ------------------------------------------------------------------ groups (pmap_test, shard_map_test)
@functools.cache
def _groups_family(lib, check_vma: bool):
    """axis_index_groups: even/odd, interleaved, reversed; every collective jax.lax groups in shard_map."""

    def body(x):
        out = {}
        for name, groups in (("even-odd", EVEN_ODD), ("pairs", PAIRS_APART), ("reversed", REVERSED_HALVES)):
            k = len(groups[0])
            out[f"gather {name}"] = lib.all_gather(x, "i", axis_index_groups=groups)
            out[f"gather tiled {name}"] = lib.all_gather(x, "i", axis=1, tiled=True, axis_index_groups=groups)
            out[f"scatter tiled {name}"] = lib.psum_scatter(x, "i", tiled=True, axis_index_groups=groups)
            out[f"scatter {name}"] = lib.psum_scatter(x[:k], "i", scatter_dimension=0, axis_index_groups=groups)
            out[f"a2a {name}"] = lib.all_to_all(x[:k], "i", 0, 0, axis_index_groups=groups)
            out[f"a2a tiled 1->0 {name}"] = lib.all_to_all(x, "i", 1, 0, tiled=True, axis_index_groups=groups)
            if not check_vma:  # jax.lax.psum refuses groups under check_vma=True
                out[f"psum {name}"] = lib.psum(x, "i", axis_index_groups=groups)
        return out

    return ONE_AXIS, ["i"], _smap(ONE_AXIS, body, P("i"), P("i"), check_vma=check_vma)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_axis_index_groups(backend, check_vma):
    _compare(lambda lib: _groups_family(lib, check_vma), backend, _data((64, 8), seed=7))


# ------------------------------------------------------------------ uneven groups (pmap_test)
UNEVEN = (((0, 1), tuple(range(2, 8))), ((2, 3, 4), (0, 1), (5, 6, 7)), ((7,), tuple(range(7))))


@functools.cache
def _uneven_groups_family(lib):
    """Reductions over groups of different sizes (``jax.lax`` takes them for psum/pmax/pmin/pmean only)."""

    def body(x, ints):
        out = {
            # pmap_test's testPsumUnevenReplicaGroups, in shard_map: x - psum(x) over [[0, 1], [2..7]].
            "testPsumUnevenReplicaGroups": x - lib.psum(x, "i", axis_index_groups=UNEVEN[0]),
        }
        for k, groups in enumerate(UNEVEN):
            out[f"psum {k}"] = lib.psum(x, "i", axis_index_groups=groups)
            out[f"pmax {k}"] = lib.pmax(x, "i", axis_index_groups=groups)
            out[f"pmin {k}"] = lib.pmin(x, "i", axis_index_groups=groups)
            out[f"pmean {k}"] = lib.pmean(x, "i", axis_index_groups=groups)
        groups = UNEVEN[1]
        out["psum bf16"] = lib.psum(x.astype(jnp.bfloat16), "i", axis_index_groups=groups)
        out["psum f16"] = lib.psum(x.astype(jnp.float16), "i", axis_index_groups=groups)
        out["psum int32"] = lib.psum(ints, "i", axis_index_groups=groups)
        out["psum bool"] = lib.psum(ints > 0, "i", axis_index_groups=groups)
        out["pmax int32"] = lib.pmax(ints, "i", axis_index_groups=groups)
        out["psum tree"] = lib.psum({"a": x, "b": ints}, "i", axis_index_groups=groups)
        out["vmap"] = jax.vmap(lambda u: lib.psum(u, "i", axis_index_groups=groups))(x)
        out["scan"] = lax.scan(lambda c, u: (lib.psum(c * u, "i", axis_index_groups=groups), c), x, x[:4])
        out["grad"] = jax.grad(lambda v: jnp.sin(lib.psum(v * v, "i", axis_index_groups=groups)).sum())(x)
        out["jvp"] = jax.jvp(lambda v: lib.psum(v, "i", axis_index_groups=groups), (x,), (jnp.cos(x),))
        return out

    return ONE_AXIS, ["i"], _smap(ONE_AXIS, body, (P("i"), P("i")), P("i"), check_vma=False)


@functools.cache
def _uneven_groups_2d_family(lib):
    """Uneven groups along one axis of a 2x4 mesh (a group per coordinate of the other) and over both axes."""
    mesh = _mesh((2, 4), ("x", "y"))

    def body(v):
        return {
            "y": lib.psum(v, "y", axis_index_groups=((0,), (1, 2, 3))),
            "y pmax": lib.pmax(v, "y", axis_index_groups=((3, 1), (0,), (2,))),
            "yx": lib.psum(v, ("y", "x"), axis_index_groups=((0, 1, 2), (3, 4, 5, 6, 7))),
        }

    return mesh, ["y", ("y", "x")], _smap(mesh, body, P(("x", "y")), P(("x", "y")), check_vma=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_axis_index_groups(backend):
    _compare(_uneven_groups_family, backend, _data((64, 8), seed=11), _data((64, 8), np.int32, seed=12))
    _compare(_uneven_groups_2d_family, backend, _data((32, 8), seed=13))


@pytest.mark.parametrize("backend", BACKENDS)
def test_psum_uneven_replica_groups_as_in_pmap_test(backend):
    """pmap_test's exact case and data (arange), each device's row of ``x``; bitwise with jax.lax."""
    groups = [[0, 1], np.arange(2, 8)]

    def family(lib):
        body = lambda x: x - lib.psum(x, "i", axis_index_groups=groups)  # noqa: E731
        return ONE_AXIS, ["i"], _smap(ONE_AXIS, body, P("i"), P("i"), check_vma=False)

    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    _compare(family, backend, x)
    expected = np.concatenate([x[:2] - x[:2].sum(0), x[2:] - x[2:].sum(0)])
    with jaxccl.Communicator(ONE_AXIS, "i", backend=backend):
        np.testing.assert_array_equal(family(jaxccl)[2](x), expected)


# ------------------------------------------------------------------ several axes (shard_map_test)
CUBE = _mesh((2, 2, 2), ("x", "y", "z"))
CUBE_KEYS = ["z", ("x", "y"), ("z", "x"), ("y", "x"), ("x", "y", "z"), ("z", "y"), ("y", "z")]


@functools.cache
def _axes_family(lib):
    """Collectives over one and several axes of a 2x2x2 mesh, in and out of mesh order; invariant gathers."""
    spec = P("z", ("x", "y"))

    def body(a):
        return {
            "gather z": lib.all_gather(a, "z", axis=0, tiled=True),
            "gather xy axis=-1": lib.all_gather(a, ("x", "y"), axis=-1, tiled=True),
            "gather zx stacked": lib.all_gather(a, ("z", "x"), axis=1),
            "gather yz groups": lib.all_gather(a, ("y", "z"), axis=-1, tiled=True, axis_index_groups=((0, 1), (2, 3))),
            "gather yz groups apart": lib.all_gather(a, ("y", "z"), axis_index_groups=((3, 0), (1, 2))),
            "psum yx": lib.psum(a, ("y", "x")),
            "psum xyz": lib.psum(a, ("x", "y", "z")),
            "scatter zy dim=0": lib.psum_scatter(a, ("z", "y"), scatter_dimension=0, tiled=True),
            "a2a yz 0->0": lib.all_to_all(a, ("y", "z"), 0, 0, tiled=True),
            "a2a zx 0->1": lib.all_to_all(a, ("z", "x"), 0, 1, tiled=True),
            "invariant z": lib.all_gather(a, "z", axis=0, tiled=True, to="invarying"),
            "invariant xy": lib.all_gather(a, ("x", "y"), axis=-1, tiled=True, to="invarying"),
        }

    out = {
        "gather z": spec,
        "gather xy axis=-1": spec,
        "gather zx stacked": spec,
        "gather yz groups": spec,
        "gather yz groups apart": spec,
        "psum yx": P("z"),
        "psum xyz": P(),
        "scatter zy dim=0": spec,
        "a2a yz 0->0": spec,
        "a2a zx 0->1": spec,
        "invariant z": P(None, ("x", "y")),
        "invariant xy": P("z"),
    }
    return CUBE, CUBE_KEYS, _smap(CUBE, body, spec, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_axes(backend):
    _compare(_axes_family, backend, _data((8, 8), seed=8))


def test_invariant_gather_types():
    def body(a):
        c = jaxccl.all_gather(a, "z", axis=0, tiled=True, to="invarying")
        d = jaxccl.all_gather(a, ("x", "y"), axis=-1, tiled=True, to="invarying")
        assert jax.typeof(c).mat.varying == {"x", "y"} and jax.typeof(d).mat.varying == {"z"}
        return c, d

    spec = P("z", ("x", "y"))
    jax.eval_shape(
        jax.shard_map(body, mesh=CUBE, in_specs=spec, out_specs=(P(None, ("x", "y")), P("z"))),
        jax.ShapeDtypeStruct((8, 8), np.float32),
    )


@functools.cache
def _rect_family(lib):
    """all_to_all over one axis and over two (a 4x2 mesh), as shard_map_test's all_to_all cases."""
    mesh = _mesh((4, 2), ("x", "y"))

    def body(a):
        return lib.all_to_all(a, ("x", "y"), split_axis=1, concat_axis=1, tiled=True), lib.all_to_all(
            a, "x", split_axis=1, concat_axis=1, tiled=True
        )

    return mesh, [("x", "y"), "x"], _smap(mesh, body, P(("x", "y")), (P(None, ("x", "y")), P(None, ("x", "y"))))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_over_two_axes(backend):
    _compare(_rect_family, backend, _data((8, 8), seed=9))


# ------------------------------------------------------------------ grad / jvp / transpose
@functools.cache
def _grad_family(lib, check_vma: bool):
    """Reverse and forward derivatives through every collective (GradOf*, *Grad, psum transposes)."""
    mesh = _mesh((2, 4), ("x", "y"))
    spec = P(("x", "y"))
    fns = {
        "gather": lambda v: lib.all_gather(v, "y"),
        "gather tiled": lambda v: lib.all_gather(v, "y", tiled=True),
        "gather groups": lambda v: lib.all_gather(v, "y", axis_index_groups=((0, 1), (2, 3))),
        "gather xy": lambda v: lib.all_gather(v, ("y", "x"), axis=1, tiled=True),
        "scatter": lambda v: lib.psum_scatter(v[:4], "y"),
        "scatter tiled": lambda v: lib.psum_scatter(v, ("x", "y"), tiled=True),
        "scatter groups": lambda v: lib.psum_scatter(v, "y", tiled=True, axis_index_groups=((3, 1), (0, 2))),
        "a2a": lambda v: lib.all_to_all(v, "y", 0, 1, tiled=True),
        "a2a groups": lambda v: lib.all_to_all(v, "y", 0, 1, tiled=True, axis_index_groups=((0, 2), (1, 3))),
        "psum": lambda v: lib.psum(v * v, ("x", "y")),
    }
    if check_vma:
        fns["invariant"] = lambda v: lib.all_gather(v, ("x", "y"), tiled=True, to="invarying")
    else:
        fns["psum groups"] = lambda v: lib.psum(v, "y", axis_index_groups=((0, 3), (1, 2)))

    def loss(name, v, u):
        out = fns[name](v)
        return (jnp.sin(out) * u[: out.size].reshape(out.shape)).sum()

    def body(v, u):
        # Derivatives inside one shard_map: the native executor orders the collectives of one region; independent
        # shard_map regions in one program are not ordered against each other (see docs/guides/offload.md).
        out = {}
        for name in fns:
            out[f"grad {name}"] = jax.grad(loss, argnums=(1, 2))(name, v, u)
            out[f"jvp {name}"] = jax.jvp(fns[name], (v,), (jnp.cos(v),))
        return out

    out_specs = {f"grad {n}": (spec, spec) for n in fns} | {f"jvp {n}": (spec, spec) for n in fns}
    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=out_specs, check_vma=check_vma))
    return mesh, [("x", "y"), ("y", "x"), "y"], program


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_and_jvp(backend, check_vma):
    w = _data((1024,), seed=11)
    _compare(lambda lib: _grad_family(lib, check_vma), backend, _data((64, 8), seed=10), w)


@functools.cache
def _fanout_family(lib, check_vma: bool):
    """psum of a replicated (fan-out) input, differentiated: psum's transpose (shard_map_test's psum tests)."""
    mesh = _mesh((2, 4), ("x", "y"))

    def f(x):
        g = jax.shard_map(
            lambda v: lib.psum(v * v, ("x", "y")), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=check_vma
        )
        return g(x).sum()

    return mesh, [("x", "y")], jax.jit(jax.value_and_grad(f))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_psum_transposes_on_replicated_input(backend, check_vma):
    _compare(lambda lib: _fanout_family(lib, check_vma), backend, _data((16,), seed=12))


# ------------------------------------------------------------------ vmap (batching_test)
@functools.cache
def _vmap_family(lib):
    """vmap (an unnamed batch dim at 0, 1 or 2) around collectives inside shard_map (AllToAll/AllGather grids)."""
    mesh = _mesh((8,), ("i",))

    def body(x):
        out = {}
        for vmap_axis in (0, 1, 2):
            for split in (0, 1):
                for concat in (0, 1):
                    fn = functools.partial(lib.all_to_all, axis_name="i", split_axis=split, concat_axis=concat)
                    out[f"a2a vmap={vmap_axis} {split}->{concat}"] = jax.vmap(fn, in_axes=vmap_axis)(x)
            out[f"gather vmap={vmap_axis}"] = jax.vmap(lambda u: lib.all_gather(u, "i"), in_axes=vmap_axis)(x)
            out[f"scatter tiled vmap={vmap_axis}"] = jax.vmap(
                lambda u: lib.psum_scatter(u, "i", scatter_dimension=1, tiled=True), in_axes=vmap_axis
            )(x)
            # jax.lax 0.10 fails (IndexError) to batch an untiled psum_scatter at a batch dim other than 0: its
            # reference moves the batch dim to the front first, jaxccl batches it where it is.
            xs, axis = (jnp.moveaxis(x, vmap_axis, 0), 0) if lib is lax else (x, vmap_axis)
            out[f"scatter vmap={vmap_axis}"] = jax.vmap(lambda u: lib.psum_scatter(u, "i"), in_axes=axis)(xs)
            out[f"psum vmap={vmap_axis}"] = jax.vmap(lambda u: lib.psum(u, "i"), in_axes=vmap_axis)(x)
        return out

    return mesh, ["i"], _smap(mesh, body, P("i"), P("i"), check_vma=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_grid(backend):
    _compare(_vmap_family, backend, _data((64, 8, 8), seed=13))


def test_named_vmap_axes_are_refused_clearly():
    # batching_test's collectives over vmap axis names: jax.lax runs them, jaxccl refuses with a named reason.
    def body(x):
        return jax.vmap(lambda u: jaxccl.psum(u, ("v", "i")), axis_name="v")(x)

    f = jax.shard_map(body, mesh=ONE_AXIS, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(NotImplementedError, match=r"axis 'v' is not a manual axis.*vmap/pmap axes are not supported"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((16, 3), np.float32))


def test_group_communicator_keeps_the_backend_in_scope():
    from jaxccl.runtime import collectives

    with jaxccl.Communicator(ONE_AXIS, "i", backend="ppermute") as comm:
        grouped = collectives._group_communicator("i", 4)
        assert grouped.backend == "ppermute" and grouped.axis_size == 4
        assert collectives._group_communicator("i", 8) is comm


def test_communicator_over_two_axes_runs_a_synthesized_schedule_on_its_topology():
    # One communicator for the pair ("model", "data"): its single group is all 8 devices, rank r = GPU r of the
    # topology (rank order = jax.lax's for that tuple); the emulated links are really used and measured.
    from jaxccl.runtime.emulated import LinkEmulation

    mesh = _mesh((2, 4), ("data", "model"))
    topo = jaxccl.topology.rail(hosts=2, gpus_per_host=4, segments=1, nvlink_gbps=2880, nic_gbps=400)
    comm = jaxccl.Communicator(
        mesh,
        ("model", "data"),
        topology=topo,
        backend="cpu",
        link_emulation=LinkEmulation(time_scale=1e-2, min_window_bytes=0),
    )
    comm.install("all_gather", jaxccl.synth.all_gather(topo))
    assert [[d.id for d in g] for g in comm.group_devices()] == [[0, 4, 1, 5, 2, 6, 3, 7]]

    def program(lib):
        body = lambda v: (lib.all_gather(v, ("model", "data"), tiled=True), lib.psum(v, ("model", "data")))  # noqa: E731
        return _smap(mesh, body, P(("data", "model")), (P(("data", "model")), P()))

    x = _data((8 * 16384,), seed=14)
    want = program(lax)(x)
    with comm:
        got = program(jaxccl)(x)
    _assert_bitwise(got, want)
    matrix = comm.telemetry().matrix
    assert matrix.shape == (8, 8) and np.isfinite(matrix).any()
    comm.close()
