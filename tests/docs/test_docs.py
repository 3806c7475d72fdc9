"""Every example in the README, the docs and the docstrings runs.

- A fenced ``python`` block of ``README.md`` or ``docs/**/*.md`` runs as a
  script in a fresh Python process, in an empty working directory, without
  the test session's device settings: a block that needs 8 devices calls
  ``jaxccl.emulate(8)`` itself, as a reader's copy would.
- A fenced ``bash`` block whose every command starts with ``jaxccl `` runs in
  ``bash -e`` the same way. Other ``bash`` blocks (installation, benchmark
  scripts that take minutes) are instructions, not examples, and are not run.
- A ``json`` block holding a topology (``"schema": "jaxccl.topology/1"``)
  must load with :meth:`jaxccl.topology.Topology.from_json`.
- The line ``<!-- docs-test: skip (reason) -->`` right before a fence keeps a
  block from running; the reason is required.
- Every ``>>>`` example of every module under ``jaxccl/`` runs with
  :mod:`doctest` in this process (8 emulated devices, from ``conftest.py``).
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK_TIMEOUT_S = 240
SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```\s*$", re.M | re.S)


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    path: pathlib.Path
    line: int
    lang: str
    body: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _markdown_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md"]
    files += sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
    return files


def _blocks(path: pathlib.Path) -> list[Block]:
    text = path.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = SKIP_MARKER.search(before)
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(path, line, m["lang"], m["body"], marker["reason"].strip() if marker else None))
    return blocks


def _is_cli_only(body: str) -> bool:
    commands = [ln.strip() for ln in body.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return bool(commands) and all(c.startswith("jaxccl ") for c in commands)


ALL_BLOCKS = [b for p in _markdown_files() for b in _blocks(p)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
CLI_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "bash" and _is_cli_only(b.body)]
TOPOLOGY_JSON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "json" and '"jaxccl.topology/' in b.body]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    env["MPLBACKEND"] = "Agg"
    return env


def _run(block: Block, argv: list[str], cwd: pathlib.Path) -> None:
    if block.skip_reason:
        pytest.skip(f"marked docs-test: skip ({block.skip_reason})")
    proc = subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"the block at {block.id} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def test_the_docs_have_examples():
    assert len(PYTHON_BLOCKS) >= 8, [b.id for b in PYTHON_BLOCKS]
    assert any(b.path.name == "README.md" for b in PYTHON_BLOCKS)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_block_runs(block: Block, tmp_path: pathlib.Path):
    script = tmp_path / "example.py"
    script.write_text(block.body)
    _run(block, [sys.executable, str(script)], tmp_path)


@pytest.mark.parametrize("block", CLI_BLOCKS, ids=lambda b: b.id)
def test_cli_block_runs(block: Block, tmp_path: pathlib.Path):
    _run(block, ["bash", "-e", "-c", block.body], tmp_path)


@pytest.mark.parametrize("block", TOPOLOGY_JSON_BLOCKS, ids=lambda b: b.id)
def test_topology_json_block_loads(block: Block):
    from jaxccl.topology import Topology

    topo = Topology.from_json(block.body)
    assert Topology.from_json(topo.to_json()) == topo


def test_skip_markers_name_a_reason():
    for path in _markdown_files():
        for m in re.finditer(r"<!--\s*docs-test:[^>]*-->", path.read_text()):
            assert SKIP_MARKER.fullmatch(m[0]), f"{path.relative_to(ROOT)}: malformed marker {m[0]!r}"


# ------------------------------------------------------------------------------------------------ docstrings


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted((ROOT / "jaxccl").rglob("*.py")):
        if path.name == "__main__.py" or ">>>" not in path.read_text():
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


DOCTEST_MODULES = _modules_with_examples()


def test_doctest_modules_are_found():
    assert len(DOCTEST_MODULES) >= 50, DOCTEST_MODULES


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples_run(name: str):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(module, name) if t.examples]
    assert tests, f"{name} has '>>>' in its source but doctest finds no example"
    failures = []
    for test in tests:
        out: list[str] = []
        result = runner.run(test, out=out.append)
        if result.failed:
            failures.append("".join(out))
    assert not failures, "\n".join(failures)
