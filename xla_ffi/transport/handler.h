// The CPU FFI handler `jaxccl_cpu_mp_collective`: `jaxccl_cpu_collective` for an axis whose ranks live in
// several processes (the process group of transport/proxy.h). Same operands, result and attributes.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_HANDLER_H_
#define JAXCCL_XLA_FFI_TRANSPORT_HANDLER_H_

#include "xla/ffi/api/ffi.h"

namespace jaxccl {

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcclCpuMpCollective);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_HANDLER_H_
