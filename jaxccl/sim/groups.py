"""Deprecated: moved to :mod:`jaxccl.topology.groups`."""

from jaxccl.util.moved import alias

alias(__name__, "jaxccl.topology.groups")
