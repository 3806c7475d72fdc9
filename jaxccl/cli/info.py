"""``jaxccl info``: what a bug report needs, as text or one JSON object (``--json``).

The versions of jaxccl, its dependencies, Python and the platform; which native modules were built and
whether they load (and why not); the UCX library and the transports it would choose from; JAX's devices
and, where ``jax.distributed`` is initialized, this process's index and the job's process count; the
environment variables jaxccl reads. ``--no-jax`` leaves JAX alone (it is not even imported), for a
machine where starting it fails or hangs. :func:`collect` gives the same dictionary inside a program,
e.g. in every process of a job after ``jax.distributed.initialize``.

The JSON keys (stable; a value that does not apply is ``null``):

- ``jaxccl``, ``python``, ``platform``: versions and ``platform.platform()``.
- ``packages``: ``jax``, ``jaxlib``, ``numpy``, ``libucx``, ``jaxccl_cuda12_plugin``: installed versions
  (``null``: not installed).
- ``native``: ``cpu`` (``jaxccl._native``), ``transport`` (``jaxccl._transport``), ``cuda`` (the CUDA
  executor: ``jaxccl_cuda12_plugin._native_cuda`` where the ``jaxccl-cuda12-plugin`` package is installed,
  else ``jaxccl._native_cuda``; :mod:`jaxccl.runtime.cuda_plugin`), each ``{"module", "built", "loads",
  "reason"}``: ``built`` is the module file being there, ``loads`` whether importing it works (``null``: not
  tried, with ``--no-jax`` for ``cpu`` and ``cuda``, which load through JAX), ``reason`` why it cannot be
  used here (``null``: it can).
- ``ucx``: ``{"version", "transports", "error"}`` of the UCX library the transport loaded (``null``: the
  transport does not load); ``transports`` are ``"transport/device"`` names such as ``"tcp/eth0"``.
- ``jax``: ``{"backend", "device_count", "local_device_count", "devices", "distributed", "error"}``
  (``null`` with ``--no-jax``); ``devices`` counts devices per platform; ``distributed`` is
  ``{"initialized", "process_index", "process_count"}``; ``error`` is why JAX did not start.
- ``environment``: every ``JAXCCL_*`` variable that is set, and always ``NCCL_TOPO_FILE``, ``PJRT_NPROC``
  (their values or ``null``) and ``XLA_FLAGS_DEVICE_COUNT`` (``--xla_force_host_platform_device_count`` in
  ``XLA_FLAGS``, an int or ``null``).
- ``topology``: what ``Communicator(topology="auto")`` would use here (:func:`jaxccl.topology.discover.discover`):
  ``{"source", "detail", "name", "num_gpus", "hosts"}``; ``source`` is ``"NCCL_TOPO_FILE"``, ``"nvidia-smi"``,
  ``"none"`` (``detail`` says why) or ``"error"`` (a source that exists but does not parse; ``detail`` is the
  error).

Example:
    >>> report = collect(with_jax=False)
    >>> sorted(report)
    ['environment', 'jax', 'jaxccl', 'native', 'packages', 'platform', 'python', 'topology', 'ucx']
    >>> report["jax"] is None and report["native"]["cpu"]["loads"] is None
    True
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
from collections.abc import Mapping
from typing import Any

from jaxccl import __version__
from jaxccl.errors import JaxcclError
from jaxccl.runtime import cuda_plugin
from jaxccl.topology.discover import discover

__all__ = ["NATIVE_MODULES", "collect", "format_text", "native_built", "register", "version_line"]

# The native modules, by the short names --version and the report use (the CUDA executor: the plugin
# package's where it is installed, else jaxccl's own).
NATIVE_MODULES: dict[str, str] = {
    "cpu": "jaxccl._native",
    "transport": "jaxccl._transport",
    "cuda": cuda_plugin.installed_module() or cuda_plugin.BUILTIN_MODULE,
}
CPU_NOT_BUILT = "jaxccl._native was not built: pip install -e . builds it with CMake"
CUDA_NOT_BUILT = cuda_plugin.NOT_INSTALLED
PACKAGES = ("jax", "jaxlib", "numpy", "libucx", cuda_plugin.PLUGIN_PACKAGE)
ENV_ALWAYS = ("NCCL_TOPO_FILE", "PJRT_NPROC")
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\S+)")


def native_built() -> dict[str, bool]:
    """Which native modules this build has (their files are there; nothing is loaded).

    >>> sorted(native_built())
    ['cpu', 'cuda', 'transport']
    """
    return {name: importlib.util.find_spec(module) is not None for name, module in NATIVE_MODULES.items()}


def version_line() -> str:
    """What ``jaxccl --version`` prints: the version and the native modules built (cheap: loads nothing).

    >>> version_line().startswith("jaxccl ") and "native: " in version_line()
    True
    """
    built = native_built()
    have = [name for name, ok in built.items() if ok]
    missing = [name for name, ok in built.items() if not ok]
    parts = [f"native: {', '.join(have) or 'none'}"]
    if missing:
        parts.append(f"{', '.join(missing)}: not built")
    return f"jaxccl {__version__} ({'; '.join(parts)})"


def _package_version(name: str) -> str | None:
    """The installed version of the distribution that provides import package ``name`` (``libucx`` comes as
    ``libucx-cu12`` and the like), or ``None``.

    >>> _package_version("numpy") == importlib.metadata.version("numpy")
    True
    """
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    for dist in importlib.metadata.packages_distributions().get(name, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _device_count_flag(xla_flags: str) -> int | None:
    """The last ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` (XLA reads the last one).

    >>> _device_count_flag("--xla_foo=1 --xla_force_host_platform_device_count=8")
    8
    >>> _device_count_flag("") is None
    True
    """
    found = _DEVICE_COUNT_FLAG.findall(xla_flags)
    if not found:
        return None
    try:
        return int(found[-1])
    except ValueError:
        return None


def _environment(environ: Mapping[str, str]) -> dict[str, Any]:
    env: dict[str, Any] = {k: environ[k] for k in sorted(environ) if k.startswith("JAXCCL_")}
    for k in ENV_ALWAYS:
        env[k] = environ.get(k)
    env["XLA_FLAGS_DEVICE_COUNT"] = _device_count_flag(environ.get("XLA_FLAGS", ""))
    return env


def _module_entry(name: str, built: bool) -> dict[str, Any]:
    return {"module": NATIVE_MODULES[name], "built": built, "loads": None, "reason": None}


def _native_section(with_jax: bool) -> dict[str, dict[str, Any]]:
    built = native_built()
    section = {name: _module_entry(name, ok) for name, ok in built.items()}
    # The transport loads without JAX (jaxccl.distributed.transport imports it on demand).
    from jaxccl.distributed import transport  # the native modules load on demand

    reason = transport.unavailable_reason()
    section["transport"].update(loads=reason is None, reason=reason)
    if not built["cpu"]:
        section["cpu"].update(loads=False, reason=CPU_NOT_BUILT)
    if not built["cuda"]:
        section["cuda"].update(loads=False, reason=CUDA_NOT_BUILT)
    if not with_jax:
        for name in ("cpu", "cuda"):
            if built[name]:
                section[name]["reason"] = "not loaded: --no-jax (it loads through JAX, registering its targets)"
        return section
    if not built["cpu"]:
        return section
    try:
        from jaxccl.runtime import native  # the native module loads on demand (and imports JAX)
    except ImportError as e:
        section["cpu"].update(loads=False, reason=str(e))
        if built["cuda"]:
            section["cuda"].update(loads=False, reason=f"needs jaxccl._native, which does not load: {e}")
        return section
    section["cpu"]["loads"] = True
    cuda_loads, cuda_reason = native.cuda_status()
    section["cuda"].update(loads=cuda_loads, reason=cuda_reason)
    if native.cuda_module_name() is not None:  # the plugin did not load, jaxccl's own did
        section["cuda"]["module"] = native.cuda_module_name()
    return section


def _ucx_section(transport_loads: bool) -> dict[str, Any] | None:
    if not transport_loads:
        return None
    from jaxccl.distributed import transport  # the native modules load on demand
    from jaxccl.errors import JaxcclError

    try:
        return {**transport.ucx_info(), "error": None}
    except JaxcclError as e:  # UCX did not start: that is what the report has to say
        return {"version": None, "transports": [], "error": str(e)}


def _jax_section() -> dict[str, Any]:
    section: dict[str, Any] = {
        "backend": None,
        "device_count": None,
        "local_device_count": None,
        "devices": {},
        "distributed": {"initialized": False, "process_index": None, "process_count": None},
        "error": None,
    }
    try:
        import jax  # starts JAX only here: `jaxccl info --no-jax` never does

        devices = jax.devices()
        counts: dict[str, int] = {}
        for d in devices:
            counts[d.platform] = counts.get(d.platform, 0) + 1
        section.update(
            backend=jax.default_backend(),
            device_count=len(devices),
            local_device_count=jax.local_device_count(),
            devices=counts,
        )
        if jax.distributed.is_initialized():
            section["distributed"] = {
                "initialized": True,
                "process_index": jax.process_index(),
                "process_count": jax.process_count(),
            }
    except Exception as e:  # a backend that fails to start: the report says how, instead of failing
        section["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return section


def collect(*, with_jax: bool = True, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The report as a dictionary (the keys of ``jaxccl info --json``, listed in this module's docstring).

    Args:
        with_jax: start JAX to list its devices and load the modules that load through it (``False``:
            JAX is not imported; ``jax`` is ``None``).
        environ: the environment to report (default ``os.environ``).

    >>> collect(with_jax=False, environ={"JAXCCL_TIMEOUT_S": "5", "XLA_FLAGS": ""})["environment"]
    {'JAXCCL_TIMEOUT_S': '5', 'NCCL_TOPO_FILE': None, 'PJRT_NPROC': None, 'XLA_FLAGS_DEVICE_COUNT': None}
    """
    native = _native_section(with_jax)
    return {
        "jaxccl": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _package_version(name) for name in PACKAGES},
        "native": native,
        "ucx": _ucx_section(bool(native["transport"]["loads"])),
        "jax": _jax_section() if with_jax else None,
        "environment": _environment(os.environ if environ is None else environ),
        "topology": _topology_section(),
    }


def _topology_section() -> dict[str, Any]:
    """The machine's topology as ``Communicator(topology="auto")`` would find it."""
    try:
        found = discover()
    except JaxcclError as e:
        return {"source": "error", "detail": str(e), "name": None, "num_gpus": None, "hosts": None}
    topo = found.topology
    return {
        "source": found.source,
        "detail": found.detail,
        "name": None if topo is None else topo.name,
        "num_gpus": None if topo is None else topo.num_gpus,
        "hosts": None if topo is None else len(topo.hosts),
    }


def _topology_text(entry: Mapping[str, Any]) -> str:
    if entry["num_gpus"] is None:
        return f"{entry['source']} ({entry['detail']})"
    return f"{entry['num_gpus']} GPUs on {entry['hosts']} host(s) from {entry['source']} ({entry['detail']})"


def _or(value: Any, missing: str) -> str:
    return missing if value is None else str(value)


def _module_state(entry: Mapping[str, Any]) -> str:
    if not entry["built"]:
        return "not built"
    if entry["loads"] is None:
        return "built (not loaded)"
    if not entry["loads"]:
        return "built, does not load"
    return "loads" if entry["reason"] is None else "loads, unusable"


def format_text(report: Mapping[str, Any]) -> str:
    """The report of :func:`collect` as the lines ``jaxccl info`` prints.

    >>> print(format_text(collect(with_jax=False)).splitlines()[0].split()[0])
    jaxccl
    """
    lines = [
        f"jaxccl {report['jaxccl']}",
        f"python {report['python']} on {report['platform']}",
        "packages: " + ", ".join(f"{k} {_or(v, 'not installed')}" for k, v in report["packages"].items()),
        "native modules:",
    ]
    width = max(20, *(len(entry["module"]) for entry in report["native"].values()))
    for name, entry in report["native"].items():
        lines.append(f"  {name:<10} {entry['module']:<{width}} {_module_state(entry)}")
        if entry["reason"] is not None and entry["built"]:
            lines.append(f"  {'':<10} {entry['reason']}")
    ucx = report["ucx"]
    if ucx is None:
        lines.append("ucx: not loaded (the transport does not load)")
    elif ucx["error"] is not None:
        lines.append(f"ucx: error: {ucx['error']}")
    else:
        lines.append(f"ucx {ucx['version']}: transports {', '.join(ucx['transports']) or 'none'}")
    jx = report["jax"]
    if jx is None:
        lines.append("jax: not started (--no-jax)")
    elif jx["error"] is not None:
        lines.append(f"jax: did not start: {jx['error']}")
    else:
        per = ", ".join(f"{p}: {n}" for p, n in jx["devices"].items())
        dist = jx["distributed"]
        where = (
            f"process {dist['process_index']} of {dist['process_count']}"
            if dist["initialized"]
            else "jax.distributed not initialized"
        )
        count = f"{jx['device_count']} device{'' if jx['device_count'] == 1 else 's'}"
        lines.append(f"jax: backend {jx['backend']}, {count} ({per}); {where}")
    env = ", ".join(
        f"{k}={shlex.quote(str(v)) if isinstance(v, str) else v}" if v is not None else f"{k} unset"
        for k, v in report["environment"].items()
    )
    lines.append(f"environment: {env}")
    lines.append(f"topology: {_topology_text(report['topology'])}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Prints the report (text, or JSON with ``--json``)."""
    report = collect(with_jax=not args.no_jax)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds ``info`` to ``jaxccl``."""
    p = subparsers.add_parser(
        "info",
        help="what a bug report needs: versions, native modules, UCX, JAX's devices, the environment",
        description=(
            "Prints the versions of jaxccl, JAX, jaxlib, numpy and Python and the platform; which native modules "
            "were built and load (and why not); the UCX version and the transports UCX would choose from; JAX's "
            "devices and process index/count; the environment variables jaxccl reads."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (its keys: see jaxccl.cli.info)")
    p.add_argument("--no-jax", action="store_true", help="do not import or start JAX (no devices; cpu/cuda not loaded)")
    p.set_defaults(func=run)
