"""Benchmarks: control (see :mod:`benchmarks`)."""
