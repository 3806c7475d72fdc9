"""One set of measurement counters for both backends: the mapping of each native module's stats dict.

The CUDA module cannot run here, so its mapping is checked with a dict of exactly the keys its
``measure_stats()`` builds, read from ``kernels/cuda_module.cc`` itself: a key added, renamed or
removed there fails these tests until :data:`jaxccl.telemetry.stats.CUDA_STATS_KEYS` follows. The CPU
module's keys are read from ``xla_ffi/bindings/native_module.cc`` the same way (its real dicts are
in ``tests/runtime/test_measurement_api.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from jaxccl.errors import ExecutorError
from jaxccl.telemetry import MeasurementStats, from_cpu_stats, from_cuda_stats
from jaxccl.telemetry.stats import CPU_STATS_KEYS, CUDA_STATS_KEYS, dropped_since

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEY = re.compile(r'd\["(\w+)"\]\s*=')


def _function_keys(source: str, name: str) -> set[str]:
    """The keys a nanobind ``m.def(name, ...)`` stores into its dict ``d`` (through ``PutSettings`` too)."""
    start = source.index(f'"{name}"')
    end = source.find("m.def(", start)
    body = source[start : end if end >= 0 else len(source)]
    keys = set(KEY.findall(body))
    if "PutSettings(d," in body:
        helper = source[source.index("void PutSettings(") :]
        keys |= set(KEY.findall(helper[: helper.index("\n}")]))
    return keys


def test_the_cuda_keys_are_those_cuda_module_builds():
    source = (ROOT / "kernels" / "cuda_module.cc").read_text()
    assert _function_keys(source, "measure_stats") == CUDA_STATS_KEYS


def test_the_cpu_keys_are_those_native_module_builds():
    source = (ROOT / "xla_ffi" / "bindings" / "native_module.cc").read_text()
    assert _function_keys(source, "measure_stats") == CPU_STATS_KEYS


def _cuda_raw(**changes):
    """A dict as ``_native_cuda.measure_stats()`` returns it (its types: settings, then int counters)."""
    raw = {
        "enabled": True,
        "host_of_rank": [0, 0, 1, 1],
        "intra_threshold": 1,
        "inter_threshold": 1,
        "slots_per_tb": 8,
        "min_window_bytes": 32 << 10,
        "windows": 40,
        "records": 31,
        "dropped": 6,
        "drained": 20,
        "pending": 3,
        "buffers": 2,
        "regions": 8,
        "slots": 64,
        "used": 8,
        "accumulator_bytes": 320,
        "cache_entry_bytes": 24,
        "cache_entries_per_tb": 16,
        "cache_bytes": 3072,
        "buffer_bytes": 2048,
        "counter_bytes": 256,
    }
    assert set(raw) == CUDA_STATS_KEYS
    raw.update(changes)
    return raw


def _cpu_raw(**changes):
    raw = {
        "windows": 40,
        "records": 31,
        "dropped": 6,
        "regions": 8,
        "slots": 64,
        "used": 8,
        "accumulator_bytes": 320,
        "cache_entry_bytes": 24,
        "cache_entries_per_tb": 16,
        "buffer_bytes": 2048,
    }
    assert set(raw) == CPU_STATS_KEYS
    raw.update(changes)
    return raw


def test_both_backends_give_the_same_fields_with_the_same_meaning():
    cuda, cpu = from_cuda_stats(_cuda_raw()), from_cpu_stats(_cpu_raw())
    assert type(cuda) is type(cpu) is MeasurementStats
    assert (cuda.backend, cuda.scope, cpu.backend, cpu.scope) == ("cuda", "process", "cpu", "network")
    common = ("windows", "records", "regions", "slots", "used", "accumulator_bytes", "buffer_bytes")
    assert [getattr(cuda, k) for k in common] == [40, 31, 8, 64, 8, 320, 2048]
    assert [getattr(cpu, k) for k in common] == [40, 31, 8, 64, 8, 320, 2048]
    assert (cuda.cache_entry_bytes, cuda.cache_entries_per_tb) == (cpu.cache_entry_bytes, cpu.cache_entries_per_tb)
    # records held on the host from reallocated CUDA buffers wait for the next drain beside the used slots
    assert (cuda.pending, cuda.undrained) == (3, 11)
    assert (cpu.pending, cpu.undrained) == (0, 8)
    assert all(isinstance(v, int) for k, v in dataclasses.asdict(cuda).items() if k not in ("backend", "scope"))


@pytest.mark.parametrize("convert,raw", [(from_cpu_stats, _cpu_raw), (from_cuda_stats, _cuda_raw)])
def test_dropped_counts_since_the_previous_reading_on_both(convert, raw):
    first = convert(raw(dropped=6))
    assert (first.dropped, first.dropped_total) == (6, 6)
    second = convert(raw(dropped=6), dropped_before=first.dropped_total)
    assert (second.dropped, second.dropped_total) == (0, 6)
    third = convert(raw(dropped=10), dropped_before=second.dropped_total)
    assert (third.dropped, third.dropped_total) == (4, 10)
    after_reset = convert(raw(dropped=2), dropped_before=third.dropped_total)  # the counters restarted
    assert (after_reset.dropped, after_reset.dropped_total) == (2, 2)


def test_dropped_since():
    assert [dropped_since(t, b) for t, b in [(0, 0), (5, 0), (5, 5), (9, 5), (1, 5)]] == [0, 5, 0, 4, 1]


@pytest.mark.parametrize(
    "convert,raw,source", [(from_cpu_stats, _cpu_raw, "_native."), (from_cuda_stats, _cuda_raw, "_native_cuda.")]
)
def test_a_missing_key_names_it(convert, raw, source):
    broken = raw()
    del broken["used"]
    with pytest.raises(ExecutorError, match=rf"{re.escape(source)}measure_stats returned no used"):
        convert(broken)
