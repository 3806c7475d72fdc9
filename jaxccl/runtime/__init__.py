"""The JAX side of execution: FFI target registration, primitives, backends and the schedule registry.

Submodules are imported on demand (``jaxccl.runtime.native`` loads the compiled
extension and registers its FFI targets), so importing this package neither
starts JAX nor requires the native module to be built.
"""
