"""Deprecated: moved to :mod:`jaxccl.util.report`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.util.report")
