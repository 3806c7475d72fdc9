"""Executor failures as jaxccl errors.

A handler's error travels through XLA and reaches Python as
``jax.errors.JaxRuntimeError`` with the handler's message after XLA's status
code (``DEADLINE_EXCEEDED: jaxccl: deadline exceeded: rank 4, threadblock 0,
op 0 ...``). :func:`as_executor_error` turns such an error into an
:class:`~jaxccl.ExecutorError` (:class:`~jaxccl.DeadlineError` for a missed
deadline) carrying the rank, threadblock and op the executor named;
:func:`executor_errors` does it for whatever runs inside it, and a
communicator's ``with`` block applies it on the way out.

Example:
    >>> err = RuntimeError("DEADLINE_EXCEEDED: jaxccl: deadline exceeded: rank 4, threadblock 0, op 2 ('r' ...)")
    >>> e = as_executor_error(err)
    >>> type(e).__name__, e.rank, e.threadblock, e.op
    ('DeadlineError', 4, 0, 2)
    >>> as_executor_error(RuntimeError("something else")) is None
    True
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from jaxccl.errors import CommunicatorClosedError, DeadlineError, ExecutorError

__all__ = ["as_executor_error", "executor_errors"]

_JAXCCL = re.compile(r"^(?:(?P<code>[A-Z_]+): )?(?P<msg>jaxccl[ :].*)", re.S)
_WHERE = re.compile(r"rank (?P<rank>\d+)(?:, threadblock (?P<tb>\d+))?(?:, op (?P<op>\d+))?")


def as_executor_error(error: BaseException) -> ExecutorError | None:
    """The :class:`ExecutorError` a runtime error from jaxccl's executor stands for; ``None`` for any other error."""
    if isinstance(error, ExecutorError):
        return error
    if not isinstance(error, RuntimeError):
        return None
    m = _JAXCCL.match(str(error).strip())
    if m is None:
        return None
    where = _WHERE.search(m["msg"])
    fields = {}
    if where is not None:
        fields = {
            "rank": int(where["rank"]),
            "threadblock": None if where["tb"] is None else int(where["tb"]),
            "op": None if where["op"] is None else int(where["op"]),
        }
    msg = m["msg"]
    closed = _CLOSED_SLOT.search(msg)
    if closed is not None:
        owner = closed_slot_owner(int(closed["slot"]))
        return CommunicatorClosedError(f"communicator {owner} is closed ({msg})" if owner else msg)
    cls = DeadlineError if m["code"] == "DEADLINE_EXCEEDED" or "deadline exceeded" in msg else ExecutorError
    return cls(msg, **fields)


# The registry's word for a slot that a closed communicator released (xla_ffi/host/registry.cc).
_CLOSED_SLOT = re.compile(r"schedule slot (?P<slot>\d+) was removed")
_CLOSED_OWNERS: dict[int, str] = {}
_MAX_CLOSED_OWNERS = 4096


def note_closed_slots(slots: list[int], owner: str) -> None:
    """Remembers which communicator owned ``slots`` when it closed, so a late collective's error names it."""
    for slot in slots:
        _CLOSED_OWNERS[int(slot)] = owner
    while len(_CLOSED_OWNERS) > _MAX_CLOSED_OWNERS:
        _CLOSED_OWNERS.pop(next(iter(_CLOSED_OWNERS)))


def closed_slot_owner(slot: int) -> str | None:
    """The communicator (its repr) that owned ``slot`` when it closed, if remembered."""
    return _CLOSED_OWNERS.get(int(slot))


@contextlib.contextmanager
def executor_errors() -> Iterator[None]:
    """Re-raises executor failures from the block as :class:`ExecutorError` (the original is its cause).

    >>> with executor_errors():
    ...     raise RuntimeError("INTERNAL: jaxccl: no schedule slot 12")
    Traceback (most recent call last):
    ...
    jaxccl.errors.ExecutorError: jaxccl: no schedule slot 12
    """
    try:
        yield
    except RuntimeError as e:
        converted = as_executor_error(e)
        if converted is None or converted is e:
            raise
        raise converted from e
