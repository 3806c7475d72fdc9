"""The demos behind ``jaxccl demo``: the closed loop on emulated links in one process
(:mod:`~jaxccl.demos.closed_loop`) and on real sockets across processes
(:mod:`~jaxccl.demos.network`, its layout and worker)."""
