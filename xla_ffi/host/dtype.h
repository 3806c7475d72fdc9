// Names and byte widths of XLA FFI dtypes for the executors.
#ifndef JAXCCL_XLA_FFI_DTYPE_H_
#define JAXCCL_XLA_FFI_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/reduce.h"
#include "xla/ffi/api/ffi.h"

namespace jaxccl {

inline const char* DTypeName(xla::ffi::DataType t) {
  using D = xla::ffi::DataType;
  switch (t) {
    case D::INVALID: return "INVALID";
    case D::PRED: return "PRED";
    case D::S1: return "S1";
    case D::S2: return "S2";
    case D::S4: return "S4";
    case D::S8: return "S8";
    case D::S16: return "S16";
    case D::S32: return "S32";
    case D::S64: return "S64";
    case D::U1: return "U1";
    case D::U2: return "U2";
    case D::U4: return "U4";
    case D::U8: return "U8";
    case D::U16: return "U16";
    case D::U32: return "U32";
    case D::U64: return "U64";
    case D::F16: return "F16";
    case D::F32: return "F32";
    case D::F64: return "F64";
    case D::BF16: return "BF16";
    case D::C64: return "C64";
    case D::C128: return "C128";
    case D::TOKEN: return "TOKEN";
    case D::F8E5M2: return "F8E5M2";
    case D::F8E4M3: return "F8E4M3";
    case D::F8E4M3FN: return "F8E4M3FN";
    case D::F8E4M3B11FNUZ: return "F8E4M3B11FNUZ";
    case D::F8E5M2FNUZ: return "F8E5M2FNUZ";
    case D::F8E4M3FNUZ: return "F8E4M3FNUZ";
    case D::F8E3M4: return "F8E3M4";
    case D::F4E2M1FN: return "F4E2M1FN";
    case D::F8E8M0FNU: return "F8E8M0FNU";
  }
  return "UNKNOWN";
}

// Bytes per element for byte copies; 0 for types that are not whole bytes (sub-byte, token, invalid).
inline size_t CopyableByteWidth(xla::ffi::DataType t) {
  using D = xla::ffi::DataType;
  switch (t) {
    case D::S1:
    case D::S2:
    case D::S4:
    case D::U1:
    case D::U2:
    case D::U4:
    case D::F4E2M1FN:
      return 0;
    default:
      return xla::ffi::ByteWidth(t);
  }
}

// The reduction element type of a dtype (core/reduce.h); kNone for dtypes the reductions do not support.
inline ElemType ElemTypeFor(xla::ffi::DataType t) {
  using D = xla::ffi::DataType;
  switch (t) {
    case D::F32: return ElemType::kF32;
    case D::F64: return ElemType::kF64;
    case D::BF16: return ElemType::kBF16;
    case D::F16: return ElemType::kF16;
    case D::C64: return ElemType::kC64;
    case D::C128: return ElemType::kC128;
    case D::S8: return ElemType::kS8;
    case D::S16: return ElemType::kS16;
    case D::S32: return ElemType::kS32;
    case D::S64: return ElemType::kS64;
    case D::U8: return ElemType::kU8;
    case D::U16: return ElemType::kU16;
    case D::U32: return ElemType::kU32;
    case D::U64: return ElemType::kU64;
    case D::PRED: return ElemType::kPred;
    default: return ElemType::kNone;
  }
}

// The operator of the FFI attribute `reduce_op`, or an error for codes that name none.
inline xla::ffi::ErrorOr<ReduceOp> ReduceOpOf(int64_t code) {
  if (code < 0 || code >= kNumReduceOps) {
    return xla::ffi::Unexpected<xla::ffi::Error>(xla::ffi::Error::InvalidArgument(
        "jaxccl: reduce_op must be 0 (sum), 1 (max) or 2 (min), got " + std::to_string(code)));
  }
  return static_cast<ReduceOp>(code);
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_DTYPE_H_
