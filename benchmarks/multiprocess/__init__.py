"""Benchmarks: multiprocess (see :mod:`benchmarks`)."""
