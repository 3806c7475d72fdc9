"""Real links on one machine: network namespaces and shaped veths (:mod:`~jaxccl.labs.netlab`), the
rail fabric of hosts built from them (:mod:`~jaxccl.labs.rail`) and the failure drill that cuts a NIC
under a running multi-process job (:mod:`~jaxccl.labs.drill`). Tests, benchmarks and demos use them;
the library's collectives never do."""
