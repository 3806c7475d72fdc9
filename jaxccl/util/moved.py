"""Deprecated aliases of modules that moved: the old name imports the new module, with a warning.

A module that moved keeps a file at its old path that calls :func:`alias` for one release, so
``import jaxccl.runtime.multiprocess`` (and every name in it, private ones too) still works:

>>> import sys, warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     alias("jaxccl.util._example_old", "jaxccl.util.moved")
>>> sys.modules["jaxccl.util._example_old"] is sys.modules["jaxccl.util.moved"]
True
>>> caught[0].category.__name__
'DeprecationWarning'
"""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make module ``old`` the module ``new`` and warn that ``old`` is deprecated."""
    warnings.warn(
        f"{old} moved to {new}; the old name is removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    module = importlib.import_module(new)
    sys.modules[old] = module
    for name, submodule in list(sys.modules.items()):  # a package's loaded submodules keep one identity
        if name.startswith(new + "."):
            sys.modules[old + name[len(new) :]] = submodule
