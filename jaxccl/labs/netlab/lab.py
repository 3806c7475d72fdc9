"""A lab of real links on one machine: one network namespace per node, veth pairs to a bridge, ``tc`` shaping.

Each node (a rank, or a process holding ranks) gets its own namespace with one interface,
``eth0``, whose veth peer sits on a bridge in the lab's switch namespace. Each node's "NIC" is
shaped in both directions: its uplink on ``eth0``'s egress, its downlink on the peer's egress,
each an HTB class (rate) with a netem child (delay, where the kernel has netem). :meth:`NetLab.shape` changes one node's
classes live, which is how a gray failure is injected.

Everything the lab creates lives in namespaces named ``jxl-<id>-…`` (and their ``/etc/netns``
folders, where each node's host name resolves to its own address); deleting a namespace deletes
its interfaces and qdiscs. The lab removes them on :meth:`NetLab.close` (also at the end
of a ``with`` block and at interpreter exit), and a reaper process removes them when the owner
dies without closing (``kill -9``).

>>> from jaxccl.labs.netlab import LinkShape
>>> LinkShape(rate_mbit=100, delay_ms=0.5).rate_bytes_per_s
12500000.0
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxccl.labs.netlab.commands import (
    LAB_PREFIX,
    NETNS_ETC,
    NetlabError,
    delete_namespaces,
    in_namespace,
    list_namespaces,
    netem_available,
    run,
    shape_rate,
    unavailable_reason,
)

SUBNET = "10.213.0.0/16"  # private addresses that exist only inside the lab's own namespaces
MAX_NODES = 250 * 250


@dataclass(frozen=True)
class LinkShape:
    """How one node's NIC is shaped, in each direction.

    Attributes:
        rate_mbit: rate in Mbit/s (HTB rate and ceiling).
        delay_ms: one-way delay added by netem, in milliseconds.
    """

    rate_mbit: float
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise NetlabError(f"LinkShape.rate_mbit must be > 0, got {self.rate_mbit!r}")
        if not self.delay_ms >= 0:
            raise NetlabError(f"LinkShape.delay_ms must be >= 0, got {self.delay_ms!r}")

    @property
    def rate_bytes_per_s(self) -> float:
        """The rate in bytes per second."""
        return self.rate_mbit * 1e6 / 8


def node_address(index: int) -> str:
    """The IPv4 address of node ``index`` inside a lab.

    >>> node_address(0), node_address(251)
    ('10.213.0.1', '10.213.1.2')
    """
    if not 0 <= index < MAX_NODES:
        raise NetlabError(f"node index {index} outside 0..{MAX_NODES - 1}")
    return f"10.213.{index // 250}.{index % 250 + 1}"


class NetLab:
    """Network namespaces joined by shaped veth links; a context manager that removes what it made.

    Args:
        num_nodes: how many nodes (namespaces with one shaped NIC each).
        shape: the NIC shape of every node, or a mapping node → shape (unlisted nodes are unshaped).

    Raises:
        NetlabError: namespaces are not available here (see :func:`unavailable_reason`) or a
            command failed; whatever was created before the failure is removed.

    Example (as root)::

        with NetLab(2, LinkShape(rate_mbit=50)) as lab:
            server = lab.popen(1, [sys.executable, "-m", "jaxccl.labs.netlab.probe", "recv", ...])
            lab.shape(0, LinkShape(rate_mbit=5))  # gray failure: node 0's NIC cut live
    """

    def __init__(self, num_nodes: int, shape: LinkShape | Mapping[int, LinkShape] | None = None):
        if not isinstance(num_nodes, int) or not 1 <= num_nodes <= MAX_NODES:
            raise NetlabError(f"num_nodes must be an int in 1..{MAX_NODES}, got {num_nodes!r}")
        shapes = dict.fromkeys(range(num_nodes), shape) if isinstance(shape, LinkShape) else dict(shape or {})
        for node in shapes:
            self._check_node(node, num_nodes)
        self.num_nodes = num_nodes
        self.prefix = f"{LAB_PREFIX}{uuid.uuid4().hex[:8]}-"
        self._initial = shapes
        self._shapes: dict[int, LinkShape | None] = {}
        self._procs: list[subprocess.Popen] = []
        self._reaper: subprocess.Popen | None = None
        self._open = False

    # ------------------------------------------------------------------ names

    @property
    def switch(self) -> str:
        """The namespace that holds the bridge and the NICs' peers."""
        return f"{self.prefix}sw"

    def namespace(self, node: int) -> str:
        """The namespace of ``node``."""
        self._check_node(node, self.num_nodes)
        return f"{self.prefix}{node}"

    def address(self, node: int) -> str:
        """The address of ``node``'s NIC."""
        self._check_node(node, self.num_nodes)
        return node_address(node)

    def shape_of(self, node: int) -> LinkShape | None:
        """The shape ``node``'s NIC has now (``None``: unshaped)."""
        self._check_node(node, self.num_nodes)
        return self._shapes.get(node)

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> NetLab:
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        """Creates the namespaces, the bridge, the veths and the shaping."""
        if self._open:
            return
        reason = unavailable_reason()
        if reason is not None:
            raise NetlabError(f"network namespaces are not available: {reason}")
        self._open = True
        # The reaper first: from here on, whatever this process dies of, the namespaces go.
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "jaxccl.labs.netlab.reaper", self.prefix],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sw = self.switch
        run(["ip", "netns", "add", sw])
        run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for node in range(self.num_nodes):
            ns, peer = self.namespace(node), self._peer(node)
            run(["ip", "netns", "add", ns])
            self._write_hosts(node)
            run(["ip", "-n", sw, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns])
            run(["ip", "-n", sw, "link", "set", peer, "master", "br0", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{node_address(node)}/16", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self._shapes[node] = None
            shape = self._initial.get(node)
            if shape is not None:
                self.shape(node, shape)

    def _write_hosts(self, node: int) -> None:
        # Inside the node the machine's host name resolves to the node's own address (not 127.0.0.1), so
        # programs that advertise "their" address (gloo, jax.distributed) advertise one the others reach.
        folder = os.path.join(NETNS_ETC, self.namespace(node))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{node_address(node)} {socket.gethostname()}\n")

    def close(self) -> None:
        """Kills the processes started in the lab and removes every namespace it created (idempotent)."""
        if not self._open:
            return
        self._open = False
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        delete_namespaces(self.prefix)
        if self._reaper is not None:
            self._reaper.stdin.close()  # the reaper finds nothing left and exits
            try:
                self._reaper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
        atexit.unregister(self.close)

    def leftovers(self) -> list[str]:
        """The namespaces of this lab (or their ``/etc/netns`` folders) that exist now (empty after :meth:`close`)."""
        names = set(list_namespaces())
        if os.path.isdir(NETNS_ETC):
            names.update(os.listdir(NETNS_ETC))
        return sorted(name for name in names if name.startswith(self.prefix))

    # ------------------------------------------------------------------ shaping

    def shape(self, node: int, shape: LinkShape | None) -> None:
        """Shapes ``node``'s NIC in both directions now (``None`` removes the shaping); works live.

        The first call adds an HTB root with one class and a netem child on each side; later
        calls change the class and the netem qdisc in place, so flows on the link keep going.
        """
        self._require_open()
        self._check_node(node, self.num_nodes)
        sides = [(self.namespace(node), "eth0"), (self.switch, self._peer(node))]
        had = self._shapes.get(node)
        for ns, dev in sides:
            if shape is None:
                if had is not None:
                    run(in_namespace(ns, ["tc", "qdisc", "del", "dev", dev, "root"]))
                continue
            shape_rate(ns, dev, shape.rate_mbit, fresh=had is None)
            self._set_delay(ns, dev, had, shape)
        self._shapes[node] = shape

    def _set_delay(self, ns: str, dev: str, had: LinkShape | None, shape: LinkShape) -> None:
        # A netem child of the class adds the delay; without one the class keeps its default FIFO.
        had_delay = had is not None and had.delay_ms > 0
        if shape.delay_ms > 0 and not netem_available():
            raise NetlabError(
                f"LinkShape.delay_ms={shape.delay_ms:g} needs the netem qdisc, which this kernel lacks (sch_netem); "
                "use delay_ms=0 here"
            )
        if shape.delay_ms > 0:
            verb = "change" if had_delay else "add"
            argv = ["tc", "qdisc", verb, "dev", dev, "parent", "1:1", "handle", "10:", "netem"]
            run(in_namespace(ns, [*argv, "delay", f"{shape.delay_ms:g}ms", "limit", "100000"]))
        elif had_delay:
            run(in_namespace(ns, ["tc", "qdisc", "del", "dev", dev, "parent", "1:1", "handle", "10:"]))

    # ------------------------------------------------------------------ processes

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` inside ``node``'s namespace (``subprocess.Popen`` keywords pass through).

        The lab kills it on :meth:`close` if it still runs.
        """
        self._require_open()
        proc = subprocess.Popen(in_namespace(self.namespace(node), list(argv)), **kwargs)
        self._procs.append(proc)
        return proc

    # ------------------------------------------------------------------ helpers

    def _peer(self, node: int) -> str:
        return f"n{node}"

    def _require_open(self) -> None:
        if not self._open:
            raise NetlabError("the lab is not open (use it inside 'with NetLab(...) as lab:')")

    @staticmethod
    def _check_node(node: int, num_nodes: int) -> None:
        if not isinstance(node, int) or not 0 <= node < num_nodes:
            raise NetlabError(f"node {node!r} is not one of the lab's nodes 0..{num_nodes - 1}")
