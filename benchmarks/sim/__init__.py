"""Benchmarks: sim (see :mod:`benchmarks`)."""
