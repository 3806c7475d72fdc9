"""Deprecated: moved to :mod:`jaxccl.demos.network_layout`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.demos.network_layout")
