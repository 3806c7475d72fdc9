"""In-place MSCCL XML, as msccl-tools writes it, imported and run out-of-place, bitwise against jax.lax.

msccl-tools' ``ir_to_xml`` writes ``inplace="1"``, no ``outofplace`` attribute,
``i_chunks``/``o_chunks``/``s_chunks`` from what the steps use (so an in-place
AllGather has ``i_chunks="0"``), and names the single in-place buffer through
``i`` and/or ``o`` as its ``get_buffer_index`` does. The programs below are the
classic ring and all-pairs algorithms written that way.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from programs import collective

import jaxccl
from jaxccl.errors import ScheduleError
from jaxccl.schedule import Buffer, from_msccl_xml

N = 4


def _step(k: int, kind: str, src: tuple[str, int] | None, dst: tuple[str, int] | None, dep=(-1, -1)) -> str:
    sb, so = src or ("i", -1)
    db, do = dst or ("o", -1)
    return (
        f'<step s="{k}" type="{kind}" srcbuf="{sb}" srcoff="{so}" dstbuf="{db}" dstoff="{do}" cnt="1" '
        f'depid="{dep[0]}" deps="{dep[1]}" hasdep="0"/>'
    )


def _xml(coll: str, nchunks: int, gpus: list[tuple[dict[str, int], list[tuple[int, int, list[str]]]]]) -> str:
    """``gpus[r] = (chunk counts, [(send, recv, steps)])`` as msccl-tools lays out an ``<algo>``."""
    out = [
        f'<algo name="t" proto="Simple" nchannels="1" nchunksperloop="{nchunks}" ngpus="{N}" coll="{coll}" inplace="1">'
    ]
    for r, (counts, tbs) in enumerate(gpus):
        attrs = " ".join(f'{k}="{v}"' for k, v in counts.items())
        out.append(f'  <gpu id="{r}" {attrs}>')
        for t, (send, recv, steps) in enumerate(tbs):
            out.append(f'    <tb id="{t}" send="{send}" recv="{recv}" chan="0">')
            out += [f"      {s}" for s in steps]
            out.append("    </tb>")
        out.append("  </gpu>")
    out.append("</algo>")
    return "\n".join(out)


def ring_allgather() -> str:
    """Ring AllGather on the output buffer alone (``i[0]`` of rank r is ``o[r]``)."""
    gpus = []
    for r in range(N):
        steps = [_step(0, "s", ("o", r), ("o", r))]
        steps += [_step(k, "rcs", ("o", (r - k) % N), ("o", (r - k) % N)) for k in range(1, N - 1)]
        steps.append(_step(N - 1, "r", ("o", (r + 1) % N), ("o", (r + 1) % N)))
        gpus.append(({"i_chunks": 0, "o_chunks": N, "s_chunks": 0}, [((r + 1) % N, (r - 1) % N, steps)]))
    return _xml("allgather", N, gpus)


def ring_reducescatter() -> str:
    """Ring ReduceScatter on the input buffer alone (``o[0]`` of rank r is ``i[r]``)."""
    gpus = []
    for r in range(N):
        steps = [_step(0, "s", ("i", (r - 1) % N), ("i", (r - 1) % N))]
        steps += [_step(k, "rrs", ("i", (r - 1 - k) % N), ("i", (r - 1 - k) % N)) for k in range(1, N - 1)]
        steps.append(_step(N - 1, "rrc", ("i", r), ("i", r)))
        gpus.append(({"i_chunks": N, "o_chunks": 0, "s_chunks": 0}, [((r + 1) % N, (r - 1) % N, steps)]))
    return _xml("reducescatter", N, gpus)


def ring_allreduce() -> str:
    """Ring AllReduce (reduce-scatter then all-gather around the ring) on the input buffer alone."""
    gpus = []
    for r in range(N):
        steps = [_step(0, "s", ("i", r), ("i", r))]
        steps += [_step(k, "rrs", ("i", (r - k) % N), ("i", (r - k) % N)) for k in range(1, N - 1)]
        steps.append(_step(N - 1, "rrcs", ("i", (r + 1) % N), ("i", (r + 1) % N)))
        steps += [_step(N - 1 + j, "rcs", ("i", (r + 1 - j) % N), ("i", (r + 1 - j) % N)) for j in range(1, N - 1)]
        steps.append(_step(2 * N - 2, "r", ("i", (r + 2) % N), ("i", (r + 2) % N)))
        gpus.append(({"i_chunks": N, "o_chunks": 0, "s_chunks": 0}, [((r + 1) % N, (r - 1) % N, steps)]))
    return _xml("allreduce", N, gpus)


def allpairs_alltoall() -> str:
    """All-pairs AllToAll in place: receives land in scratch, copied into place once sent."""
    gpus = []
    for r in range(N):
        peers = [p for p in range(N) if p != r]
        tbs = [(p, p, [_step(0, "s", ("i", p), ("o", r)), _step(1, "r", ("i", r), ("s", p))]) for p in peers]
        copies = [_step(k, "cpy", ("s", p), ("o", p), dep=(t, 1)) for k, (t, p) in enumerate(enumerate(peers))]
        tbs.append((-1, -1, copies))
        gpus.append(({"i_chunks": N, "o_chunks": N, "s_chunks": N}, tbs))
    return _xml("alltoall", N * 1, gpus)


PROGRAMS = {
    "all_gather": ring_allgather,
    "reduce_scatter": ring_reducescatter,
    "all_reduce": ring_allreduce,
    "all_to_all": allpairs_alltoall,
}


@pytest.mark.parametrize("coll", sorted(PROGRAMS))
def test_in_place_xml_imports_and_validates(coll):
    text = PROGRAMS[coll]()
    assert 'inplace="1"' in text and "outofplace" not in text
    s = from_msccl_xml(text)
    assert s.collective.value == coll and s.info["msccl_inplace"] is True
    s.validate()
    for tbs in s.ranks:  # the input is read only by the added copy; nothing writes it
        for tb in tbs[:-1]:
            assert all(op.dst is not Buffer.INPUT for op in tb.ops)
        assert tbs[-1].ops[0].src is Buffer.INPUT and (tbs[-1].send_peer, tbs[-1].recv_peer) == (-1, -1)


def test_in_place_reference_outside_its_view_is_refused():
    bad = ring_allgather().replace(
        'srcbuf="o" srcoff="0" dstbuf="o" dstoff="0"', 'srcbuf="i" srcoff="2" dstbuf="o" dstoff="0"', 1
    )
    with pytest.raises(ScheduleError, match=r"addresses i\[2:3\], but i reaches 1 chunk"):
        from_msccl_xml(bad)


def test_out_of_place_chunk_counts_still_checked():
    text = ring_allgather().replace(' inplace="1"', ' inplace="0"')
    with pytest.raises(ScheduleError, match='i_chunks=0, but allgather .* must say inplace="1"'):
        from_msccl_xml(text)


@pytest.mark.parametrize("coll", sorted(PROGRAMS))
def test_in_place_programs_run_bitwise_equal_to_lax(coll):
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))
    comm = jaxccl.Communicator(mesh, "d", backend="cpu")
    comm.install(coll, from_msccl_xml(PROGRAMS[coll]()))
    rng = np.random.default_rng(7)
    # Ring reductions add in ring order: integers make every order exact, so jax.lax's result is the reference.
    dtype = np.int32 if coll in ("reduce_scatter", "all_reduce") else np.float32
    x = (
        rng.integers(-1000, 1000, size=(N * N * 24,)) if dtype is np.int32 else rng.standard_normal(N * N * 24)
    ).astype(dtype)
    spec = P("d")

    def run(lib):
        return jax.jit(jax.shard_map(lambda v: collective(lib, coll, v), mesh=mesh, in_specs=spec, out_specs=spec))(x)

    with comm:
        got = np.asarray(run(jaxccl))
    want = np.asarray(run(jax.lax))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
