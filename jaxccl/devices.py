"""Emulating N JAX devices on one CPU."""

from __future__ import annotations

import os
import re
import sys

from jaxccl.errors import ArgumentError, ContextError

_FLAG = "--xla_force_host_platform_device_count"


def emulate(num_devices: int) -> None:
    """Makes JAX's CPU backend expose ``num_devices`` devices; call before JAX starts.

    Sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` and
    ``PJRT_NPROC=2*num_devices`` (XLA:CPU deadlocks with more than 32
    in-flight steps with collectives otherwise). Calling it again with the
    same count is a no-op. If JAX's backend is already running with another
    device count, raises :class:`~jaxccl.errors.ContextError` (a ``RuntimeError``): restart the process and call
    ``emulate`` first.

    Example:
        >>> import jaxccl
        >>> jaxccl.emulate(8)  # doctest: +SKIP
        >>> import jax; jax.device_count()  # doctest: +SKIP
        8
    """
    if not isinstance(num_devices, int) or isinstance(num_devices, bool) or num_devices < 1:
        raise ArgumentError(f"emulate(): num_devices must be a positive integer, got {num_devices!r}")
    running = _running_cpu_device_count()
    if running is not None:
        if running != num_devices:
            raise ContextError(
                f"emulate({num_devices}): JAX's CPU backend is already initialized with {running} device(s); "
                "call jaxccl.emulate() before anything touches jax.devices() (restart the process)"
            )
        return
    flags = re.sub(rf"{_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={num_devices}".strip()
    os.environ["PJRT_NPROC"] = str(2 * num_devices)


def _running_cpu_device_count() -> int | None:
    """The CPU device count if JAX's backends are already initialized, else None."""
    if "jax" not in sys.modules:
        return None
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of future jax versions
        return None
    if not xla_bridge.backends_are_initialized():
        return None
    import jax

    return len(jax.devices("cpu"))
