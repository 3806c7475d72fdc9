"""Deprecated: moved to :mod:`jaxccl.util.strict`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.util.strict")
