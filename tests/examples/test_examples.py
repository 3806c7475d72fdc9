"""The examples: examples/transformer.py through jax.lax and jaxccl.offload, bitwise; every example runs as a script."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxccl

_PATH = pathlib.Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
_spec = importlib.util.spec_from_file_location("transformer_example", _PATH)
T = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = T  # its dataclass looks its module up there
_spec.loader.exec_module(T)

STEPS = 8


@pytest.fixture(scope="module")
def reference():
    return T.train(T.Config(), STEPS, via="lax")


def _primitive_names(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitive_names(getattr(sub, "jaxpr", sub))
    return names


@pytest.mark.parametrize("backend", ["cpu", "ppermute"])
def test_loss_curve_and_weights_bitwise_equal(reference, backend):
    # On the ppermute backend this holds because every collective is bracketed by identity ppermutes
    # (jaxccl/runtime/primitives.py); without them XLA:CPU fused the tail of a psum's schedule into the
    # backward pass of the RMS norms and summed their rows in another order (test_ppermute_whole_step.py).
    ref_losses, ref_params, _ = reference
    losses, params, _ = T.train(T.Config(), STEPS, via="jaxccl", backend=backend)
    assert T.bitwise_equal(losses, ref_losses)
    assert T.bitwise_equal(params, ref_params)
    assert losses[-1] < losses[0] - 0.3  # it learns


def test_every_collective_of_the_step_runs_through_jaxccl():
    cfg = T.Config()
    mesh = T.make_mesh(cfg)
    step = T.make_step(cfg, mesh)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), T.param_shapes(cfg), is_leaf=_is_shape)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), np.int32)
    before = _primitive_names(jax.make_jaxpr(step)(shapes, tokens).jaxpr)
    after = _primitive_names(jax.make_jaxpr(jaxccl.offload(step))(shapes, tokens).jaxpr)
    lax_collectives = {"psum", "psum_invariant", "all_gather", "reduce_scatter", "all_to_all"}
    assert {"psum_invariant", "all_gather", "reduce_scatter"} <= before
    assert not after & lax_collectives
    assert {"jaxccl_psum", "jaxccl_all_gather", "jaxccl_reduce_scatter"} <= after


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


# The cpu backend's run of the script is test_every_example_runs_as_its_docstring_says (its default, "auto", is cpu
# here: the script exits 0 only when bitwise equal); the report is the same for either backend.
def test_script_reports_bitwise_equality(tmp_path, capsys):
    out = tmp_path / "transformer.json"
    assert T.main(["--steps", "3", "--backend", "ppermute", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bitwise_equal"] and report["loss_lax"] == report["loss_jaxccl"] and len(report["loss_lax"]) == 3
    assert "bitwise equal" in capsys.readouterr().out


# multihost_transformer.py starts a job of several processes: test_multihost_example.py runs it and reads its report
EXAMPLES = sorted(
    p
    for p in (pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.py")
    if p.name != "multihost_transformer.py"
)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_every_example_runs_as_its_docstring_says(script, tmp_path):
    """Each example, run as a user would (a fresh process, a few steps), exits 0: its own checks passed."""
    assert EXAMPLES, "no examples found"
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{output}"
