"""The layers of docs/architecture.md hold: import-linter's contracts (pyproject.toml) are kept, and break on an
upward import; ``import jaxccl`` and the lower layers load neither JAX nor the native module.

The contracts are checked on this checkout's ``jaxccl/`` (first on the path; meta-path finders other than
Python's own, such as an editable install's, are dropped so they cannot answer for another copy).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e '.[test]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240

# Runs lint-imports on the jaxccl/ of the working directory (with pyproject.toml's contracts).
_LINT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("_frozen_importlib")]
from importlinter.cli import lint_imports_command
lint_imports_command(["--no-cache", "--no-logo"])
"""


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", _LINT], cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_the_import_contracts_are_kept():
    proc = _lint(ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "jaxccl layers (docs/architecture.md) KEPT" in out
    assert "0 broken" in out


def test_an_upward_import_breaks_the_layers_contract(tmp_path: pathlib.Path):
    shutil.copytree(ROOT / "jaxccl", tmp_path / "jaxccl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    module = tmp_path / "jaxccl" / "topology" / "graph.py"
    module.write_text(module.read_text() + "\nimport jaxccl.cli\n")
    proc = _lint(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "jaxccl layers (docs/architecture.md) BROKEN" in out
    assert "jaxccl.topology is not allowed to import jaxccl.cli" in out
    assert "jaxccl.topology.graph -> jaxccl.cli" in out


# Loaded on import only where needed: JAX (jaxccl.emulate() must run before it starts), the native modules
# (on demand), matplotlib (only when plotting).
HEAVY = ("jax", "jaxlib", "jaxccl._native", "jaxccl._native_cuda", "jaxccl._transport", "matplotlib")


@pytest.mark.parametrize(
    "modules",
    [
        ("jaxccl",),
        ("jaxccl.topology", "jaxccl.schedule", "jaxccl.synth", "jaxccl.sim"),
        ("jaxccl.telemetry", "jaxccl.util", "jaxccl.devices", "jaxccl.offload"),
        ("jaxccl.cli",),  # `jaxccl bench` emulates devices before JAX starts
    ],
)
def test_importing_loads_neither_jax_nor_the_native_module(modules: tuple[str, ...]):
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "if 'jaxccl.cli' in sys.modules:\n"
        "    sys.modules['jaxccl.cli'].build_parser()  # imports every subcommand's module\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert proc.stdout.strip() == "[]", f"importing {modules} loaded {proc.stdout.strip()}"
