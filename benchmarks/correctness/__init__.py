"""Benchmarks: correctness (see :mod:`benchmarks`)."""
