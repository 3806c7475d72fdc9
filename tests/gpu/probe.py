"""What tests/gpu/run_all.py needs to know about the built jaxccl before it runs the checks: one ``PROBE {json}`` line.

Keys: ``python``, ``jax``, ``jaxlib``, ``jax_plugins`` (installed ``jax-cuda*`` distributions and
versions), ``cuda_module`` (``{"loads", "reason"}`` from :func:`jaxccl.runtime.native.cuda_status`),
``transport`` (why the UCX transport is unavailable; ``None``: it is there), ``ucx`` (its version and
the transports a UCP context would choose from with ``UCX_TLS`` = ``--ucx-tls``) or ``ucx_error``,
``measurement_api`` (``Communicator.measurement`` exists), and ``jax_gpu`` (the GPU devices JAX sees)
or ``jax_gpu_error`` (why it sees none: the CUDA plugin is missing).

Usage:
    python tests/gpu/probe.py [--ucx-tls cuda_copy,cuda_ipc,tcp,sm,self]
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Any


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def probe(ucx_tls: str) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    import jax
    import jaxlib

    info["jax"], info["jaxlib"] = jax.__version__, jaxlib.__version__
    info["jax_plugins"] = {
        d.metadata["Name"]: d.version
        for d in metadata.distributions()
        if (d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")
    }
    import jaxccl
    from jaxccl.distributed import transport
    from jaxccl.runtime import native

    loads, reason = native.cuda_status()
    info["cuda_module"] = {"loads": loads, "reason": reason}
    info["transport"] = transport.unavailable_reason()
    if info["transport"] is None:
        try:
            info["ucx"] = transport.ucx_info({"TLS": ucx_tls} if ucx_tls else None)
        except Exception as e:  # reported: the checks that need it say so
            info["ucx_error"] = _first_line(e)
    info["measurement_api"] = hasattr(jaxccl.Communicator, "measurement")
    try:
        info["jax_gpu"] = [f"{d} ({d.device_kind})" for d in jax.devices("gpu")]
    except Exception as e:  # no CUDA plugin: "Unknown backend: 'gpu' requested ..."
        info["jax_gpu_error"] = _first_line(e)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for the UCX context it opens (empty: UCX's default)")
    args = ap.parse_args(argv)
    print("PROBE " + json.dumps(probe(args.ucx_tls)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
