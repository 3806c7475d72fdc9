"""``jaxccl info`` and ``jaxccl --version`` on this machine: what they say about the build matches what imports."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import jaxccl
from jaxccl.cli.info import NATIVE_MODULES, collect, format_text

KEYS = ["environment", "jax", "jaxccl", "native", "packages", "platform", "python", "topology", "ucx"]


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    unset = ("JAXCCL_", "UCX_", "NCCL_TOPO_FILE", "PJRT_NPROC", "XLA_FLAGS")
    full = {k: v for k, v in os.environ.items() if not k.startswith(unset)} | (env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "jaxccl", *argv], capture_output=True, text=True, timeout=120, env=full, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def _python(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ | (env or {})
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _imports(module: str) -> bool:
    """Whether ``module`` imports in a fresh process (the transport after the libucx wheel's libraries load)."""
    code = (
        "import importlib, sys\n"
        "try:\n    import libucx; libucx.load_library()\nexcept ImportError:\n    pass\n"
        f"try:\n    importlib.import_module({module!r})\nexcept ImportError:\n    sys.exit(3)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0


ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=3", "JAXCCL_TIMEOUT_S": "7", "PJRT_NPROC": "6"}


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(_run("info", "--json", env=ENV).stdout)


def test_the_json_report_has_its_keys_and_this_machines_versions(report):
    assert sorted(report) == KEYS
    assert report["jaxccl"] == jaxccl.__version__
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    import jax
    import numpy

    assert report["packages"]["jax"] == jax.__version__ and report["packages"]["numpy"] == numpy.__version__
    assert report["topology"]["source"] == "none" and report["topology"]["num_gpus"] is None  # no GPU, no file


def test_what_it_says_about_native_modules_is_what_imports(report):
    for name, module in NATIVE_MODULES.items():
        entry = report["native"][name]
        assert entry["module"] == module
        assert entry["built"] == (importlib.util.find_spec(module) is not None), name
        assert entry["loads"] == _imports(module), name
        if not entry["loads"]:
            assert entry["reason"], name
    assert report["native"]["cpu"]["reason"] is None or not report["native"]["cpu"]["loads"]


def test_ucx_reports_the_loaded_library_and_follows_ucx_tls(report):
    if not report["native"]["transport"]["loads"]:
        assert report["ucx"] is None
        pytest.skip("the UCX transport is not built here")
    ucx = report["ucx"]
    assert ucx["error"] is None and re.fullmatch(r"\d+\.\d+\.\d+\S*", ucx["version"])
    assert ucx["transports"] and all(re.fullmatch(r"[\w-]+/[\w:.-]+", t) for t in ucx["transports"])
    wheel = report["packages"]["libucx"]
    assert wheel is None or wheel.startswith(ucx["version"])  # the module loaded the wheel's library
    tcp_only = json.loads(_run("info", "--json", "--no-jax", env={"UCX_TLS": "tcp"}).stdout)["ucx"]
    assert tcp_only["transports"] and all(t.startswith("tcp/") for t in tcp_only["transports"])
    assert set(tcp_only["transports"]) <= set(ucx["transports"])


def test_jax_devices_and_the_environment(report):
    jx = report["jax"]
    assert jx["error"] is None and jx["backend"] == "cpu"
    assert jx["device_count"] == jx["local_device_count"] == 3 and jx["devices"] == {"cpu": 3}
    assert jx["distributed"] == {"initialized": False, "process_index": None, "process_count": None}
    assert report["environment"] == {
        "JAXCCL_TIMEOUT_S": "7",
        "NCCL_TOPO_FILE": None,
        "PJRT_NPROC": "6",
        "XLA_FLAGS_DEVICE_COUNT": 3,
    }


def test_the_process_index_and_count_once_jax_distributed_is_initialized():
    code = (
        "import json, socket, jax\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=1, process_id=0)\n"
        "from jaxccl.cli.info import collect\n"
        "print(json.dumps(collect()['jax']['distributed']))\n"
    )
    out = _python(code, env={"JAX_PLATFORMS": "cpu"})
    assert json.loads(out.strip().splitlines()[-1]) == {"initialized": True, "process_index": 0, "process_count": 1}


def test_the_text_report_says_the_same(report):
    text = _run("info", env=ENV).stdout
    lines = text.splitlines()
    assert lines[0] == f"jaxccl {jaxccl.__version__}"
    for name, entry in report["native"].items():
        (line,) = [ln for ln in lines if ln.split()[:2] == [name, entry["module"]]]
        state = line.split(entry["module"], 1)[1].strip()
        assert state == ("not built" if not entry["built"] else "loads" if entry["loads"] else "built, does not load")
    assert "jax: backend cpu, 3 devices (cpu: 3); jax.distributed not initialized" in lines
    assert any(ln.startswith("topology: none (") for ln in lines)
    assert "environment: JAXCCL_TIMEOUT_S=7, NCCL_TOPO_FILE unset, PJRT_NPROC=6, XLA_FLAGS_DEVICE_COUNT=3" in lines
    assert format_text(report) == text.rstrip("\n")  # the same report, as JSON and as text


def test_no_jax_never_imports_jax():
    code = (
        "import json, sys, io, contextlib\n"
        "from jaxccl.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n    rc = main(['info', '--json', '--no-jax'])\n"
        "print(json.dumps({'rc': rc, 'jax': 'jax' in sys.modules, 'report': json.loads(buf.getvalue())}))\n"
    )
    out = json.loads(_python(code))
    assert out["rc"] == 0 and out["jax"] is False
    report = out["report"]
    assert sorted(report) == KEYS and report["jax"] is None
    for name in ("cpu", "cuda"):
        entry = report["native"][name]
        assert entry["loads"] is (None if entry["built"] else False) and entry["reason"]
    assert "jax: not started (--no-jax)" in format_text(report).splitlines()


def test_collect_reports_the_environment_it_is_given():
    env = {"JAXCCL_UCX_OPTIONS": "TLS=tcp", "PATH": "/bin", "XLA_FLAGS": "--xla_force_host_platform_device_count=x"}
    assert collect(with_jax=False, environ=env)["environment"] == {
        "JAXCCL_UCX_OPTIONS": "TLS=tcp",
        "NCCL_TOPO_FILE": None,
        "PJRT_NPROC": None,
        "XLA_FLAGS_DEVICE_COUNT": None,
    }


def test_version_names_the_native_modules_built_without_starting_jax():
    code = (
        "import sys, io, contextlib\n"
        "from jaxccl.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n    rc = main(['--version'])\n"
        "native = ('jax', 'jaxccl._native', 'jaxccl._transport', 'jaxccl._native_cuda')\n"
        "loaded = [m for m in native if m in sys.modules]\n"
        "print(rc, loaded, buf.getvalue().strip())\n"
    )
    out = _python(code).strip()
    assert out.startswith("0 [] ")
    line = out[len("0 [] ") :]
    built = [n for n, m in NATIVE_MODULES.items() if importlib.util.find_spec(m) is not None]
    missing = [n for n in NATIVE_MODULES if n not in built]
    expected = f"jaxccl {jaxccl.__version__} (native: {', '.join(built) or 'none'}"
    expected += f"; {', '.join(missing)}: not built)" if missing else ")"
    assert line == expected
    assert _run("--version").stdout.strip() == expected


def test_the_topology_is_what_communicator_auto_would_discover():
    data = os.path.join(os.path.dirname(__file__), "..", "data", "topologies")
    found = json.loads(
        _run("info", "--json", "--no-jax", env={"NCCL_TOPO_FILE": os.path.join(data, "two_hosts.xml")}).stdout
    )
    assert found["topology"]["source"] == "NCCL_TOPO_FILE"
    assert (found["topology"]["num_gpus"], found["topology"]["hosts"]) == (8, 2)
    broken = os.path.join(data, "dgx_h100.txt")  # an nvidia-smi matrix is not NCCL XML
    error = json.loads(_run("info", "--json", "--no-jax", env={"NCCL_TOPO_FILE": broken}).stdout)["topology"]
    assert error["source"] == "error" and error["num_gpus"] is None and "dgx_h100.txt" in error["detail"]
    assert "topology: error" in _run("info", "--no-jax", env={"NCCL_TOPO_FILE": broken}).stdout
