"""Deprecated: moved to :mod:`jaxccl.demos.closed_loop`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.demos.closed_loop")
