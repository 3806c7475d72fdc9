"""Benchmarks: tune (see :mod:`benchmarks`)."""
