"""pytest setup for the whole repository: 8 emulated CPU devices before JAX starts, and the ``serial`` mark.

At the repository root so that it also serves ``pytest --doctest-modules jaxccl``.

The suite runs in two parts (README, ``.ci/run``): the tests of one process that neither start other
processes nor time themselves on two pytest-xdist workers (``-m "not slow and not serial" -n 2``), then
the ``serial`` ones alone (``-m "not slow and serial"``), which start jobs of several processes, shape real
links or measure rates, and would share the two cores with another worker's tests. Every test in
:data:`SERIAL_DIRS` and every test marked ``multiprocess`` is ``serial``.
"""

from pathlib import Path

import pytest

import jaxccl

jaxccl.emulate(8)

ROOT = Path(__file__).resolve().parent
SERIAL_DIRS = ("cli", "distributed", "examples", "gpu", "labs", "packaging", "tune")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.path.resolve()
        parts = path.relative_to(ROOT).parts if path.is_relative_to(ROOT) else ()
        in_serial_dir = len(parts) > 2 and parts[0] == "tests" and parts[1] in SERIAL_DIRS
        if in_serial_dir or item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.serial)
