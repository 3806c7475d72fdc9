"""The topology of the machine this process runs on: NCCL's topology file, else ``nvidia-smi``, else none.

:func:`discover` tries, in this order:

1. ``NCCL_TOPO_FILE``: when the environment variable is set, the NCCL topology XML it names
   (:func:`jaxccl.topology.nccl_xml.load_nccl_xml`; a dump that ``NCCL_TOPO_DUMP_FILE`` wrote on
   the same cluster works). A file that cannot be read or parsed raises ``TopologyError``: the
   variable says which topology to use, so none is not a silent fallback.
2. ``nvidia-smi topo -m``: when ``nvidia-smi`` is on ``PATH`` and lists GPUs
   (:func:`jaxccl.topology.nvidia_smi.from_nvidia_smi`, one host, nominal link speeds).
3. None: ``topology=None`` and ``source="none"``, with ``detail`` saying why. That is what a
   :class:`~jaxccl.runtime.communicator.Communicator` without a topology does today.

Example:
    >>> found = discover()
    >>> found.source in ("NCCL_TOPO_FILE", "nvidia-smi", "none")
    True
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

from jaxccl.errors import TopologyError
from jaxccl.topology.graph import Topology
from jaxccl.topology.nccl_xml import load_nccl_xml
from jaxccl.topology.nvidia_smi import from_nvidia_smi

__all__ = ["ENV_VAR", "NVIDIA_SMI_TIMEOUT_S", "SOURCES", "Discovery", "discover"]

ENV_VAR = "NCCL_TOPO_FILE"
SOURCES = (ENV_VAR, "nvidia-smi", "none")
NVIDIA_SMI_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Discovery:
    """What :func:`discover` found.

    Attributes:
        topology: the machine's topology, or None when no source gave one.
        source: ``"NCCL_TOPO_FILE"``, ``"nvidia-smi"`` or ``"none"``.
        detail: where it came from (the file, the command) or why there is none.
    """

    topology: Topology | None
    source: str
    detail: str


def discover(num_gpus: int | None = None) -> Discovery:
    """Finds this machine's topology (see the module docstring).

    Args:
        num_gpus: when given, a discovered topology with another number of GPUs raises.

    Raises:
        TopologyError: ``NCCL_TOPO_FILE`` names a file that cannot be read or parsed, ``nvidia-smi``
            prints a matrix that does not parse, or the GPU count differs from ``num_gpus``.
    """
    found = _find()
    if num_gpus is not None and found.topology is not None and found.topology.num_gpus != num_gpus:
        raise TopologyError(
            f"the topology from {found.source} ({found.detail}) has {found.topology.num_gpus} GPUs, expected {num_gpus}"
        )
    return found


def _find() -> Discovery:
    path = os.environ.get(ENV_VAR, "")
    if path:
        return Discovery(load_nccl_xml(path), ENV_VAR, f"{ENV_VAR}={path}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Discovery(None, "none", f"{ENV_VAR} is not set and nvidia-smi is not on PATH")
    try:
        run = subprocess.run(
            [smi, "topo", "-m"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return Discovery(None, "none", f"nvidia-smi topo -m did not run: {e}")
    if run.returncode != 0:
        why = (run.stderr or run.stdout).strip().splitlines()[:1]
        return Discovery(None, "none", f"nvidia-smi topo -m exited with {run.returncode}: {' '.join(why)[:200]}")
    if not any(line.split()[:1] == ["GPU0"] for line in run.stdout.splitlines()):
        return Discovery(None, "none", "nvidia-smi topo -m lists no GPU")
    return Discovery(from_nvidia_smi(run.stdout), "nvidia-smi", f"{smi} topo -m")
