"""Running ``ip`` and ``tc``: one place that turns their failures into :class:`NetlabError`.

>>> from jaxccl.labs.netlab.commands import NetlabError
>>> issubclass(NetlabError, RuntimeError)
True
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence

from jaxccl.errors import NetlabError

COMMAND_TIMEOUT_S = 20.0
LAB_PREFIX = "jxl-"  # every namespace a lab makes starts with it
NETNS_ETC = "/etc/netns"  # `ip netns exec NAME` bind-mounts the files of NETNS_ETC/NAME over /etc


def run(argv: Sequence[str], *, check: bool = True, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Runs one ``ip``/``tc`` command and returns its standard output.

    Args:
        argv: the command and its arguments.
        check: raise :class:`NetlabError` when the command fails (else return its output anyway).
        timeout_s: deadline for the command.

    Raises:
        NetlabError: the command failed, could not be started or missed its deadline.

    >>> run(["true"])
    ''
    """
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetlabError(f"{' '.join(argv)}: {e}") from e
    if check and done.returncode != 0:
        raise NetlabError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def in_namespace(namespace: str, argv: Sequence[str]) -> list[str]:
    """The command line that runs ``argv`` inside network namespace ``namespace``.

    >>> in_namespace("lab-0", ["tc", "qdisc", "show"])
    ['ip', 'netns', 'exec', 'lab-0', 'tc', 'qdisc', 'show']
    """
    return ["ip", "netns", "exec", namespace, *argv]


def shape_rate(namespace: str, dev: str, rate_mbit: float, *, fresh: bool) -> None:
    """Limits ``dev`` in ``namespace`` to ``rate_mbit`` with an HTB class (rate and ceiling); works live.

    ``fresh``: the device has no root qdisc of ours yet (it is added first); otherwise the class is changed
    in place, so flows on the link keep going.
    """
    rate = f"{rate_mbit:g}mbit"
    if fresh:
        run(in_namespace(namespace, ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"]))
    run(
        in_namespace(
            namespace,
            ["tc", "class", "add" if fresh else "change", "dev", dev, "parent", "1:", "classid", "1:1", "htb"]
            + ["rate", rate, "ceil", rate, "burst", "64k", "cburst", "64k"],
        )
    )


def list_namespaces() -> list[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def delete_namespaces(prefix: str) -> list[str]:
    """Kills the processes in every namespace whose name starts with ``prefix``, then deletes it.

    Deleting a namespace deletes the interfaces (veths, bridges) and qdiscs inside it; its
    ``/etc/netns`` folder goes too. Returns the names it deleted; never raises for a namespace
    that vanished meanwhile.
    """
    gone = []
    for name in list_namespaces():
        if not name.startswith(prefix):
            continue
        for pid in run(["ip", "netns", "pids", name], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        run(["ip", "netns", "delete", name], check=False)
        gone.append(name)
    if os.path.isdir(NETNS_ETC):
        for name in os.listdir(NETNS_ETC):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    return gone


@functools.cache
def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (``None`` when they can): root, ``ip``, ``tc`` and a trial namespace.

    >>> reason = unavailable_reason()
    >>> reason is None or isinstance(reason, str)
    True
    """
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    trial = f"{LAB_PREFIX}probe-{uuid.uuid4().hex[:8]}"
    try:
        run(["ip", "netns", "add", trial])
    except NetlabError as e:
        return f"cannot create a network namespace: {e}"
    finally:
        run(["ip", "netns", "delete", trial], check=False)
    return None


@functools.cache
def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delays); some have HTB but not netem."""
    if unavailable_reason() is not None:
        return False
    trial = f"{LAB_PREFIX}probe-{uuid.uuid4().hex[:8]}"
    try:
        run(["ip", "netns", "add", trial])
        done = subprocess.run(
            in_namespace(trial, ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]),
            capture_output=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        return done.returncode == 0
    except (NetlabError, OSError, subprocess.TimeoutExpired):
        return False
    finally:
        run(["ip", "netns", "delete", trial], check=False)
