// Bit-exact element-wise sums of the reduction ops, dst[i] = a[i] + b[i], for both executors.
//
// Float sums start from the additive identity, as XLA's reductions do (((0 + x0) + x1) + ...): every
// float sum adds +0 last, which turns -0 into +0 and changes nothing else, so a fold (x0 + x1) + ... in
// the same order is bitwise equal to XLA's (a running sum that starts from +0 is never -0).
//
// F32 adds natively (one IEEE round to nearest even, the same on CPU and GPU); S32 wraps (unsigned
// arithmetic); BF16 and F16 convert each pair to float, add, and round to nearest even. float has
// more than 2p+2 bits of precision for both formats, so this equals the correctly rounded 16-bit sum.
// The conversions are integer code, so host and device produce the same bits.
#ifndef JAXCCL_XLA_FFI_CORE_SUM_H_
#define JAXCCL_XLA_FFI_CORE_SUM_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hd.h"

namespace jaxccl {

// Element type of a reduction (kNone: the table reduces nothing).
enum class SumType : int32_t { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2, kS32 = 3 };

JAXCCL_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JAXCCL_HD float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

JAXCCL_HD float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

JAXCCL_HD uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

JAXCCL_HD float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3FFu) << 13);
  }
  return BitsFloat(u);
}

JAXCCL_HD uint16_t FloatToF16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: infinity
  if (abs >= 0x38800000u) {  // normal half
    const uint32_t r = abs + 0x0FFFu + ((abs >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: zero
  // Subnormal half: shift the full significand and round to nearest even.
  const uint32_t exp = abs >> 23;
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126 - exp;  // exp in [102, 112]: shift in [14, 24]
  const uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t rounded = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return static_cast<uint16_t>(sign | rounded);
}

// The one definition of each sum, per element.
struct AddF32 {
  JAXCCL_HD float operator()(float x, float y) const { return (x + y) + 0.0f; }
};
struct AddS32 {
  JAXCCL_HD uint32_t operator()(uint32_t x, uint32_t y) const { return x + y; }  // two's-complement wraparound
};
struct AddBf16 {
  JAXCCL_HD uint16_t operator()(uint16_t x, uint16_t y) const {
    return FloatToBf16((Bf16ToFloat(x) + Bf16ToFloat(y)) + 0.0f);
  }
};
struct AddF16 {
  JAXCCL_HD uint16_t operator()(uint16_t x, uint16_t y) const {
    return FloatToF16((F16ToFloat(x) + F16ToFloat(y)) + 0.0f);
  }
};

// Elements begin, begin + stride, ... < n of d = add(x, y); a unit stride is its own loop so that host
// compilers vectorize it.
template <typename T, typename Add>
JAXCCL_HD void AddLanes(void* dst, const void* a, const void* b, size_t n, size_t begin, size_t stride) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  const Add add;
  if (stride == 1) {
    for (size_t i = begin; i < n; ++i) d[i] = add(x[i], y[i]);
  } else {
    for (size_t i = begin; i < n; i += stride) d[i] = add(x[i], y[i]);
  }
}

// Elements begin, begin + stride, ... < n of dst = a + b (dst may alias a or b element for element).
// The CPU executor calls it with (0, 1), one GPU thread with (threadIdx.x, blockDim.x).
JAXCCL_HD void SumLanes(SumType t, void* dst, const void* a, const void* b, size_t n, size_t begin,
                        size_t stride) {
  switch (t) {
    case SumType::kF32: AddLanes<float, AddF32>(dst, a, b, n, begin, stride); break;
    case SumType::kS32: AddLanes<uint32_t, AddS32>(dst, a, b, n, begin, stride); break;
    case SumType::kBF16: AddLanes<uint16_t, AddBf16>(dst, a, b, n, begin, stride); break;
    case SumType::kF16: AddLanes<uint16_t, AddF16>(dst, a, b, n, begin, stride); break;
    case SumType::kNone: break;
  }
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_SUM_H_
