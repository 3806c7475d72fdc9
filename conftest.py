"""pytest setup for the whole repository: 8 emulated CPU devices before JAX starts.

At the repository root so that it also serves ``pytest --doctest-modules jaxccl``.
"""

import jaxccl

jaxccl.emulate(8)
