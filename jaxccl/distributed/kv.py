"""The job's key-value store (``jax.distributed``'s): reads with a deadline, one value gathered per process.

Every agreement between the processes of a job (transport addresses, swap points, the loop's
measurements and decisions, the tuner's latencies) goes through this store; a value that does not
arrive in time is a :class:`~jaxccl.errors.DeadlineError` that says what was missing.
"""

from __future__ import annotations

from typing import Any

from jaxccl.errors import DeadlineError, ExecutorError


def job_client(caller: str) -> tuple[Any, int, int]:
    """``(client, process id, number of processes)`` of this job's ``jax.distributed`` service.

    Raises:
        ExecutorError: ``jax.distributed.initialize`` has not run (``caller`` says who needed it).
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise ExecutorError(f"{caller} needs jax.distributed.initialize(...) first")
    return client, distributed.global_state.process_id, distributed.global_state.num_processes


def get(client: Any, key: str, timeout_s: float, missing: str) -> str:
    """The value of ``key``, waiting up to ``timeout_s`` for it to be set.

    Raises:
        DeadlineError: it was not set in time; the message starts with ``missing`` ("process 3 did not
            publish its swap point").
    """
    try:
        return client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # XLA raises its own error type for a missed deadline
        raise DeadlineError(f"{missing} within {timeout_s} s: {e}") from e


def gather(client: Any, key: str, value: str, *, process_id: int, num_processes: int, timeout_s: float, what: str):
    """Publishes ``value`` as this process's ``key/<process id>`` and returns every process's, in process order.

    Raises:
        DeadlineError: a process did not publish ``what`` within ``timeout_s``.
    """
    client.key_value_set(f"{key}/{process_id}", value)
    return [
        value if p == process_id else get(client, f"{key}/{p}", timeout_s, f"process {p} did not publish {what}")
        for p in range(num_processes)
    ]
