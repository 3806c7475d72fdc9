// The CPU FFI handler `jaxccl_cpu_collective`.
#ifndef JAXCCL_XLA_FFI_CPU_HANDLER_H_
#define JAXCCL_XLA_FFI_CPU_HANDLER_H_

#include <cstddef>

#include "xla/ffi/api/ffi.h"

namespace jaxccl {

// Operands: x (any dtype, the rank's input flattened), coords (int32[2]: rank within the axis, group id).
// Result: out (same dtype, flattened). Attributes: slot, site, axis_size (int64).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcclCpuCollective);

// Rendezvous bookkeeping, for tests: entries waiting or kept as failed tombstones, occurrence counters.
size_t CpuPendingRendezvous();
size_t CpuOccurrenceEntries();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CPU_HANDLER_H_
