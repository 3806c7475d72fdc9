"""The binary wheel: built and repaired here (``.ci/build_wheel.sh``), installed where no compiler can be found
and run (``.ci/check_wheel.sh``), and the repair command's UCX exclusions matching the libucx-cu12 wheel.

The build and the check download from PyPI (the isolated build env, auditwheel, the wheel's dependencies), so
they are ``slow`` and skip with a reason when PyPI cannot be reached or the platform has no manylinux.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlparse

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def _repair_command() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return shlex.split(tomllib.load(f)["tool"]["cibuildwheel"]["linux"]["repair-wheel-command"])


def _index_unreachable() -> str | None:
    """Why the package index cannot be reached (None when it can)."""
    host = urlparse(os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")).hostname or "pypi.org"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        return f"no network to {host} (the wheel build downloads its build env, auditwheel and dependencies): {e}"
    return None


def test_repair_excludes_exactly_the_libraries_libucx_provides():
    libucx = pytest.importorskip("libucx", reason="libucx-cu12 is a dependency; this install lacks it")
    lib = Path(libucx.__file__).parent / "lib"
    provided = {p.name for p in lib.glob("lib*.so.*") if re.fullmatch(r"lib\w+\.so\.\d+", p.name)}
    cmd = _repair_command()
    excluded = {cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--exclude"}
    assert cmd[:2] == ["auditwheel", "repair"]
    assert {"libucp.so.0", "libucs.so.0"} <= provided  # what jaxccl._transport links
    assert excluded == provided


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wheel_builds_repairs_installs_and_runs_without_a_compiler(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("manylinux wheels and auditwheel are Linux only")
    reason = _index_unreachable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(ROOT / ".ci" / "build_wheel.sh"), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.parent == tmp_path and wheel.is_file()
    assert re.search(r"-manylinux_2_\d+_(x86_64|aarch64)\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("jaxccl/_transport.") for n in names)
    assert not [n for n in names if "/libuc" in n]

    checked = subprocess.run(
        ["bash", str(ROOT / ".ci" / "check_wheel.sh"), str(wheel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-4000:]
    assert "with the transport between processes" in checked.stdout
    assert "wheel check passed" in checked.stdout
