// The CPU FFI handler `jaxccl_cpu_collective`.
#ifndef JAXCCL_XLA_FFI_CPU_HANDLER_H_
#define JAXCCL_XLA_FFI_CPU_HANDLER_H_

#include <cstddef>
#include <cstdint>

#include "cpu/executor.h"
#include "xla/ffi/api/ffi.h"

namespace jaxccl {

// What one rank brings to a launch (its buffers, dtypes, operator and sequence number on `slot`), from a
// handler's operands and attributes; shared by `jaxccl_cpu_collective` and `jaxccl_cpu_mp_collective`.
ffi::ErrorOr<CpuArrival> ArrivalOf(ffi::AnyBuffer x, ffi::AnyBuffer out, int64_t slot, int32_t rank,
                                   int64_t reduce_op);

// Operands: x (any dtype, the rank's input flattened), coords (int32[2]: rank within the axis, group id).
// Result: out (same dtype, flattened). Attributes: slot, site, axis_size, reduce_op (int64).
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcclCpuCollective);

// Rendezvous bookkeeping, for tests: entries waiting or kept as failed tombstones, occurrence counters.
size_t CpuPendingRendezvous();
size_t CpuOccurrenceEntries();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CPU_HANDLER_H_
