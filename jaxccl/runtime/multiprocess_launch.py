"""Deprecated: moved to :mod:`jaxccl.distributed.launch`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.distributed.launch")
