"""Deprecated: moved to :mod:`jaxccl.labs.rail`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.labs.rail")
