"""Benchmarks: synth (see :mod:`benchmarks`)."""
