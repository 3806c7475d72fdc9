"""Modules that moved keep their old names for one release: the same module, with a DeprecationWarning."""

from __future__ import annotations

import json
import subprocess
import sys

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

# Each old name is imported first in a fresh interpreter: a module imports once per process, and so warns once.
_PROBE = """
import importlib, json, sys, warnings
old, new = sys.argv[1], sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    module = importlib.import_module(old)
print(json.dumps({
    "same": module is importlib.import_module(new),
    "warned": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)],
}))
"""


def test_every_old_module_name_is_the_new_module_and_warns():
    for old, new in MOVED.items():
        proc = subprocess.run([sys.executable, "-c", _PROBE, old, new], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"import {old} failed:\n{proc.stderr[-2000:]}"
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["same"], f"{old} is not {new}"
        assert result["warned"] and new in result["warned"][0], f"{old} did not warn that it moved to {new}"


def test_names_from_an_old_package_keep_one_identity():
    from jaxccl.labs.netlab import NetlabError
    from jaxccl.labs.netlab.commands import NetlabError as direct

    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            "import jaxccl.netlab.commands as c, jaxccl.labs.netlab.commands as n; print(c is n)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout.strip() == "True", proc.stderr
    assert NetlabError is direct
