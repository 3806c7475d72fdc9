"""Test setup: 8 emulated CPU devices before JAX starts."""

import jaxccl

jaxccl.emulate(8)
