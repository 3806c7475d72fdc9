"""The error types: one type for a bad option value, TuneError's home, keyword-only synthesis options."""

from __future__ import annotations

import numpy as np
import pytest

import jaxccl
from jaxccl.errors import JaxcclError, OptionError, TuneError
from jaxccl.topology import rail, ring


def _option_calls():
    from jaxccl import sim
    from jaxccl.sim.routes import Router
    from jaxccl.synth import allgather, alltoall, reduce_scatter, ring_allgather
    from jaxccl.synth.alltoall.network import build_network
    from jaxccl.synth.alltoall.pricing import shortest_path_trees

    topo = rail(hosts=2, gpus_per_host=2)
    net = build_network(ring(4))
    from jaxccl.tune.react.executor import trace_measurement
    from jaxccl.tune.react.model import FlowHistory

    trace = np.zeros(0)
    return {
        "unknown": [lambda v: FlowHistory(unknown=v)],
        "end": [
            lambda v: trace_measurement(
                trace, ring_allgather(4), time_scale=1.0, topology=ring(4), output_bytes=1.0, end=v
            )
        ],
        "method": [
            lambda v: allgather(topo, method=v),
            lambda v: reduce_scatter(topo, method=v),
            lambda v: shortest_path_trees(net, np.ones(net.num_arcs), method=v),
        ],
        "pricing": [lambda v: alltoall(topo, pricing=v)],
        "routing": [
            lambda v: Router(topo, v),
            lambda v: sim.run(topo, ring_allgather(topo), 1 << 20, routing=v),
        ],
    }


@pytest.mark.parametrize("option", ["method", "pricing", "routing", "unknown", "end"])
def test_a_bad_option_value_is_one_error_type_naming_the_choices(option):
    for call in _option_calls()[option]:
        with pytest.raises(OptionError, match=rf"^{option}='bogus' is not one of '") as info:
            call("bogus")
        assert isinstance(info.value, ValueError) and isinstance(info.value, JaxcclError)
        with pytest.raises(OptionError, match=rf"^{option}=3 is not one of"):
            call(3)


def test_option_check_returns_valid_values():
    assert OptionError.check("method", "latency", ("forestcoll", "latency")) == "latency"
    assert OptionError.check("pricing", None, ("dag",), allow_none=True) is None
    with pytest.raises(OptionError, match=r"pricing=None is not one of 'dag'$"):
        OptionError.check("pricing", None, ("dag",))
    with pytest.raises(OptionError, match="is not one of"):
        OptionError.check("method", ["dag"], ("dag",))  # unhashable: still the named error


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
    from jaxccl.synth import allgather, alltoall

    topo = rail(hosts=2, gpus_per_host=2)
    with pytest.raises(TypeError):
        alltoall(topo, None, 4)  # max_chunks must be named
    with pytest.raises(TypeError):
        allgather(topo, None, "latency")  # method must be named
    base = alltoall(topo, max_chunks=2)
    assert alltoall(topo, base).info["warm_mode"] == "kept"  # previous= may stay positional, as allgather's


def test_emulate_lives_in_devices():
    from jaxccl.devices import emulate

    assert jaxccl.emulate is emulate
    with pytest.raises(ValueError, match="positive integer"):
        emulate(0)
