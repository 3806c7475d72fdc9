// The executor core's launch agreement (core/launch.h) for FFI calls: a call as a LaunchArrival, a
// refusal as an ffi::Error.
#ifndef JAXCCL_XLA_FFI_HOST_LAUNCH_H_
#define JAXCCL_XLA_FFI_HOST_LAUNCH_H_

#include <cstdint>

#include "core/launch.h"
#include "host/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jaxccl {

inline LaunchArrival ArrivalOf(xla::ffi::DataType in_dtype, xla::ffi::DataType out_dtype, int64_t in_elems,
                               int64_t out_elems, ReduceOp reduce_op, int64_t seq) {
  LaunchArrival a;
  a.seq = seq;
  a.in_elems = in_elems;
  a.out_elems = out_elems;
  a.in_dtype = static_cast<int32_t>(in_dtype);
  a.out_dtype = static_cast<int32_t>(out_dtype);
  a.in_dtype_name = DTypeName(in_dtype);
  a.out_dtype_name = DTypeName(out_dtype);
  a.esize = static_cast<int32_t>(CopyableByteWidth(in_dtype));
  a.elem = ElemTypeFor(in_dtype);
  a.reduce_op = reduce_op;
  return a;
}

inline xla::ffi::Error LaunchRefusal(const LaunchError& e) { return xla::ffi::Error::InvalidArgument(e.message); }

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_HOST_LAUNCH_H_
