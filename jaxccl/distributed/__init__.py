"""A job of several JAX processes: the transport between them, bootstrapped on ``jax.distributed``
(:mod:`~jaxccl.distributed.transport`), and the launcher that starts and reaps the processes of a
job on one machine (:mod:`~jaxccl.distributed.launch`)."""
