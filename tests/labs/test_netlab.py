"""Real links on one machine (jaxccl.labs.netlab): shaped rates, a live cut, and nothing left behind.

These tests build network namespaces, so they need root and iproute2; elsewhere they skip with
the reason :func:`jaxccl.labs.netlab.unavailable_reason` gives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxccl.labs.netlab import LinkShape, NetLab, NetlabError, measure_throughput, unavailable_reason
from jaxccl.labs.netlab.commands import NETNS_ETC, list_namespaces, netem_available

ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces here: {REASON}")

RATE_MBIT = 40.0


def test_bad_input_is_named():
    with pytest.raises(NetlabError, match="num_nodes"):
        NetLab(0)
    with pytest.raises(NetlabError, match="rate_mbit"):
        LinkShape(rate_mbit=0)
    with pytest.raises(NetlabError, match="delay_ms"):
        LinkShape(rate_mbit=10, delay_ms=-1)
    with pytest.raises(NetlabError, match="node 5"):
        NetLab(2, {5: LinkShape(rate_mbit=10)})
    with pytest.raises(NetlabError, match="not open"):
        NetLab(2).shape(0, LinkShape(rate_mbit=10))


@needs_netns
def test_shaped_rate_is_measured_and_a_live_cut_drops_it():
    with NetLab(2, LinkShape(rate_mbit=RATE_MBIT)) as lab:
        assert sorted(lab.leftovers()) == sorted([lab.switch, lab.namespace(0), lab.namespace(1)])
        resolve = [sys.executable, "-c", "import socket; print(socket.gethostbyname(socket.gethostname()))"]
        own = lab.popen(1, resolve, stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0].strip()
        assert own == lab.address(1)  # programs that advertise their host's address advertise the node's
        healthy = measure_throughput(lab, 0, 1, 4 << 20)
        rate = LinkShape(rate_mbit=RATE_MBIT).rate_bytes_per_s
        assert 0.7 * rate < healthy < 1.1 * rate, (healthy, rate)
        lab.shape(1, LinkShape(rate_mbit=RATE_MBIT / 5))  # node 1's NIC cut live (its downlink)
        cut = measure_throughput(lab, 0, 1, 1 << 20)
        assert cut < 0.3 * rate, (cut, rate)
        assert cut > 0.1 * rate, (cut, rate)  # still the cut rate, not a dead link
        other = measure_throughput(lab, 1, 0, 1 << 20)  # node 0's NIC is untouched; node 1's uplink is cut too
        assert other < 0.3 * rate, (other, rate)
    assert lab.leftovers() == []


@needs_netns
def test_failure_inside_the_lab_removes_everything():
    with pytest.raises(RuntimeError, match="a failing run"), NetLab(3, LinkShape(rate_mbit=10)) as lab:
        sleeper = lab.popen(2, [sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("a failing run")
    assert sleeper.poll() is not None
    assert lab.leftovers() == []


@needs_netns
def test_killed_owner_leaves_nothing():
    code = (
        "from jaxccl.labs.netlab import NetLab, LinkShape\n"
        "import sys, time\n"
        "lab = NetLab(2, LinkShape(rate_mbit=10)).__enter__()\n"
        "lab.popen(0, [sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(lab.prefix, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
    )
    try:
        prefix = owner.stdout.readline().strip()
        assert prefix.startswith("jxl-"), prefix
        assert len([n for n in list_namespaces() if n.startswith(prefix)]) == 3
        os.kill(owner.pid, signal.SIGKILL)  # no atexit, no finally: only the reaper can clean up
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(n.startswith(prefix) for n in list_namespaces()):
            time.sleep(0.2)
        assert not any(n.startswith(prefix) for n in list_namespaces())
        assert not any(n.startswith(prefix) for n in os.listdir(NETNS_ETC))
    finally:
        if owner.poll() is None:
            owner.kill()


@needs_netns
def test_delay_needs_netem_or_says_why():
    with NetLab(2) as lab:
        if not netem_available():
            with pytest.raises(NetlabError, match="netem"):
                lab.shape(0, LinkShape(rate_mbit=10, delay_ms=5))
            return
        lab.shape(0, LinkShape(rate_mbit=100, delay_ms=20))
        slow = measure_throughput(lab, 0, 1, 1 << 16)
        lab.shape(0, LinkShape(rate_mbit=100))
        fast = measure_throughput(lab, 0, 1, 1 << 16)
        assert fast > slow  # 64 KiB needs round trips: 20 ms each way slows it down
    assert lab.leftovers() == []
