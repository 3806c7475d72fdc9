#include "reduce.h"

namespace jaxccl {
namespace {

void SumF32(void* dst, const void* a, const void* b, size_t n) {
  float* d = static_cast<float*>(dst);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
}

void SumS32(void* dst, const void* a, const void* b, size_t n) {
  uint32_t* d = static_cast<uint32_t*>(dst);  // unsigned: two's-complement wraparound without UB
  const uint32_t* x = static_cast<const uint32_t*>(a);
  const uint32_t* y = static_cast<const uint32_t*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
}

void SumBf16(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(Bf16ToFloat(x[i]) + Bf16ToFloat(y[i]));
}

void SumF16(void* dst, const void* a, const void* b, size_t n) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) d[i] = FloatToF16(F16ToFloat(x[i]) + F16ToFloat(y[i]));
}

}  // namespace

SumFn SumFor(xla::ffi::DataType dtype) {
  switch (dtype) {
    case xla::ffi::DataType::F32: return SumF32;
    case xla::ffi::DataType::S32: return SumS32;
    case xla::ffi::DataType::BF16: return SumBf16;
    case xla::ffi::DataType::F16: return SumF16;
    default: return nullptr;
  }
}

}  // namespace jaxccl
