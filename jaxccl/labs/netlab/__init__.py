"""Real links on one machine for tests, benchmarks and the demo: network namespaces, veths, ``tc``.

:class:`NetLab` builds one namespace per node joined through a bridge, shapes each node's NIC
with ``tc`` (HTB rate + netem delay), changes one live to inject a gray failure, and removes
everything it made, also when its owner is killed. It needs root and iproute2;
:func:`unavailable_reason` says why not where it cannot run.

>>> from jaxccl.labs import netlab
>>> sorted(netlab.__all__)[:3]
['LinkShape', 'NetLab', 'NetlabError']
"""

from jaxccl.labs.netlab.commands import NetlabError, unavailable_reason
from jaxccl.labs.netlab.lab import LinkShape, NetLab, node_address
from jaxccl.labs.netlab.probe import measure_throughput

__all__ = ["LinkShape", "NetLab", "NetlabError", "measure_throughput", "node_address", "unavailable_reason"]
