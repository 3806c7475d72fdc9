"""jaxccl's CUDA executor for CUDA 12: the module ``_native_cuda``, which jaxccl loads by itself.

Import jaxccl, not this package: ``jaxccl.runtime.cuda_plugin`` names the module, and
``jaxccl info`` says which CUDA module is in use.
"""
