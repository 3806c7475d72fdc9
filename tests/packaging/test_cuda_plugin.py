"""The CUDA executor as a plugin package (``plugins/cuda12``, ``jaxccl[cuda12]``): its metadata agrees with
jaxccl and with the module name jaxccl loads; a plugin that is installed but does not load is reported, not
fatal; and (slow, needs nvcc) ``pip wheel plugins/cuda12`` builds a wheel whose module jaxccl loads first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

import jaxccl
from jaxccl.runtime import cuda_plugin

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "plugins" / "cuda12"


def _toml(path: Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)


def test_the_plugin_package_is_the_module_jaxccl_loads_at_jaxccls_version():
    plugin, main = _toml(PLUGIN / "pyproject.toml"), _toml(ROOT / "pyproject.toml")
    assert plugin["project"]["name"] == cuda_plugin.PLUGIN_DISTRIBUTION
    assert plugin["project"]["version"] == main["project"]["version"] == jaxccl.__version__
    skb = plugin["tool"]["scikit-build"]
    assert skb["wheel"]["packages"] == [cuda_plugin.PLUGIN_PACKAGE]
    assert (PLUGIN / cuda_plugin.PLUGIN_PACKAGE / "__init__.py").is_file()
    assert (PLUGIN / skb["cmake"]["source-dir"]).resolve() == ROOT  # the repository's CMakeLists.txt
    assert skb["cmake"]["define"] == {"JAXCCL_PLUGIN": "ON", "JAXCCL_PLUGIN_CUDA_MAJOR": "12"}
    assert cuda_plugin.PLUGIN_DISTRIBUTION.endswith(f"cuda{skb['cmake']['define']['JAXCCL_PLUGIN_CUDA_MAJOR']}-plugin")
    # The CMake side installs the module where the package is, under the name jaxccl imports.
    cmake = (ROOT / "kernels" / "cuda.cmake").read_text()
    assert f"set(_jaxccl_cuda_destination {cuda_plugin.PLUGIN_PACKAGE})" in cmake
    assert "install(TARGETS _native_cuda LIBRARY DESTINATION ${_jaxccl_cuda_destination})" in cmake
    module = cuda_plugin.PLUGIN_MODULE.rpartition(".")[2]
    assert f"NB_MODULE({module}, m)" in (ROOT / "kernels" / "cuda_module.cc").read_text()
    assert f"jaxccl.{module}" == cuda_plugin.BUILTIN_MODULE


def test_jaxccl_cuda12_pins_the_plugin_at_its_own_version_beside_jax_cuda12():
    main = _toml(ROOT / "pyproject.toml")
    extra = {Requirement(r).name: Requirement(r) for r in main["project"]["optional-dependencies"]["cuda12"]}
    assert set(extra) == {cuda_plugin.PLUGIN_DISTRIBUTION, "jax"}
    assert str(extra[cuda_plugin.PLUGIN_DISTRIBUTION].specifier) == f"=={jaxccl.__version__}"
    assert extra["jax"].extras == {"cuda12"}
    jax_dep = next(Requirement(r) for r in main["project"]["dependencies"] if Requirement(r).name == "jax")
    assert extra["jax"].specifier == jax_dep.specifier


def _run_python(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


LOADED = """
import json
from jaxccl.runtime import native
from jaxccl.cli.info import collect
cuda = native._cuda_module()
print(json.dumps({
    "name": native.cuda_module_name(),
    "status": native.cuda_status(),
    "registrations": sorted(cuda.registrations()) if cuda is not None else None,
    "info": collect()["native"]["cuda"],
}))
"""


def test_a_plugin_that_does_not_load_is_named_in_the_status_and_the_report(tmp_path):
    # What a plugin built for another platform looks like to Python: its module file is there, not loadable.
    package = tmp_path / cuda_plugin.PLUGIN_PACKAGE
    package.mkdir()
    shutil.copy(PLUGIN / cuda_plugin.PLUGIN_PACKAGE / "__init__.py", package)
    (package / f"_native_cuda{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"\x7fELF not a library")
    out = _run_python(LOADED, tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["name"] is None and got["registrations"] is None
    loads, reason = got["status"]
    assert not loads and reason.startswith(f"{cuda_plugin.PLUGIN_MODULE} is installed but does not load: ")
    assert got["info"] == {"module": cuda_plugin.PLUGIN_MODULE, "built": True, "loads": False, "reason": reason}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pip_wheel_builds_the_plugin_and_jaxccl_loads_its_module(tmp_path):
    """About 1 min on 2 cores: the CUDA executor for sm_80 and sm_90, with the system's nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH (the plugin compiles the CUDA executor)")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), str(PLUGIN)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    (wheel,) = tmp_path.glob("*.whl")
    assert re.fullmatch(rf"jaxccl_cuda12_plugin-{re.escape(jaxccl.__version__)}-.*\.whl", wheel.name)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert any(re.fullmatch(rf"{cuda_plugin.PLUGIN_PACKAGE}/_native_cuda\..*\.so", n) for n in names), names
    assert not any(n.startswith("jaxccl/") for n in names)  # the CUDA executor alone
    out = _run_python(LOADED, site)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["name"] == cuda_plugin.PLUGIN_MODULE
    assert got["registrations"] == ["jaxccl_cuda_collective", "jaxccl_cuda_mp_collective"]
    assert got["info"]["module"] == cuda_plugin.PLUGIN_MODULE and got["info"]["built"] and got["info"]["loads"]
