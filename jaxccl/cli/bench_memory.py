"""What a ``jaxccl bench`` run will hold in memory, estimated before JAX starts or anything is allocated.

The bench measures one (collective, size) point at a time (:mod:`jaxccl.cli.bench_run`) and frees
its buffers before the next, so a run needs what its largest point needs, plus the runtime.
At one point each device holds (``in``/``out``: one rank's input and output bytes):

- its input twice: the NumPy shard drawn on the host and the device buffer made from it;
- jaxccl's output and ``jax.lax``'s output (both alive for the bitwise check), and one more
  output's worth for the executors' and XLA's temporaries: ``2 * in + 3 * out``;
- for float16 and bfloat16, ``2 * (in + out)`` more: a float32-sized copy of both (measured: 2 to 3.5
  buffers per device more than float32 at the same size; XLA:CPU widens 16-bit floats to float32).

One shard at a time also needs the sampling's temporaries (float64/int64 draws: 16 bytes an
element, 64 for complex numbers) and the check's (host copies of both outputs and their byte
comparison: ``3 * out + out elements``). On a CPU backend every device is this process's memory.
The runtime (JAX, XLA, the compiled programs and the schedules' tables, which grow with the
square of the rank count) is :func:`runtime_bytes`, measured on 8 to 128 emulated devices.
Measured peaks (8 devices, 64 and 128 MiB, float32, bfloat16, int8) are 0.45 to 0.8 of the estimate.

A run whose estimate exceeds ``MEMORY_MARGIN`` of ``MemAvailable`` (``/proc/meminfo``) is
refused with :class:`~jaxccl.errors.UsageError` (exit status 2), naming the estimate, what is
available and the largest ``-e`` that fits; so is an emulation of more than ``MAX_DEVICES``
devices in one process, whatever the memory (each device is also XLA threads: ``PJRT_NPROC``
is twice the device count).

Example:
    >>> human(5 << 30), human(1536)
    ('5 GiB', '1.5 KiB')
    >>> point_bytes("all_to_all", 64 << 20, dtype="float32", local_devices=8, num_ranks=8) >> 20
    3024
    >>> check_memory(("psum",), [4096], "float32", local_devices=8, num_ranks=8, available=64 << 30)
    >>> check_memory(("psum",), [1 << 40], "float32", local_devices=8, num_ranks=8, available=64 << 30)
    Traceback (most recent call last):
    ...
    jaxccl.errors.UsageError: the run needs about 47.3 TiB of memory ...
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxccl.cli.args import UsageError
from jaxccl.cli.bench_sweep import buffer_elements, input_elements

__all__ = [
    "MAX_DEVICES",
    "MEMORY_MARGIN",
    "available_bytes",
    "check_devices",
    "check_memory",
    "human",
    "point_bytes",
    "runtime_bytes",
]

MAX_DEVICES = 1024
MEMORY_MARGIN = 0.85  # of MemAvailable: the rest stays for the page cache, the kernel and the estimate's error
RUNTIME_BYTES = 320 << 20  # Python, JAX and XLA with 8 devices and nothing allocated: about 270 MiB measured
DEVICE_BYTES = 1 << 20  # per emulated device: its XLA client state and threads
DEVICE_PAIR_BYTES = 160 << 10  # per pair of ranks: compiled programs and schedule tables (90-165 KiB measured)
SAMPLE_BYTES = 16  # per input element of the shard being drawn (float64 or int64 draws, then the cast)
COMPLEX_SAMPLE_BYTES = 64  # complex: real and imaginary draws, complex128 sums, then the cast
HALF_FLOATS = ("float16", "bfloat16")
MEMINFO = "/proc/meminfo"


def human(nbytes: float) -> str:
    """``nbytes`` in binary units, three significant digits.

    >>> human(3 << 40), human(123)
    ('3 TiB', '123 B')
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _itemsize(dtype: str) -> int:
    import ml_dtypes
    import numpy as np

    return int(np.dtype(ml_dtypes.bfloat16).itemsize if dtype == "bfloat16" else np.dtype(dtype).itemsize)


def _out_itemsize(collective: str, dtype: str, itemsize: int) -> int:
    """Bytes of an output element: ``pmean`` of integers or bool is a float; ``psum`` of bool an int32."""
    widened = collective == "pmean" and (dtype == "bool" or dtype.startswith(("int", "uint")))
    if widened or (collective == "psum" and dtype == "bool"):
        return max(itemsize, 4)
    return itemsize


def point_bytes(collective: str, size: int, *, dtype: str, local_devices: int, num_ranks: int) -> int:
    """Bytes this process holds at once while measuring ``collective`` at ``size`` (0 for a skipped size).

    Args:
        collective: one of :data:`jaxccl.cli.bench_sweep.COLLECTIVES`.
        size: the requested size (bytes of one rank's larger buffer).
        dtype: the element type's name.
        local_devices: the devices of this process (their buffers are its memory on a CPU backend).
        num_ranks: the devices of the whole job (they set the buffer sizes).
    """
    itemsize = _itemsize(dtype)
    count = buffer_elements(collective, size, num_ranks=num_ranks, itemsize=itemsize)
    if count == 0:
        return 0
    in_elems = input_elements(collective, count, num_ranks)
    out_elems = count // num_ranks if collective == "psum_scatter" else count
    in_bytes, out_bytes = in_elems * itemsize, out_elems * _out_itemsize(collective, dtype, itemsize)
    per_device = 2 * in_bytes + 3 * out_bytes
    if dtype in HALF_FLOATS:  # a float32-sized copy of each buffer (measured; see the module docstring)
        per_device += 2 * (in_bytes + out_bytes)
    sample = in_elems * (COMPLEX_SAMPLE_BYTES if dtype.startswith("complex") else SAMPLE_BYTES)
    return local_devices * per_device + sample + 3 * out_bytes + out_elems


def runtime_bytes(local_devices: int, num_ranks: int) -> int:
    """Bytes of the runtime with ``local_devices`` emulated devices in a job of ``num_ranks``, before any buffer.

    >>> human(runtime_bytes(8, 8)), human(runtime_bytes(1024, 1024))
    ('338 MiB', '161 GiB')
    """
    return RUNTIME_BYTES + local_devices * DEVICE_BYTES + num_ranks * num_ranks * DEVICE_PAIR_BYTES


def available_bytes(path: str = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; ``None`` where the file or the line is missing.

    >>> available_bytes("/no/such/meminfo") is None
    True
    """
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    value, _, unit = rest.strip().partition(" ")
                    return int(value) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def check_devices(devices: int) -> None:
    """Refuses to emulate more than :data:`MAX_DEVICES` devices in one process.

    >>> check_devices(100_000)
    Traceback (most recent call last):
    ...
    jaxccl.errors.UsageError: --devices 100000: jaxccl bench emulates at most 1024 devices per process ...
    """
    if devices > MAX_DEVICES:
        raise UsageError(
            f"--devices {devices}: jaxccl bench emulates at most {MAX_DEVICES} devices per process (each costs "
            f"memory and XLA threads, and the schedules grow with the square of the count: about "
            f"{human(runtime_bytes(devices, devices))} before any buffer); use fewer, or several processes"
        )


def check_memory(
    collectives: Sequence[str],
    sizes: Sequence[int],
    dtype: str,
    *,
    local_devices: int,
    num_ranks: int,
    processes_here: int = 1,
    available: int | None = None,
) -> None:
    """Refuses a run whose largest point needs more memory than this machine has available.

    Args:
        collectives: the collectives measured.
        sizes: the sweep's sizes (bytes).
        dtype: the element type's name.
        local_devices: devices of each process.
        num_ranks: devices of the whole job.
        processes_here: processes of the job on this machine (``--processes P`` starts them all here).
        available: bytes available; ``None`` reads ``MemAvailable`` (no check where it cannot be read).

    Raises:
        UsageError: naming the estimate, the point that needs it, what is available, and the largest
            ``-e`` that fits (or that the runtime alone does not fit: fewer devices or processes).
    """
    if available is None:
        available = available_bytes()
        if available is None:
            return
    budget = int(available * MEMORY_MARGIN)
    runtime = runtime_bytes(local_devices, num_ranks)

    def need(size: int) -> tuple[int, int, str]:
        data = {
            c: point_bytes(c, size, dtype=dtype, local_devices=local_devices, num_ranks=num_ranks) for c in collectives
        }
        worst = max(data, key=data.__getitem__)
        return processes_here * (runtime + data[worst]), data[worst], worst

    total, data, worst = need(max(sizes))
    if total <= budget:
        return
    each = " each" if processes_here > 1 else ""
    head = (
        f"the run needs about {human(total)} of memory "
        f"({f'{processes_here} processes of ' if processes_here > 1 else ''}{local_devices} devices: "
        f"{human(runtime)} for the runtime and {human(data)} at its largest point{each}, {worst} of "
        f"{human(max(sizes))} {dtype}: inputs, outputs and jax.lax's buffers of every device), but "
        f"{human(available)} is available (MemAvailable; the bench uses at most {MEMORY_MARGIN:.0%} of it)"
    )
    fitting = [s for s in sizes if need(s)[0] <= budget]
    if fitting:
        raise UsageError(f"{head}: lower -e/--max-bytes to {max(fitting)} ({human(max(fitting))}) or less")
    raise UsageError(f"{head}: use fewer devices or processes, or smaller sizes")
