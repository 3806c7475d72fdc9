"""Deprecated: moved to :mod:`jaxccl.demos.network`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.demos.network")
