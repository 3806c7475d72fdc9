"""Measured socket throughput between two nodes of a lab (a TCP stream, timed at the receiver).

The receiver runs in one node's namespace, the sender in another's; the receiver times from the
first byte to the last and prints ``BYTES SECONDS``. :func:`measure_throughput` runs both and
returns bytes per second.

Usage: ``python -m jaxccl.labs.netlab.probe recv PORT NBYTES TIMEOUT_S`` or
``python -m jaxccl.labs.netlab.probe send HOST PORT NBYTES TIMEOUT_S``.

>>> from jaxccl.labs.netlab.probe import CHUNK_BYTES
>>> CHUNK_BYTES
65536
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from jaxccl.labs.netlab.commands import NetlabError
from jaxccl.labs.netlab.lab import NetLab

CHUNK_BYTES = 1 << 16
PROBE_PORT = 40917


def receive(port: int, nbytes: int, timeout_s: float) -> tuple[int, float]:
    """Accepts one connection on ``port`` and reads ``nbytes``; returns (bytes, seconds first→last byte)."""
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout_s)
        print("READY", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            got, first = 0, None
            while got < nbytes:
                data = conn.recv(CHUNK_BYTES)
                if not data:
                    break
                if first is None:
                    first = time.perf_counter()
                got += len(data)
            last = time.perf_counter()
    return got, (last - first) if first is not None else 0.0


def send(host: str, port: int, nbytes: int, timeout_s: float) -> None:
    """Connects to ``host:port`` (retrying until ``timeout_s``) and sends ``nbytes`` of random bytes."""
    deadline = time.monotonic() + timeout_s
    payload = bytes(range(256)) * (CHUNK_BYTES // 256)
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        left = nbytes
        while left > 0:
            n = min(left, CHUNK_BYTES)
            conn.sendall(payload[:n])
            left -= n


def measure_throughput(lab: NetLab, src: int, dst: int, nbytes: int, *, timeout_s: float = 60.0) -> float:
    """Bytes per second of one TCP stream from node ``src`` to node ``dst`` of an open lab.

    Raises:
        NetlabError: a side failed or missed ``timeout_s``.
    """
    recv_argv = [sys.executable, "-m", "jaxccl.labs.netlab.probe", "recv", str(PROBE_PORT), str(nbytes), str(timeout_s)]
    receiver = lab.popen(dst, recv_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = receiver.stdout.readline().strip()
        if ready != "READY":
            raise NetlabError(f"throughput receiver on node {dst} did not start: {receiver.stderr.read()[-2000:]}")
        send_argv = [
            *[sys.executable, "-m", "jaxccl.labs.netlab.probe", "send"],
            *[lab.address(dst), str(PROBE_PORT), str(nbytes), str(timeout_s)],
        ]
        sender = lab.popen(src, send_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, send_err = sender.communicate(timeout=timeout_s)
        out, recv_err = receiver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise NetlabError(f"throughput probe {src}->{dst} missed its deadline of {timeout_s} s") from e
    finally:
        for p in (receiver,):
            if p.poll() is None:
                p.kill()
    if sender.returncode != 0 or receiver.returncode != 0:
        raise NetlabError(f"throughput probe {src}->{dst} failed: {send_err[-2000:]} {recv_err[-2000:]}")
    got, seconds = (float(v) for v in out.split())
    if got < nbytes or seconds <= 0:
        raise NetlabError(f"throughput probe {src}->{dst} received {got:.0f} of {nbytes} bytes")
    return got / seconds


def main(argv: list[str]) -> int:
    """Command line of the two sides (run inside a node's namespace by :func:`measure_throughput`)."""
    if argv[0] == "recv":
        got, seconds = receive(int(argv[1]), int(argv[2]), float(argv[3]))
        print(got, seconds, flush=True)
    elif argv[0] == "send":
        send(argv[1], int(argv[2]), int(argv[3]), float(argv[4]))
    else:
        raise SystemExit(f"unknown mode {argv[0]!r}: expected 'recv' or 'send'")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
