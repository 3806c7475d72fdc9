"""Deprecated: moved to :mod:`jaxccl.labs.drill`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.labs.drill")
