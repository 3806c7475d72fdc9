"""The transport between processes (UCX, bootstrapped on jax.distributed), on loopback and on real links.

Each test starts a multi-process JAX job (tests/workers/multiprocess_native_worker.py) with
jaxccl.distributed.launch: data checked bitwise across 2 and 4 processes, measured
rates that follow a shaped link and its live cut, and a killed peer named within the deadline.
The collectives checked on loopback share one job per layout (processes x local devices), each
test reading its part of the job's output.
Skips with the reason where the transport was not built or namespaces are not available.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from jaxccl.distributed.launch import ProcessResult, launch
from jaxccl.distributed.transport import unavailable_reason as transport_unavailable
from jaxccl.labs.netlab import LinkShape, NetLab
from jaxccl.labs.netlab import unavailable_reason as netns_unavailable

WORKER = Path(__file__).parents[1] / "workers" / "multiprocess_native_worker.py"
TRANSPORT = transport_unavailable()
NETNS = netns_unavailable()
needs_transport = pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")
needs_netns = pytest.mark.skipif(NETNS is not None, reason=f"no network namespaces here: {NETNS}")
NETWORK_ONLY = {"JAXCCL_TEST_NETWORK_ONLY": "1"}
pytestmark = [pytest.mark.multiprocess, needs_transport]


def _report(results: list[ProcessResult]) -> str:
    return "\n----\n".join(f"process {r.process_id} (rc {r.returncode}):\n{r.output[-3000:]}" for r in results)


# The worker's checks on loopback, as parts of one job per (processes, local devices): a job's start (JAX in
# every process, jax.distributed, the transport) costs more than most parts.
LOOPBACK_JOBS = {
    (2, 1): "exchange+collectives",
    (2, 2): "collectives+mesh+swap:14+sums:ppermute",
    (2, 4): "layouts+sums:cpu+collectives:ppermute+inplace",
    (3, 2): "sums:cpu:d,data,model/data",
    (8, 1): "collectives",
}


@pytest.fixture(scope="module")
def loopback_job() -> Callable[[int, int], list[ProcessResult]]:
    """``(processes, local_devices) ->`` the results of that job of :data:`LOOPBACK_JOBS`, run on first use."""
    done: dict[tuple[int, int], list[ProcessResult]] = {}

    def get(processes: int, local_devices: int) -> list[ProcessResult]:
        key = (processes, local_devices)
        if key not in done:
            argv = [sys.executable, str(WORKER), "parts", str(local_devices), LOOPBACK_JOBS[key]]
            done[key] = launch(argv, processes, env={"JAXCCL_TIMEOUT_S": "120"}, timeout_s=600)
        return done[key]

    return get


def _part_lines(output: str, part: str) -> list[str] | None:
    """The lines that ``part`` of a ``parts`` job printed; None where it did not finish."""
    lines = output.splitlines()
    if f"PART {part}" not in lines:
        return None
    rest = lines[lines.index(f"PART {part}") + 1 :]
    end = next((i for i, line in enumerate(rest) if line.startswith("PART ") or line in ("ALL OK", "FAILED")), None)
    return None if end is None else rest[:end]


def _check_part(results: list[ProcessResult], part: str, expected: int) -> list[list[str]]:
    """Every process finished ``part`` with ``expected`` CHECK lines, all ok; returns each process's lines of it."""
    report = _report(results)
    sections = []
    for r in results:
        assert r.returncode == 0 or "FAILED" in r.output.splitlines(), report  # a failed check is its part's
        lines = _part_lines(r.output, part)
        assert lines is not None, report
        checks = [line for line in lines if line.startswith("CHECK ")]
        assert len(checks) == expected, report
        assert all(c.endswith(" ok") or " ok " in c for c in checks), report
        sections.append(lines)
    return sections


def _check_exchange(results: list[ProcessResult], n: int) -> None:
    report = _report(results)
    assert all(r.returncode == 0 for r in results), report
    for r in results:
        checks = [line for line in r.output.splitlines() if line.startswith("CHECK ")]
        assert len(checks) == 3 * (n - 1), report
        assert all(line.endswith(" ok") for line in checks), report
        assert "ALL OK" in r.output, report


def _transports_to_peers(results: list[ProcessResult]) -> list[set[str]]:
    return [
        {t.split("/")[0] for t in line.split()[2].split(",")}
        for r in results
        for line in r.output.splitlines()
        if line.startswith("VIA ")
    ]


SHARED_MEMORY = {"posix", "sysv", "cma", "xpmem", "knem"}


def test_bitwise_exchange_across_two_processes_on_loopback(loopback_job):
    results = loopback_job(2, 1)
    _check_part(results, "exchange", 3)  # 3 sizes from the other process
    via = _transports_to_peers(results)
    assert len(via) == 2 and all(v & SHARED_MEMORY for v in via), (via, _report(results))


def test_peers_on_one_machine_keep_to_the_network_when_the_options_say_so():
    results = launch([sys.executable, str(WORKER), "exchange"], 2, env=NETWORK_ONLY, timeout_s=120)
    _check_exchange(results, 2)
    via = _transports_to_peers(results)
    assert len(via) == 2 and all(v == {"tcp"} for v in via), (via, _report(results))


@needs_netns
def test_bitwise_exchange_across_four_processes_on_real_links():
    with NetLab(4, LinkShape(rate_mbit=400)) as lab:
        results = launch([sys.executable, str(WORKER), "exchange"], 4, lab=lab, env=NETWORK_ONLY, timeout_s=240)
    _check_exchange(results, 4)
    assert all(v == {"tcp"} for v in _transports_to_peers(results)), _report(results)
    rate = LinkShape(rate_mbit=400).rate_bytes_per_s
    for r in results:  # three peers share each NIC: no flow beats its rate
        for line in r.output.splitlines():
            if line.startswith("RATE "):
                assert float(line.split()[3]) < 1.2 * rate, _report(results)


@needs_netns
def test_transport_completion_times_follow_a_live_cut():
    shaped = LinkShape(rate_mbit=40)
    rates: list[tuple[bool, float]] = []  # (after the cut, bytes/s)

    def cut_after_four(procs: list[subprocess.Popen]) -> None:
        while len(rates) < 4:
            line = procs[1].stdout.readline()
            if not line:
                return
            if line.startswith("RATE "):
                rates.append((False, float(line.split()[1])))
        lab.shape(1, LinkShape(rate_mbit=shaped.rate_mbit / 5))
        for line in procs[1].stdout:
            if line.startswith("RATE "):
                rates.append((True, float(line.split()[1])))

    with NetLab(2, shaped) as lab:
        results = launch(
            [sys.executable, str(WORKER), "stream", str(1 << 20), "10"],
            2,
            lab=lab,
            env=NETWORK_ONLY,
            timeout_s=200,
            during=cut_after_four,
        )
    assert results[0].returncode == 0, _report(results)
    before = sorted(r for cut, r in rates if not cut)
    after = sorted(r for cut, r in rates if cut)
    assert len(before) == 4 and len(after) >= 4, rates
    rate = shaped.rate_bytes_per_s
    assert 0.5 * rate < before[len(before) // 2] < 1.2 * rate, rates  # 1 MiB messages: a little below the rate
    assert after[len(after) // 2] < 0.35 * rate, rates  # the first may straddle the cut: take the median


def _kill_last_after(marker: str, delay_s: float, sig: int = signal.SIGKILL):
    def kill(procs: list[subprocess.Popen]) -> None:
        for line in procs[-1].stdout:
            if marker in line:
                break
        time.sleep(delay_s)  # the others are inside the next collective now
        os.kill(procs[-1].pid, sig)  # SIGSTOP: hung, not dead (launch kills it at the end)

    return kill


def _check_named_failure(results: list[ProcessResult], deadline_s: float, victim: int) -> tuple[str, float, str]:
    """Process 0 reported an error naming ``victim`` within the deadline; returns (error type, seconds, message)."""
    survivor = results[0]
    assert survivor.returncode == 0, _report(results)
    match = re.search(r"ERROR (\w+) after ([\d.]+) s: (.*)", survivor.output)
    assert match, _report(results)
    kind, seconds, message = match.group(1), float(match.group(2)), match.group(3)
    assert kind in ("ExecutorError", "DeadlineError"), message
    assert f"process {victim}" in message, message
    # Measured from the last completed step: the stuck wait's own deadline starts when that wait begins, which
    # on a loaded 2-core machine can be seconds into the collective (15.0 s seen for a 10 s deadline).
    assert seconds <= deadline_s + 10, seconds
    return kind, seconds, message


def _check_seen_exiting(failure: tuple[str, float, str], deadline_s: float) -> None:
    """A killed peer on this machine is seen exiting (its pidfd), long before the deadline."""
    kind, seconds, message = failure
    assert kind == "ExecutorError" and "exited" in message, message
    assert seconds < deadline_s / 2, (seconds, message)


@pytest.mark.parametrize("network", ["loopback", pytest.param("netns", marks=needs_netns)])
def test_killed_peer_is_named_within_the_deadline(network):
    deadline_s = 20.0
    env = {"JAXCCL_TEST_DEADLINE_S": str(deadline_s)}
    argv = [sys.executable, str(WORKER), "kill"]
    kill = _kill_last_after("SENT", 0.3)
    if network == "netns":
        with NetLab(2, LinkShape(rate_mbit=100)) as lab:
            results = launch(argv, 2, lab=lab, env=env | NETWORK_ONLY, timeout_s=120, during=kill)
    else:
        results = launch(argv, 2, env=env, timeout_s=120, during=kill)
    failure = _check_named_failure(results, deadline_s, victim=1)
    if network == "loopback":
        _check_seen_exiting(failure, deadline_s)


def test_large_messages_from_other_processes_land_in_place_bitwise(loopback_job):
    _check_part(loopback_job(2, 4), "inplace", 2)


@pytest.mark.parametrize("network", ["loopback", pytest.param("netns", marks=needs_netns)])
def test_a_failed_launch_leaves_no_receive_writing_into_freed_outputs(network):
    # The last process stops in the middle of AllToAll steps whose 1 MiB messages land in the receivers' outputs,
    # and resumes once the others failed at their deadline: whatever it still sends must not land in memory XLA
    # freed. Over shared memory the receiver reads the stopped process's memory itself, so the receive ends. Over
    # TCP the sender pushes: a whole message's fragments reached a freed output even after its connection was
    # closed (a segfault or a corrupted heap in 3 of 4 runs), so over TCP a message travels in pieces of one
    # eager fragment each, whose receives are unmatched (cancelled at once) or complete.
    deadline_s, resume_after_s = 3.0, 5.0

    def stop_then_resume(procs: list[subprocess.Popen]) -> None:
        _kill_last_after("STEP 2", 0.05, signal.SIGSTOP)(procs)
        time.sleep(resume_after_s)
        os.kill(procs[-1].pid, signal.SIGCONT)

    env = {"JAXCCL_TIMEOUT_S": str(deadline_s), "JAXCCL_TEST_RESUME_WAIT_S": str(resume_after_s)}
    argv = [sys.executable, str(WORKER), "hanginplace", "4"]
    if network == "netns":
        with NetLab(2, LinkShape(rate_mbit=200)) as lab:
            results = launch(argv, 2, lab=lab, env=env | NETWORK_ONLY, timeout_s=200, during=stop_then_resume)
    else:
        results = launch(argv, 2, env=env, timeout_s=200, during=stop_then_resume)
    _check_named_failure(results, deadline_s, victim=1)
    match = re.search(r"CANARY (\w+) landed (\d+) disconnects (\d+)", results[0].output)
    assert match and match.group(1) == "ok", _report(results)
    landed, disconnects = int(match.group(2)), int(match.group(3))
    if network == "loopback":
        # A receive whose bytes were all read can wait for its acknowledgement to the stopped process: after a
        # second the launch gives up on it and closes that connection (its bytes are in place, nothing writes).
        assert landed > 0, _report(results)
    else:
        assert landed > 0 and disconnects == 0, _report(results)


@pytest.mark.parametrize("victim", ["sending", "receiving"])
def test_a_peer_killed_inside_a_shared_memory_transfer_is_named_and_the_transport_closes(victim):
    deadline_s = 20.0
    results = launch(
        [sys.executable, str(WORKER), "kill", victim],
        2,
        env={"JAXCCL_TEST_DEADLINE_S": str(deadline_s)},
        timeout_s=120,
        during=_kill_last_after("SENT", 0.01),
    )
    _check_seen_exiting(_check_named_failure(results, deadline_s, victim=1), deadline_s)


@pytest.mark.parametrize(("local_devices", "schedule"), [(2, "direct"), (4, "ring")])
def test_native_collective_fails_naming_a_hung_process_at_the_deadline(local_devices, schedule):
    # In the ring, three of a process's four ranks wait for local ranks, which wait for the hung process: the
    # deadline that fires first must name the hung process all the same (it named a local rank before).
    deadline_s = 5.0

    def hang_then_kill(procs: list[subprocess.Popen]) -> None:
        _kill_last_after("STEP 2", 0.05, signal.SIGSTOP)(procs)
        try:
            procs[0].wait(timeout=deadline_s + 60)  # it reports the hung process and exits
        finally:
            procs[-1].kill()

    results = launch(
        [sys.executable, str(WORKER), "killnative", str(local_devices), schedule],
        2,
        env={"JAXCCL_TIMEOUT_S": str(deadline_s)},
        timeout_s=200,
        during=hang_then_kill,
    )
    _check_named_failure(results, deadline_s, victim=1)
    assert "DeadlineError" in results[0].output, _report(results)


def test_native_collective_fails_naming_a_killed_process():
    deadline_s = 20.0
    results = launch(
        [sys.executable, str(WORKER), "killnative", "2"],
        2,
        env={"JAXCCL_TIMEOUT_S": str(deadline_s)},
        timeout_s=200,
        during=_kill_last_after("STEP 2", 0.05),
    )
    _check_seen_exiting(_check_named_failure(results, deadline_s, victim=1), deadline_s)


def _check_collectives(results: list[ProcessResult]) -> None:
    report = _report(results)
    assert all(r.returncode == 0 for r in results), report
    for r in results:
        checks = [line for line in r.output.splitlines() if line.startswith("CHECK ")]
        assert len(checks) == 13, report  # 4 collectives x 2 dtypes + 4 ordered-sum checks + native launches
        assert not any("MISMATCH" in c or "MISSING" in c for c in checks), report
        assert "ALL OK" in r.output, report


# 8 x 1 (one rank per process, 18 s) runs with -m slow; benchmarks/multiprocess/native.py --processes 8 checks it
# bitwise at every point it measures.
@pytest.mark.parametrize(("processes", "local_devices"), [(2, 2), (2, 1), pytest.param(8, 1, marks=pytest.mark.slow)])
def test_native_collectives_across_processes_on_loopback(processes, local_devices, loopback_job):
    # 4 collectives x 2 dtypes + 4 ordered-sum checks + native launches
    _check_part(loopback_job(processes, local_devices), "collectives", 13)


def test_ppermute_backend_across_two_processes(loopback_job):
    _check_part(loopback_job(2, 4), "collectives:ppermute", 12)  # 4 collectives x 2 dtypes + 4 ordered-sum checks


def test_native_collectives_over_the_axes_of_a_two_dimensional_mesh_across_processes(loopback_job):
    _check_part(loopback_job(2, 2), "mesh", 3 * (4 * 2 + 1))  # 3 axis choices x (4 collectives x 2 dtypes + launches)


def test_one_program_runs_collectives_over_several_attached_layouts(loopback_job):
    """Hybrid sharding: "model" inside a process, "data" across, both at once, all native in one step."""
    _check_part(loopback_job(2, 4), "layouts", 1 + 5 + 2)  # attach, 5 collectives, native launches, meter


# (processes, local devices, backend) -> (the part, its CHECK lines). 3x2 runs the groups 2x4 has not: 6 ranks in
# order and permuted, 3 across processes; its pairs inside a process (sums of two, the same in any order) and
# ("data", "model") (the 1-D axis's group again, the 2-D path 2x4's) add nothing.
SUMS = {
    (2, 4, "cpu"): ("sums:cpu", 5),
    (3, 2, "cpu"): ("sums:cpu:d,data,model/data", 3),
    (2, 2, "ppermute"): ("sums:ppermute", 2),
}


@pytest.mark.parametrize(("processes", "local_devices", "backend"), list(SUMS))
def test_float_sums_across_processes_are_bitwise_those_of_jax_lax(processes, local_devices, backend, loopback_job):
    """psum/pmean/psum_scatter across processes in gloo's orders (XLA:CPU's there), on every axis of 1-D and 2-D meshes.

    The order depends on the ranks of a group only, not on how they spread over processes (measured on
    2x4, 4x2 and 8x1 processes x devices), so a few layouts check both backends; 3x2 has groups of 6
    and 3 ranks (gloo's ReduceScatter splits them into power-of-two blocks).
    """
    part, checks = SUMS[processes, local_devices, backend]
    _check_part(loopback_job(processes, local_devices), part, checks)


@needs_netns
def test_native_collectives_across_four_processes_on_real_links():
    with NetLab(4, LinkShape(rate_mbit=1000)) as lab:
        results = launch(
            [sys.executable, str(WORKER), "collectives", "2"],
            4,
            lab=lab,
            env={"JAXCCL_TIMEOUT_S": "60", **NETWORK_ONLY},
            timeout_s=400,
        )
    _check_collectives(results)


def test_hot_swap_at_one_agreed_sequence_number_across_processes(loopback_job):
    results = loopback_job(2, 2)
    report = _report(results)
    swaps, staged = set(), set()
    for lines in _check_part(results, "swap:14", 14):
        output = "\n".join(lines)
        staged.add(re.search(r"STAGED version (\d+) at seq (\d+)", output).groups())
        swaps.add(re.search(r"SWAP (\d+) (\d+)", output).groups())
    assert len(staged) == 1 and len(swaps) == 1, report  # one version, one transition point, everywhere
    (version, seq), (current, swapped_at) = staged.pop(), swaps.pop()
    assert current == version and int(swapped_at) == int(seq) + 1, report


def test_a_stale_message_between_processes_is_refused_by_its_identity():
    results = launch([sys.executable, str(WORKER), "stale", "2"], 2, env={"JAXCCL_TIMEOUT_S": "10"}, timeout_s=300)
    report = _report(results)
    assert all(r.returncode == 0 for r in results), report
    refused = re.search(r"REFUSED (\w+): (.*)", results[0].output)
    assert refused, report
    assert "stale message" in refused.group(2) and "from process 1" in refused.group(2), report
    assert refused.group(2).count("launch ") >= 2, report  # the stale launch and its own
    for r in results:  # the job goes on, bitwise
        assert [line.endswith(" ok") for line in r.output.splitlines() if line.startswith("CHECK after")] == [True] * 3


# ------------------------------------------------------------------ in one process (no jax.distributed)


def _pair(options: dict[str, str] | None = None):
    """Two transports of this process connected to each other (over shared memory, or as ``options`` choose)."""
    from jaxccl.distributed.transport import ProcessTransport

    a, b = ProcessTransport(0, 2, options=options), ProcessTransport(1, 2, options=options)
    a.connect(1, b.address())
    b.connect(0, a.address())
    return a, b


def _tcp_pair():
    """Two transports of this process connected over TCP (tcp/lo), where messages travel in pieces."""
    from jaxccl.distributed.transport import NETWORK_ONLY

    return _pair(NETWORK_ONLY)


@contextlib.contextmanager
def _sending(sender, peer: int, tag: int, data):
    """``sender`` sends ``data`` to ``peer`` while the block runs, waiting for the send in a thread: each side
    progresses its own worker, as each process does. Yields a dict that holds the send's completion as ``"c"``
    once the block has left."""
    send = sender.isend(peer, tag, data)
    sent = {}
    thread = threading.Thread(target=lambda: sent.update(c=sender.wait(send, 30)))
    thread.start()
    try:
        yield sent
    finally:
        thread.join(30)


def test_transport_moves_bytes_and_reports_completion_times():
    import numpy as np

    a, b = _pair()
    with a, b:
        data = np.random.default_rng(3).integers(1, 2**31 - 1, 1 << 20, dtype=np.int32)  # 4 MiB, never zero
        inbox = np.zeros_like(data)
        recv = b.irecv(0, 5, inbox)
        with _sending(a, 1, 5, data) as sent:
            got = b.wait(recv, 30)
        assert inbox.tobytes() == data.tobytes()
        assert got.bytes == data.nbytes and sent["c"].bytes == data.nbytes
        assert 0 < got.post_ns <= got.done_ns and got.seconds > 0


def test_a_receive_reports_the_bytes_that_arrived_when_they_were_there_first():
    # A receive posted after its (shorter) message arrived completes at once; it reported the receive's size,
    # so the proxy read a message's trailer from beyond what had arrived.
    import numpy as np

    a, b = _pair()
    with a, b:
        data = np.random.default_rng(4).integers(1, 2**31 - 1, 250, dtype=np.int32)  # 1000 bytes, never zero
        a.wait(a.isend(1, 8, data), 5.0)
        time.sleep(0.2)  # process 1's progress thread takes the message in before its receive is posted
        inbox = np.zeros(500, np.int32)
        got = b.wait(b.irecv(0, 8, inbox), 5.0)
        assert got.bytes == data.nbytes
        assert inbox[:250].tobytes() == data.tobytes() and not inbox[250:].any()


def test_transport_progresses_while_the_process_waits_elsewhere():
    # Issue 14: a process that finished its launch and then waited in the key-value store made no call
    # into UCX, and its peer's transfer (a 1 MiB rendezvous needs the receiver's reply) waited for it
    # until a deadline. Process 0 here posts its receive and makes no further call.
    import numpy as np

    a, b = _tcp_pair()
    with a, b:
        data = np.random.default_rng(7).integers(1, 2**31 - 1, 1 << 18, dtype=np.int32)  # 1 MiB, never zero
        inbox = np.zeros_like(data)
        recv = a.irecv(1, 3, inbox)
        sent = b.wait(b.isend(0, 3, data), 5.0)  # only process 1 calls its transport
        assert sent.bytes == data.nbytes
        assert a.wait(recv, 5.0).bytes == data.nbytes and inbox.tobytes() == data.tobytes()


def _piece_bytes() -> int:
    from jaxccl.distributed.transport import _module

    return int(_module().TCP_PIECE_BYTES)


@pytest.mark.parametrize("send_first", [False, True])
def test_messages_over_tcp_arrive_whole_at_every_size_around_a_piece(send_first):
    # Over TCP a message travels in pieces (TCP_PIECE_BYTES, then a shorter last one, possibly empty); sizes below,
    # at and above the piece size and its multiples, posted before or after the message arrived.
    import numpy as np

    piece = _piece_bytes()
    sizes = [0, 1, piece - 1, piece, piece + 1, 2 * piece, 3 * piece + 7, 16 * piece + 12]
    a, b = _tcp_pair()
    with a, b:
        for k, nbytes in enumerate(sizes):
            data = np.random.default_rng(k).integers(1, 255, nbytes, dtype=np.uint8)  # never zero
            inbox = np.zeros(nbytes, np.uint8)
            recv = None if send_first else b.irecv(0, 100 + k, inbox)
            with _sending(a, 1, 100 + k, data) as sent:
                if send_first:
                    time.sleep(0.05)  # process 1's progress thread takes the pieces in before the receive is posted
                    recv = b.irecv(0, 100 + k, inbox)
                got = b.wait(recv, 30)
            assert got.bytes == nbytes and sent["c"].bytes == nbytes, nbytes
            assert inbox.tobytes() == data.tobytes(), nbytes


def test_a_receive_over_tcp_larger_than_its_message_ends_with_the_message():
    # A message whose size is a multiple of the piece size ends with an empty piece, so a larger receive
    # completes with the bytes that came instead of waiting for pieces that never come; a message larger than
    # its receive is an error that says so.
    import numpy as np

    from jaxccl.distributed.transport import TransportArgumentError

    piece = _piece_bytes()
    a, b = _tcp_pair()
    with a, b:
        for k, nbytes in enumerate([2 * piece, 2 * piece + 5, 100]):
            data = np.random.default_rng(k).integers(1, 255, nbytes, dtype=np.uint8)
            inbox = np.zeros(16 * piece, np.uint8)
            recv = b.irecv(0, k, inbox)
            start = time.monotonic()
            with _sending(a, 1, k, data):
                got = b.wait(recv, 10)
            assert got.bytes == nbytes and time.monotonic() - start < 5
            assert inbox[:nbytes].tobytes() == data.tobytes() and not inbox[nbytes:].any()
        data = np.ones(3 * piece, np.uint8)
        recv = b.irecv(0, 9, np.zeros(piece + 10, np.uint8))
        with _sending(a, 1, 9, data), pytest.raises(TransportArgumentError, match="larger than"):
            b.wait(recv, 10)


def _ucx_bytes(text: str) -> float:
    """A size as UCX_PROTO_INFO prints it ("131064", "267K", "inf") in bytes."""
    if text == "inf":
        return float("inf")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(text.rstrip("KMG")) * scale


def test_every_piece_over_tcp_is_one_eager_fragment_in_this_ucx():
    # The safety of receiving in place over TCP rests on UCX sending a piece as one eager fragment (matched and
    # written in one step). UCX chooses its protocol by size; UCX_PROTO_INFO=y prints its choice. A UCX whose
    # choice moves fails here, not in a job.
    import textwrap

    code = textwrap.dedent(
        """
        import threading
        import numpy as np
        from jaxccl.distributed.transport import NETWORK_ONLY, ProcessTransport
        a, b = ProcessTransport(0, 2, options=NETWORK_ONLY), ProcessTransport(1, 2, options=NETWORK_ONLY)
        a.connect(1, b.address()); b.connect(0, a.address())
        data = np.ones(1 << 20, np.uint8); inbox = np.zeros_like(data)
        recv = b.irecv(0, 1, inbox); send = a.isend(1, 1, data)
        th = threading.Thread(target=lambda: a.wait(send, 30)); th.start()
        b.wait(recv, 30); th.join(30); a.close(); b.close()
        """
    )
    env = os.environ | {"UCX_PROTO_INFO": "y"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    table = text[text.index("tagged message by ucp_tag_send* from host memory") :]
    piece = _piece_bytes()
    for line in table.splitlines()[1:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not re.fullmatch(r"[0-9KMG]+(\.\.[0-9KMGinf]+)?", cells[1]):
            continue
        low, _, high = cells[1].partition("..")
        if _ucx_bytes(low) <= piece <= _ucx_bytes(high or low):
            assert "eager" in cells[2] and "multi" not in cells[2], line
            break
    else:
        pytest.fail(f"no protocol covers {piece} bytes in UCX's table:\n{table[:3000]}")


def test_transport_errors_are_named():
    import numpy as np

    from jaxccl.distributed.transport import ProcessTransport, TransportArgumentError
    from jaxccl.errors import DeadlineError

    a, b = _pair()
    with a, b:
        buf = np.ones(16, np.int32)
        with pytest.raises(TransportArgumentError, match="not another process"):
            a.isend(0, 1, buf)
        with pytest.raises(TransportArgumentError, match="not another process"):
            a.irecv(7, 1, buf)
        with pytest.raises(TransportArgumentError, match="48 bits"):
            a.isend(1, 1 << 48, buf)
        with pytest.raises(TransportArgumentError, match="no request"):
            a.wait(12345, 1.0)
        start = time.monotonic()
        with pytest.raises(DeadlineError, match="process 0"):
            b.wait(b.irecv(0, 9, buf), 0.3)  # nobody sends it
        assert time.monotonic() - start < 5
    with pytest.raises(TransportArgumentError, match="option"):
        ProcessTransport(0, 2, options={"NO_SUCH_UCX_VARIABLE": "1"})
    with pytest.raises(TransportArgumentError, match="process id"):
        ProcessTransport(2, 2)


def test_attach_checks_the_mesh_and_the_process():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxccl.distributed.transport import ProcessTransport, attach
    from jaxccl.errors import ExecutorError

    devices = np.array(jax.devices())
    with ProcessTransport(1, 2) as t:
        with pytest.raises(ExecutorError, match="distinct axes"):
            attach(t, Mesh(devices.reshape(2, -1), ("a", "b")), "c")
        with pytest.raises(ExecutorError, match="distinct axes"):
            attach(t, Mesh(devices.reshape(2, -1), ("a", "b")), ("a", "a"))
        with pytest.raises(ExecutorError, match="no rank in this process"):
            attach(t, Mesh(devices, ("d",)), "d")  # every device is process 0's


@needs_netns
def test_measured_inter_process_rates_follow_a_live_cut():
    shaped = LinkShape(rate_mbit=200)
    rates: list[tuple[bool, float]] = []  # (after the cut, process 0's measured send rate)

    def cut_after_three(procs: list[subprocess.Popen]) -> None:
        for line in procs[0].stdout:
            if line.startswith("METER "):
                rates.append((len(rates) >= 3, float(line.split()[2])))
                if len(rates) == 3:
                    lab.shape(1, LinkShape(rate_mbit=shaped.rate_mbit / 5))  # process 1's NIC, both ways

    with NetLab(2, shaped) as lab:
        results = launch(
            [sys.executable, str(WORKER), "meter", "2", "8"],
            2,
            lab=lab,
            env={"JAXCCL_TIMEOUT_S": "60", **NETWORK_ONLY},
            timeout_s=300,
            during=cut_after_three,
        )
    assert results[1].returncode == 0, _report(results)
    print(f"measured send rates of process 0, bytes/s (after the cut?, rate): {rates}")
    before = sorted(r for cut, r in rates if not cut)
    after = sorted(r for cut, r in rates[4:] if cut)  # the step that straddles the cut is left out
    assert len(before) == 3 and len(after) >= 3, rates
    assert before[1] < 1.3 * shaped.rate_bytes_per_s, rates  # no pair measures more than its NIC carries
    assert after[len(after) // 2] < 0.5 * before[1], rates  # the cut is visible in the measured rates
