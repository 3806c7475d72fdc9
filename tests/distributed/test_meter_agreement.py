"""Cross-process links are measured with the executor's meter (xla_ffi/core/meter.h), through the native module.

``TransportMeter`` replays the transport's records through ``meter.h``'s window state machine
(``native.meter_windows``). Checked here: the state machine the module exports is ``meter.h``'s (streams
whose windows follow from its rules by hand: the threshold, idle gaps of timed messages, small windows,
connections already busy), and on random record streams the windows ``TransportMeter`` finds are those
``meter.h``'s rule defines at the inter-node threshold of 1: a window per period in which at least one
message of the pair is in flight, with the bytes delivered in it over its duration.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxccl.distributed.transport import MIN_WINDOW_BYTES, TransportMeter
from jaxccl.errors import ExecutorError

native = pytest.importorskip("jaxccl.runtime.native")

POST, DELIVERED = 0, 1


def post(t: int, *, busy: bool = True, tx: tuple[int, int] | None = None) -> tuple[int, int, int, int, int]:
    return (POST, int(busy), tx[0] if tx else t, tx[1] if tx else -1, 0)


def delivered(t: int, nbytes: int, *, idle: bool = True) -> tuple[int, int, int, int, int]:
    return (DELIVERED, int(idle), t, 0, nbytes)


def windows(events: list, threshold: int = 1, min_window_bytes: int = 0) -> list[tuple[int, float]]:
    bw = native.meter_windows(events, threshold=threshold, min_window_bytes=min_window_bytes)
    return [(i, float(b)) for i, b in enumerate(bw) if b > 0]


def test_a_window_opens_at_the_threshold_and_closes_below_it():
    # threshold 2: the window opens with the second connection (t=100) and closes when one empties (t=300)
    got = windows([post(0), post(100), delivered(300, 1000), delivered(400, 1000)], threshold=2)
    assert got == [(2, pytest.approx(1000 / 200e-9))]
    # a message on a connection that is already busy opens nothing
    assert windows([post(0), post(100, busy=False), delivered(300, 1000, idle=False), delivered(400, 1000)], 2) == []


def test_idle_gaps_of_timed_messages_are_not_counted():
    # the second message starts transmitting 200 ns after the first left the wire: 200 ns of 400 are idle
    events = [post(0, tx=(0, 100)), post(50, tx=(300, 400)), delivered(150, 500), delivered(400, 700)]
    assert windows(events) == [(3, pytest.approx(1200 / 200e-9))]


def test_small_windows_are_dropped():
    events = [post(0), delivered(1000, 100), post(2000), delivered(3000, 5000)]
    assert windows(events, min_window_bytes=1000) == [(3, pytest.approx(5000 / 1000e-9))]


def test_bad_events_are_refused():
    with pytest.raises(ExecutorError, match="neither a post"):
        native.meter_windows([(2, 0, 0, 0, 0)], threshold=1, min_window_bytes=0)
    with pytest.raises(ExecutorError, match="threshold"):
        native.meter_windows([post(0)], threshold=0, min_window_bytes=0)
    with pytest.raises(ExecutorError, match="rows of 5"):
        native.meter_windows(np.zeros(7, np.int64), threshold=1, min_window_bytes=0)


def busy_periods(msgs: list[tuple[int, int, int]], min_window_bytes: int) -> list[float]:
    """``meter.h`` at threshold 1, by its definition: the periods in which some message is in flight (one
    message posted as another completes continues the period), each with the bytes of its messages."""
    out = []
    group: list[tuple[int, int, int]] = []
    for m in sorted(msgs) + [None]:
        if group and (m is None or m[0] > max(g[1] for g in group)):
            start, end = group[0][0], max(g[1] for g in group)
            nbytes = sum(g[2] for g in group)
            if end > start and nbytes > 0 and nbytes >= min_window_bytes:
                out.append(nbytes / ((end - start) * 1e-9))
            group = []
        if m is not None:
            group.append(m)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_transport_windows_are_the_meters_windows(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    records = []
    for _ in range(rng.randint(0, 60)):
        src, dst = rng.sample(range(n), 2)
        start = rng.randrange(0, 20_000) * 100  # coarse times: equal and touching ones occur
        records.append((src, dst, rng.randint(1, 1 << 20), start, start + rng.randrange(0, 300) * 100))
    limit = rng.choice((0, MIN_WINDOW_BYTES, 1 << 19))
    got = TransportMeter.pair_windows(records, min_window_bytes=limit)
    want: dict[tuple[int, int], list[float]] = {}
    for src, dst, nbytes, t0, t1 in records:
        want.setdefault((src, dst), []).append((t0, t1, nbytes))
    want = {p: w for p, msgs in want.items() if (w := busy_periods(msgs, limit))}
    assert got.keys() == want.keys()
    for p in want:
        assert got[p] == pytest.approx(want[p], rel=1e-12), p
    rates = TransportMeter.pair_rates(records, n, min_window_bytes=limit)
    for (src, dst), w in want.items():
        assert rates[src, dst] == pytest.approx(sum(w) / len(w), rel=1e-12)
    assert np.isnan(rates).sum() == n * n - len(want)


def test_one_busy_period_is_bytes_over_time_in_flight():
    # the rule the meter replaced agrees wherever a pair was busy once: all bytes over the time in flight
    mib = 1 << 20
    records = [(0, 1, mib, 0, 4_000_000), (0, 1, mib, 1_000_000, 2_000_000), (0, 1, mib, 4_000_000, 6_000_000)]
    assert TransportMeter.pair_rates(records, 2)[0, 1] == pytest.approx(3 * mib / 6e-3)


def test_windows_faster_than_the_path_can_carry_are_left_out():
    from jaxccl.distributed.transport import MAX_OVER_CAPACITY, plausible_ceiling
    from jaxccl.errors import ArgumentError
    from jaxccl.labs.netlab import LinkShape
    from jaxccl.labs.rail import rank_rail

    topo = rank_rail(2, 2, LinkShape(rate_mbit=200))  # 25 MB/s NICs
    ceiling = plausible_ceiling(topo, 4)
    assert np.isinf(np.diag(ceiling)).all()
    assert ceiling[0, 2] == pytest.approx(MAX_OVER_CAPACITY * 25e6)
    mib = 1 << 20
    # 40 ms at ~26 MB/s (the link), then a send the sockets' buffers took in 0.5 ms (2 GB/s): not the link
    records = [(0, 2, mib, 0, 40_000_000), (0, 2, mib, 100_000_000, 100_500_000)]
    assert TransportMeter.pair_rates(records, 4)[0, 2] > 1e9  # the artifact dominates the mean
    assert TransportMeter.pair_rates(records, 4, ceiling=ceiling)[0, 2] == pytest.approx(mib / 0.04)
    with pytest.raises(ArgumentError, match="ceiling must be 4 x 4"):
        TransportMeter(4, ceiling=np.ones((2, 2)))
