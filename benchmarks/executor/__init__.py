"""Benchmarks: executor (see :mod:`benchmarks`)."""
