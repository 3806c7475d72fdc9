"""Schedule synthesizers and baselines; each returns a :class:`jaxccl.schedule.Schedule`."""

__all__: list[str] = []
