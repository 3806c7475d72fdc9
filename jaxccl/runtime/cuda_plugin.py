"""Where jaxccl's CUDA executor comes from: the ``jaxccl-cuda12-plugin`` package, else jaxccl's own build.

Like JAX's GPU support (``pip install "jax[cuda12]"`` brings ``jax-cuda12-plugin``), the CUDA executor can
come as a plugin package: ``pip install "jaxccl[cuda12]"`` installs ``jaxccl-cuda12-plugin``, whose module
``jaxccl_cuda12_plugin._native_cuda`` jaxccl loads in place of its own ``jaxccl._native_cuda`` (which a
source build with ``JAXCCL_CUDA=ON`` or ``AUTO`` on a GPU machine makes). Both are built from this tree
(``plugins/cuda12``); the module checks at attach time that it matches ``jaxccl._native``.

Nothing here imports JAX or loads a native module: :func:`installed_module` only looks for the files.

Example:
    >>> CUDA_MODULES[-1]
    'jaxccl._native_cuda'
    >>> installed_module() in (*CUDA_MODULES, None)
    True
"""

from __future__ import annotations

import importlib.util

__all__ = [
    "BUILTIN_MODULE",
    "CUDA_MODULES",
    "NOT_INSTALLED",
    "PLUGIN_DISTRIBUTION",
    "PLUGIN_MODULE",
    "PLUGIN_PACKAGE",
    "installed_module",
]

PLUGIN_DISTRIBUTION = "jaxccl-cuda12-plugin"  # the pip package (plugins/cuda12/pyproject.toml)
PLUGIN_PACKAGE = "jaxccl_cuda12_plugin"
PLUGIN_MODULE = f"{PLUGIN_PACKAGE}._native_cuda"
BUILTIN_MODULE = "jaxccl._native_cuda"
CUDA_MODULES = (PLUGIN_MODULE, BUILTIN_MODULE)  # in the order jaxccl loads them
NOT_INSTALLED = (
    f"no CUDA executor is installed: install the {PLUGIN_DISTRIBUTION} package (a wheel built with "
    f"`pip wheel plugins/cuda12` from jaxccl's source, see its GPU guide), or build jaxccl with nvcc "
    f"(JAXCCL_CUDA=ON; {BUILTIN_MODULE})"
)


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is not installed
        return False


def installed_module() -> str | None:
    """The CUDA module jaxccl loads here (the plugin's first), by its file being there; ``None``: neither."""
    return next((m for m in CUDA_MODULES if _exists(m)), None)
