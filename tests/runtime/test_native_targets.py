"""Which FFI target a native collective calls and which backend ``"auto"`` runs: in one process and across
processes, on CPU and CUDA platforms (the choice is pure Python, checked here without a GPU), and the
target names are the ones the native modules register."""

from __future__ import annotations

import pytest

from jaxccl.runtime import communicator, native
from jaxccl.runtime.native_backend import MULTIPROCESS_TARGETS, TARGETS, auto_backend, target


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_one_process_calls_the_local_target_and_several_the_cross_process_one(backend):
    assert target(backend, 1) == TARGETS[backend] == f"jaxccl_{backend}_collective"
    for processes in (2, 3, 64):
        assert target(backend, processes) == MULTIPROCESS_TARGETS[backend] == f"jaxccl_{backend}_mp_collective"


def test_the_targets_are_what_the_native_modules_register():
    assert {TARGETS["cpu"], MULTIPROCESS_TARGETS["cpu"]} <= set(native.module().registrations())
    cuda = native._cuda_module()
    if cuda is None:
        pytest.skip("no CUDA module is installed (neither jaxccl-cuda12-plugin nor jaxccl._native_cuda)")
    assert set(cuda.registrations()) == {TARGETS["cuda"], MULTIPROCESS_TARGETS["cuda"]}


@pytest.mark.parametrize(
    ("platform", "processes", "native_ok", "cuda", "transport", "expected"),
    [
        ("cpu", 1, True, False, False, "cpu"),
        ("cpu", 2, True, False, False, "ppermute"),  # across processes only with the transport attached
        ("cpu", 2, True, False, True, "cpu"),
        ("cuda", 1, True, True, False, "cuda"),
        ("cuda", 1, True, False, False, "ppermute"),  # no CUDA module, or no GPU visible
        ("cuda", 2, True, True, False, "ppermute"),
        ("cuda", 2, True, True, True, "cuda"),
        ("cuda", 2, True, False, True, "ppermute"),
        ("rocm", 1, True, True, True, "ppermute"),  # no native executor for the platform
        ("cpu", 1, False, False, True, "ppermute"),  # jaxccl._native does not load
        ("cuda", 2, False, True, True, "ppermute"),
    ],
)
def test_auto_runs_the_native_executor_where_it_can(platform, processes, native_ok, cuda, transport, expected):
    got = auto_backend(platform, process_count=processes, native=native_ok, cuda=cuda, transport=transport)
    assert got == expected


def test_auto_in_this_process_follows_the_rule_with_what_is_installed_here():
    comm = communicator.default_communicator("auto_targets_axis", 2)
    assert comm.backend == "auto"
    assert not native.process_groups_attached()  # no transport attached in this test process
    cuda = native.has_cuda_support()
    for platform in ("cpu", "cuda", "rocm"):
        expected = auto_backend(platform, process_count=1, native=True, cuda=cuda, transport=False)
        assert communicator.lowering_backend(comm, platform) == expected
    assert communicator.lowering_backend(comm, "cpu") == "cpu"


def test_a_transport_counts_as_attached_from_attach_to_detach():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxccl.distributed.transport import ProcessTransport, attach, detach

    with ProcessTransport(0, 2) as t:  # a job of 2 processes whose mesh runs every rank in process 0
        attach(t, Mesh(np.array(jax.devices()), ("d",)), "d")
        try:
            assert native.process_groups_attached()
        finally:
            detach()
    assert not native.process_groups_attached()
