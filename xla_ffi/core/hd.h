// JAXCCL_HD marks the executor core's functions for both compilers: plain inline host code under a
// C++ compiler, `__host__ __device__` under nvcc, so the CPU executor and the CUDA kernel compile
// the very same definitions.
#ifndef JAXCCL_XLA_FFI_CORE_HD_H_
#define JAXCCL_XLA_FFI_CORE_HD_H_

#if defined(__CUDACC__)
#define JAXCCL_HD __host__ __device__ __forceinline__
#else
#define JAXCCL_HD inline
#endif

#endif  // JAXCCL_XLA_FFI_CORE_HD_H_
