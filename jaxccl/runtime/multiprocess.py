"""Deprecated: moved to :mod:`jaxccl.distributed.transport`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.distributed.transport")
