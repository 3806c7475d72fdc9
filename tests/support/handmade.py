"""Hand-built schedules shared by the table and executor tests.

Written with ScheduleBuilder directly, independent of ``jaxccl.synth``, so the
native-side tests do not depend on the baselines they help to check.
"""

from jaxccl.schedule import Buffer, Schedule, ScheduleBuilder

I, O = Buffer.INPUT, Buffer.OUTPUT


def ring_all_gather(n: int, c: int = 1) -> Schedule:
    """A single-channel ring all_gather whose messages carry ``c`` chunks."""
    b = ScheduleBuilder("all_gather", num_ranks=n, chunks_per_period=c)
    last = [None] * n
    for r in range(n):
        b.copy(r, (I, 0), (O, r * c), c)
    for k in range(1, n):
        new = [None] * n
        for r in range(n):
            origin = (r - k + 1) % n
            src = (I, 0) if k == 1 else (O, origin * c)
            after = [last[r]] if last[r] is not None else []
            new[(r + 1) % n] = b.transfer(r, (r + 1) % n, src, (O, origin * c), c, after=after)
        last = new
    return b.build(name="ring")
