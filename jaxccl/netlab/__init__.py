"""Deprecated: moved to :mod:`jaxccl.labs.netlab`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.labs.netlab")
