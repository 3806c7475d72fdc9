"""Deprecated: moved to :mod:`jaxccl.control.process_loop`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.control.process_loop")
