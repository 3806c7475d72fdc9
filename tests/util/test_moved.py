"""Modules that moved keep their old names for one release: the same module, with a DeprecationWarning."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MOVED = {
    "jaxccl.runtime.multiprocess": "jaxccl.distributed.transport",
    "jaxccl.runtime.multiprocess_launch": "jaxccl.distributed.launch",
    "jaxccl.runtime.multiprocess_loop": "jaxccl.control.process_loop",
    "jaxccl.runtime.multiprocess_rail": "jaxccl.labs.rail",
    "jaxccl.runtime.multiprocess_drill": "jaxccl.labs.drill",
    "jaxccl.netlab": "jaxccl.labs.netlab",
    "jaxccl.demo": "jaxccl.demos.closed_loop",
    "jaxccl.demo_network": "jaxccl.demos.network",
    "jaxccl.demo_network_layout": "jaxccl.demos.network_layout",
    "jaxccl.demo_network_worker": "jaxccl.demos.network_worker",
    "jaxccl.report": "jaxccl.util.report",
    "jaxccl.strict": "jaxccl.util.strict",
    "jaxccl.sim.groups": "jaxccl.topology.groups",
}

# One fresh interpreter for every old name: first a submodule of an old package, imported cold; then each old
# name, with it and its submodules dropped from sys.modules first, so that its file runs (and warns) again even
# when an earlier import loaded it.
_PROBE = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import jaxccl.netlab.commands as c, jaxccl.labs.netlab.commands as n
out = {"netlab.commands same": c is n, "moved": {}}
for old, new in moved.items():
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    warned = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
    out["moved"][old] = {"same": module is importlib.import_module(new), "warned": warned}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(MOVED)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"the probe failed:\n{proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_old_module_name_is_the_new_module_and_warns(probe):
    assert sorted(probe["moved"]) == sorted(MOVED)
    for old, new in MOVED.items():
        result = probe["moved"][old]
        assert result["same"], f"{old} is not {new}"
        assert result["warned"] and new in result["warned"][0], f"{old} did not warn that it moved to {new}"


def test_names_from_an_old_package_keep_one_identity(probe):
    from jaxccl.labs.netlab import NetlabError
    from jaxccl.labs.netlab.commands import NetlabError as direct

    assert probe["netlab.commands same"]
    assert NetlabError is direct
