"""The error types: every exception class in jaxccl/errors.py, every raise a named one, one rule for options."""

from __future__ import annotations

import ast
import builtins
import importlib
import pathlib
import warnings

import numpy as np
import pytest

import jaxccl
from jaxccl import errors
from jaxccl.errors import ArgumentError, JaxcclError, OptionError, TuneError
from jaxccl.topology import rail, ring
from jaxccl.util.options import choose, renamed

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxccl"


def _option_calls():
    import jax
    from jax.sharding import Mesh

    from jaxccl import sim
    from jaxccl.cli.bench_sweep import bus_factor
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.sim.experiments import fig8
    from jaxccl.sim.routes import Router
    from jaxccl.synth import all_gather, all_to_all, reduce_scatter, ring_allgather
    from jaxccl.synth.alltoall import cflp_bound
    from jaxccl.synth.alltoall.network import build_network
    from jaxccl.synth.alltoall.pricing import shortest_path_trees
    from jaxccl.synth.nccl import nccl_allreduce
    from jaxccl.tune.react.executor import trace_measurement
    from jaxccl.tune.react.model import FlowHistory

    topo = rail(hosts=2, gpus_per_host=2)
    net = build_network(ring(4))
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    trace = np.zeros(0)
    schedule = ring_allgather(topo)
    return {
        "unknown": [lambda v: FlowHistory(unknown=v)],
        "end": [
            lambda v: trace_measurement(
                trace, ring_allgather(4), time_scale=1.0, topology=ring(4), output_bytes=1.0, end=v
            )
        ],
        "method": [
            lambda v: all_gather(topo, method=v),
            lambda v: reduce_scatter(topo, method=v),
            lambda v: all_to_all(topo, method=v),
            lambda v: nccl_allreduce(topo, method=v),
            lambda v: shortest_path_trees(net, np.ones(net.num_arcs), method=v),
        ],
        "routing": [
            lambda v: Router(topo, v),
            lambda v: sim.run(topo, schedule, 1 << 20, routing=v),
        ],
        "execution": [
            lambda v: sim.run(topo, schedule, 1 << 20, execution=v),
            lambda v: fig8(quick=True, execution=v, show_progress=False),
        ],
        "sharing": [lambda v: sim.run(topo, schedule, 1 << 20, sharing=v)],
        "backend": [lambda v: jaxccl.Communicator(mesh, "i", backend=v)],
        "to": [lambda v: jaxccl.all_gather(np.zeros(4), "i", to=v)],
        "timestamps": [lambda v: LinkEmulation(timestamps=v)],
        "per": [lambda v: cflp_bound(topo, per=v)],
        "collective": [lambda v: bus_factor(v, 4)],
    }


OPTIONS = ["method", "routing", "execution", "sharing", "backend", "to", "timestamps", "per", "unknown", "end"]


@pytest.mark.parametrize("option", [*OPTIONS, "collective"])
def test_a_bad_option_value_is_one_error_type_naming_the_choices(option):
    for call in _option_calls()[option]:
        with pytest.raises(OptionError, match=rf"^{option}='bogus' is not one of '") as info:
            call("bogus")
        assert isinstance(info.value, ValueError) and isinstance(info.value, JaxcclError)
        with pytest.raises(OptionError, match=rf"^{option}=3 is not one of"):
            call(3)


def test_choose_returns_valid_values_and_names_every_choice():
    assert choose("method", "latency", ("forestcoll", "latency")) == "latency"
    assert choose("pricing", None, ("dag",), allow_none=True) is None
    with pytest.raises(OptionError, match=r"^pricing=None is not one of 'dag'$"):
        choose("pricing", None, ("dag",))
    with pytest.raises(OptionError, match=r"^method=\['dag'\] is not one of 'dag', 'ring' or None$"):
        choose("method", ["dag"], ("dag", "ring"), allow_none=True)  # unhashable: still the named error
    with pytest.warns(DeprecationWarning, match="OptionError.check is deprecated"):
        assert OptionError.check("method", "ring", ("ring",)) == "ring"


def test_renamed_keywords_warn_and_still_work():
    from jaxccl.sim.experiments import fig8
    from jaxccl.synth import all_to_all
    from jaxccl.synth.nccl import nccl_allreduce

    topo = rail(hosts=2, gpus_per_host=2)
    with pytest.warns(DeprecationWarning, match=r"nccl_allreduce\(algorithm=...\) is deprecated: use method="):
        old = nccl_allreduce(topo, algorithm="tree")
    assert old == nccl_allreduce(topo, method="tree")
    with pytest.warns(DeprecationWarning, match=r"alltoall\(pricing=...\)"):
        assert all_to_all(topo, pricing="dag").info["gap_pct"] == all_to_all(topo, method="dag").info["gap_pct"]
    with (
        pytest.warns(DeprecationWarning, match=r"fig8\(exec_model=...\)"),
        pytest.raises(OptionError, match="^execution="),
    ):
        fig8(exec_model="sideways", show_progress=False)
    with pytest.warns(DeprecationWarning), pytest.raises(ArgumentError, match="not both"):
        nccl_allreduce(topo, method="tree", algorithm="ring")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed("f", "old", None, "new", "x", "y") == "x"  # the old keyword unused: no warning


def test_synth_spells_the_collectives_and_keeps_the_old_names_and_subpackages():
    import jaxccl.synth
    import jaxccl.synth.allgather.driver  # noqa: F401 - the subpackage's modules still import
    from jaxccl.synth.allgather import allgather as subpackage_allgather
    from jaxccl.synth.alltoall import decode_paths

    synth = jaxccl.synth
    assert {"all_gather", "all_to_all", "reduce_scatter"} <= set(synth.__all__)
    assert not {"allgather", "alltoall"} & set(synth.__all__)
    assert synth.all_gather is subpackage_allgather and callable(decode_paths)
    subpackage = importlib.import_module("jaxccl.synth.allgather")
    assert subpackage.driver is importlib.import_module("jaxccl.synth.allgather.driver")
    assert callable(synth.allgather)  # the name is the (deprecated) function, as before
    topo = rail(hosts=2, gpus_per_host=2)
    for old, new in [("allgather", "all_gather"), ("alltoall", "all_to_all")]:
        with pytest.warns(DeprecationWarning, match=rf"^jaxccl.synth.{old} is deprecated: use jaxccl.synth.{new} "):
            via_old = getattr(synth, old)(topo)
        assert via_old.digest == getattr(synth, new)(topo).digest


def test_tune_error_lives_in_errors_and_keeps_its_old_paths():
    from jaxccl.tune import TuneError as from_tune
    from jaxccl.tune.arms import TuneError as from_arms

    assert from_tune is from_arms is TuneError is jaxccl.TuneError
    assert "TuneError" in jaxccl.__all__ and "OptionError" in jaxccl.__all__
    assert issubclass(TuneError, JaxcclError) and issubclass(TuneError, ValueError)
    from jaxccl.tune.arms import Context

    with pytest.raises(TuneError, match="unknown collective"):
        Context("broadcast", 4, 1024)


def test_synthesis_options_are_keyword_only():
    from jaxccl.synth import all_gather, all_to_all

    topo = rail(hosts=2, gpus_per_host=2)
    with pytest.raises(TypeError):
        all_to_all(topo, None, 4)  # max_chunks must be named
    with pytest.raises(TypeError):
        all_gather(topo, None, "latency")  # method must be named
    base = all_to_all(topo, max_chunks=2)
    assert all_to_all(topo, base).info["warm_mode"] == "kept"  # previous= may stay positional, as allgather's


def test_emulate_lives_in_devices():
    from jaxccl.devices import emulate

    assert jaxccl.emulate is emulate
    with pytest.raises(ValueError, match="positive integer"):
        emulate(0)


# ----------------------------------------------------------------------------- one sample per package
def _samples():
    """A call per package that gets bad input, and the named error it must raise."""
    import jax
    from jax.sharding import Mesh

    from jaxccl.cli.args import positive_int
    from jaxccl.cli.bench_sweep import sweep
    from jaxccl.control.algorithm1 import check, profile
    from jaxccl.demos.network_layout import check_processes
    from jaxccl.distributed.transport import process_groups
    from jaxccl.labs.drill import DrillConfig, run_drill
    from jaxccl.runtime.emulated import LinkEmulation
    from jaxccl.schedule.interpreter import evaluate
    from jaxccl.sim import run as sim_run
    from jaxccl.sim.workloads import WORKLOADS
    from jaxccl.synth import all_to_all, ring_allgather
    from jaxccl.telemetry import TelemetryCollector
    from jaxccl.tune.react.detect import detect_congestion
    from jaxccl.util.report import timed_runs

    topo = rail(hosts=2, gpus_per_host=2)
    mesh = Mesh(np.array(jax.devices()[:4]), ("i",))
    workload = next(iter(WORKLOADS.values()))
    return {
        "topology": (lambda: topo.scaled(0), errors.TopologyError),
        "schedule": (lambda: evaluate(ring_allgather(4), [np.zeros(4)]), errors.ArgumentError),
        "synth": (lambda: all_to_all(topo, reuse_tolerance=2), errors.SynthesisError),
        "sim": (lambda: sim_run(topo, ring_allgather(topo), 1 << 20, pipeline_bytes=-1), errors.ArgumentError),
        "sim workloads": (lambda: workload.group_size("XY", 64), errors.ArgumentError),
        "telemetry": (lambda: TelemetryCollector(4, alpha=0), errors.ArgumentError),
        "runtime": (lambda: LinkEmulation(time_scale=5), errors.ArgumentError),
        "runtime collectives": (lambda: jaxccl.psum(np.ones(2), "nope"), errors.UnboundAxisError),
        "runtime communicator": (lambda: jaxccl.Communicator(mesh, "j"), errors.ArgumentError),
        "devices": (lambda: jaxccl.emulate(0), errors.ArgumentError),
        "distributed": (lambda: process_groups(mesh, "j"), errors.ExecutorError),
        "control": (lambda: check(profile(ring_allgather(topo), topo), {}, gamma=-1), errors.ArgumentError),
        "tune": (lambda: detect_congestion(np.ones((2, 3)), sizes=np.ones(2), degrees=np.ones(3)), errors.TuneError),
        "labs": (lambda: run_drill(DrillConfig(victim=0)), errors.ArgumentError),
        "demos": (lambda: check_processes("netns", 3), errors.DemoNetworkError),
        "cli": (lambda: positive_int("0"), errors.UsageError),
        "cli sweep": (lambda: sweep(1 << 20, 1, 2), errors.UsageError),
        "util": (lambda: timed_runs(lambda: None, 0, float), errors.ArgumentError),
    }


@pytest.mark.parametrize(
    "package",
    [
        "topology", "schedule", "synth", "sim", "sim workloads", "telemetry", "runtime", "runtime collectives",
        "runtime communicator", "devices", "distributed", "control", "tune", "labs", "demos", "cli", "cli sweep",
        "util",
    ],
)  # fmt: skip
def test_each_package_raises_a_named_error(package):
    call, kind = _samples()[package]
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, JaxcclError)
    assert type(info.value).__module__ == "jaxccl.errors"


def test_named_errors_keep_the_builtin_types_callers_catch():
    assert issubclass(errors.ArgumentError, ValueError)
    assert issubclass(errors.UnsupportedTypeError, TypeError) and issubclass(errors.UnsupportedTypeError, ValueError)
    assert issubclass(errors.UnboundAxisError, NameError)  # as jax.lax's unbound axis name
    assert issubclass(errors.UnsupportedError, NotImplementedError)
    assert issubclass(errors.ContextError, RuntimeError) and issubclass(errors.SimulationError, RuntimeError)
    import argparse

    assert issubclass(errors.UsageError, argparse.ArgumentTypeError) and issubclass(errors.UsageError, ValueError)
    for name in ("OptionError", "TransportArgumentError", "UsageError", "UnsupportedTypeError", "UnboundAxisError"):
        assert issubclass(getattr(errors, name), errors.ArgumentError)


def test_moved_error_classes_keep_their_old_import_paths():
    from jaxccl.cli.args import UsageError
    from jaxccl.demos.network_layout import DemoNetworkError
    from jaxccl.distributed.transport import TransportArgumentError
    from jaxccl.labs.netlab.commands import NetlabError

    assert UsageError is errors.UsageError and DemoNetworkError is errors.DemoNetworkError
    assert TransportArgumentError is errors.TransportArgumentError and NetlabError is errors.NetlabError


# ----------------------------------------------------------------------------- the source scans
# Built-in exceptions jaxccl may still raise, each for a reason that is not bad input:
ALLOWED_ANYWHERE = {
    "AssertionError",  # an internal assertion of an impossible state (a bug in jaxccl, never bad input)
}
ALLOWED = {
    # a module's __getattr__ must raise AttributeError (hasattr/getattr protocol)
    ("jaxccl/__init__.py", "AttributeError"): 1,
    ("jaxccl/runtime/communicator.py", "AttributeError"): 1,
    # import time: `import` guards (jaxccl.has_cuda_support, optional paths) catch ImportError
    ("jaxccl/runtime/native.py", "ImportError"): 1,
    # a script's exit status (python -m jaxccl.labs.netlab.probe)
    ("jaxccl/labs/netlab/probe.py", "SystemExit"): 1,
    # control flow: _quick_int sends its caller to the slow path, which raises ScheduleError
    ("jaxccl/schedule/msccl_xml.py", "ValueError"): 1,
    # the XML guards raise the calling reader's own error class (a jaxccl.errors class it passes in)
    ("jaxccl/util/safe_xml.py", "self._error"): 1,
    # abstract methods
    ("jaxccl/tune/bandits/estimators.py", "NotImplementedError"): 1,
    ("jaxccl/tune/bandits/policies.py", "NotImplementedError"): 1,
}
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _raised_name(node: ast.Raise) -> str | None:
    exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
    if isinstance(exc, ast.Name):
        return exc.id
    if isinstance(exc, ast.Attribute):
        return ast.unparse(exc)
    return None


def test_no_raise_of_a_builtin_exception_outside_the_allowlist():
    found: dict[tuple[str, str], list[int]] = {}
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            name = _raised_name(node)
            if name is None or name in ALLOWED_ANYWHERE:
                continue
            last = name.rsplit(".", 1)[-1]
            if "." in name and last in vars(errors):
                continue  # errors.OptionError(...)
            if name in BUILTIN_EXCEPTIONS or "." in name:
                found.setdefault((rel, name), []).append(node.lineno)
    unexpected = {k: v for k, v in found.items() if len(v) > ALLOWED.get(k, 0)}
    assert not unexpected, f"raise a jaxccl.errors class instead (or extend the commented allowlist): {unexpected}"
    stale = {k for k in ALLOWED if k not in found}
    assert not stale, f"allowlist entries that no longer match a raise: {stale}"


def test_every_exception_class_of_jaxccl_is_defined_in_errors():
    exceptions = set(BUILTIN_EXCEPTIONS) | {"ArgumentTypeError"}  # argparse's
    trees = list(_sources())
    defined: dict[str, str] = {}
    changed = True
    while changed:  # classes derived from jaxccl's own exception classes, to a fixed point
        changed = False
        for rel, tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in defined:
                    bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                    if bases & exceptions:
                        defined[node.name] = rel
                        exceptions.add(node.name)
                        changed = True
    elsewhere = {name: rel for name, rel in defined.items() if rel != "jaxccl/errors.py"}
    assert not elsewhere, f"exception classes outside jaxccl/errors.py: {elsewhere}"
    public = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, JaxcclError)}
    assert set(defined) == public
