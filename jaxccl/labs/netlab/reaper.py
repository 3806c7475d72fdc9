"""The lab's reaper: a detached process that removes a lab's namespaces when its owner dies.

A :class:`~jaxccl.labs.netlab.lab.NetLab` starts one reaper per lab, in its own session, with a
pipe on its standard input. The reaper reads until end of file, which comes when the owner
closes the pipe or dies in any way (``kill -9`` included: the kernel closes a dead process's
files), and then deletes every namespace of the lab's prefix with the processes in it.

Usage: ``python -m jaxccl.labs.netlab.reaper PREFIX``
"""

from __future__ import annotations

import sys

from jaxccl.labs.netlab.commands import LAB_PREFIX, delete_namespaces


def main(argv: list[str]) -> int:
    """Waits for end of file on standard input, then deletes the namespaces of ``argv[0]``'s prefix."""
    prefix = argv[0]
    if not prefix.startswith(LAB_PREFIX):  # never a namespace that no lab made
        return 2
    sys.stdin.buffer.read()
    delete_namespaces(prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
