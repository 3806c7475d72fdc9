// Bit-exact element-wise reductions of the reduction ops, dst[i] = acc[i] (+) new[i], for every executor.
//
// A reduction is a property of the call, not of the schedule: the same ReduceScatter/AllReduce table
// runs a sum, a max or a min, chosen by a Reduction{element type, operator} that the handler builds from
// the buffer's dtype and the call's `reduce_op` attribute.
//
// The reference is XLA:CPU's all-reduce, measured bit for bit (tests/schedule/test_reductions.py): a fold over
// the ranks in ascending order that starts from the operator's identity and applies, per step,
//   sum: acc = x + acc   (of two NaNs, f32/f64 keep the new term's, f16 the accumulator's)
//   max: acc = (acc < x) ? x : acc   (identity -inf: a NaN term is skipped, ties keep the earlier term)
//   min: acc = (x < acc) ? x : acc   (identity +inf)
// in the element type itself; f16 therefore rounds to f16 after every step. bf16 is reduced in f32
// (XLA promotes it before its all-reduce; the JAX side does the same), so the kBF16 steps here serve
// direct callers and GPUs. float32/float64 run with the CPU's denormals-are-zero and flush-to-zero
// modes (XLA:CPU sets them on its threads; the CPU executor sets them around its reductions):
// subnormal terms count as zeros of their sign, and a max or min returns the flushed term
// (FlushSubnormal, explicit because a select does not flush).
//
// A schedule's fold starts from the first term instead of the identity; each functor below is written
// so that both folds agree bitwise: float sums add +0 after each step (turns -0 into +0, as a sum
// starting from +0 does, and changes nothing else), and max/min replace a NaN accumulator by the
// identity (a running fold from the identity is never NaN). Which NaN a float sum of two NaNs returns
// is chosen explicitly (compilers commute additions, and hardware returns the first operand's NaN).
// Integer sums wrap (unsigned arithmetic of the same width, which is also the signed sum). Complex
// sums are two float sums; bool max/min are uint8 max/min of 0/1. The 16-bit float conversions are
// integer code, so host and device produce the same bits; float has more than 2p+2 bits of precision
// for both formats, so a float operation rounded once to 16 bits equals the correctly rounded 16-bit
// operation.
#ifndef JAXCCL_XLA_FFI_CORE_REDUCE_H_
#define JAXCCL_XLA_FFI_CORE_REDUCE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "hd.h"

namespace jaxccl {

// Element type of a reduction (kNone: the call reduces nothing). Codes 0-3 are the CUDA test entry's.
enum class ElemType : int32_t {
  kNone = -1,
  kF32 = 0,
  kBF16 = 1,
  kF16 = 2,
  kS32 = 3,
  kS8 = 4,
  kS16 = 5,
  kS64 = 6,
  kU8 = 7,
  kU16 = 8,
  kU32 = 9,
  kU64 = 10,
  kF64 = 11,
  kC64 = 12,
  kC128 = 13,
  kPred = 14,
};

// The reduction operator of a call (the FFI attribute `reduce_op`; jaxccl/schedule/reduction.py mirrors it).
enum class ReduceOp : int32_t { kSum = 0, kMax = 1, kMin = 2 };

inline constexpr int32_t kNumReduceOps = 3;

inline const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown";
}

struct Reduction {
  ElemType type = ElemType::kNone;
  ReduceOp op = ReduceOp::kSum;
  JAXCCL_HD bool none() const { return type == ElemType::kNone; }
};

// Whether `op` is defined on `type` (complex numbers are not ordered; a sum of bools is not a bool).
JAXCCL_HD constexpr bool Reducible(ElemType type, ReduceOp op) {
  if (type == ElemType::kNone) return false;
  if (op == ReduceOp::kSum) return type != ElemType::kPred;
  return type != ElemType::kC64 && type != ElemType::kC128;
}

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

JAXCCL_HD double BitsDouble(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double f;
  std::memcpy(&f, &u, 8);
  return f;
#endif
}

JAXCCL_HD uint64_t DoubleBits(double f) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(f));
#else
  uint64_t u;
  std::memcpy(&u, &f, 8);
  return u;
#endif
}

// Branch-free helpers on the bits: host compilers vectorize integer masks, but (with -ftrapping-math, the
// default) neither selects on float comparisons such as y != y nor additions under a condition.
JAXCCL_HD bool IsNan(float f) { return (FloatBits(f) & 0x7FFFFFFFu) > 0x7F800000u; }
JAXCCL_HD bool IsNan(double f) { return (DoubleBits(f) & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
JAXCCL_HD float Select(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return BitsFloat((FloatBits(a) & m) | (FloatBits(b) & ~m));
}
JAXCCL_HD double Select(bool c, double a, double b) {
  const uint64_t m = 0ull - static_cast<uint64_t>(c);
  return BitsDouble((DoubleBits(a) & m) | (DoubleBits(b) & ~m));
}

// A subnormal as a zero of its sign (what denormals-are-zero makes of an operand).
JAXCCL_HD float FlushSubnormal(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t m = 0u - static_cast<uint32_t>((u & 0x7F800000u) == 0);
  return BitsFloat(u & ~(m & 0x7FFFFFFFu));
}
JAXCCL_HD double FlushSubnormal(double f) {
  const uint64_t u = DoubleBits(f);
  const uint64_t m = 0ull - static_cast<uint64_t>((u & 0x7FF0000000000000ull) == 0);
  return BitsDouble(u & ~(m & 0x7FFFFFFFFFFFFFFFull));
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

// Infinities of the float types, by their bits (usable in device code without <limits>).
template <typename T>
struct Inf;
template <>
struct Inf<float> {
  JAXCCL_HD static float Pos() { return BitsFloat(0x7F800000u); }
  JAXCCL_HD static float Neg() { return BitsFloat(0xFF800000u); }
};
template <>
struct Inf<double> {
  JAXCCL_HD static double Pos() { return BitsDouble(0x7FF0000000000000ull); }
  JAXCCL_HD static double Neg() { return BitsDouble(0xFFF0000000000000ull); }
};

// The one definition of each step, per element: x is the accumulator, y the new term.
template <typename T>
struct SumFloat {
  JAXCCL_HD T operator()(T x, T y) const {
    return Select(IsNan(y), y + T(0), (y + x) + T(0));  // y + 0 quiets a NaN y, as y + x would
  }
};
template <typename T>
struct MaxFloat {
  JAXCCL_HD T operator()(T x, T y) const {
    const T acc = Select(IsNan(x), Inf<T>::Neg(), FlushSubnormal(x));
    y = FlushSubnormal(y);
    return Select(acc < y, y, acc);
  }
};
template <typename T>
struct MinFloat {
  JAXCCL_HD T operator()(T x, T y) const {
    const T acc = Select(IsNan(x), Inf<T>::Pos(), FlushSubnormal(x));
    y = FlushSubnormal(y);
    return Select(y < acc, y, acc);
  }
};

// 16-bit floats: computed in float, the bits of the result rounded (sum) or chosen (max/min). Their
// subnormals are normal floats, so no flushing happens (bf16 reductions of XLA:CPU run in f32 instead:
// the JAX side promotes them).
struct F16Codec {
  JAXCCL_HD static float Decode(uint16_t h) { return F16ToFloat(h); }
  JAXCCL_HD static uint16_t Encode(float f) { return FloatToF16(f); }
  static constexpr uint16_t kPosInf = 0x7C00u, kNegInf = 0xFC00u;
};
struct Bf16Codec {
  JAXCCL_HD static float Decode(uint16_t h) { return Bf16ToFloat(h); }
  JAXCCL_HD static uint16_t Encode(float f) { return FloatToBf16(f); }
  static constexpr uint16_t kPosInf = 0x7F80u, kNegInf = 0xFF80u;
};
template <class C>
struct SumHalf {
  JAXCCL_HD uint16_t operator()(uint16_t x, uint16_t y) const {
    const float xf = C::Decode(x), yf = C::Decode(y);
    const float s = xf != xf ? xf : xf + yf;  // of two NaNs the accumulator's (XLA:CPU's f16 rule)
    return C::Encode(s + 0.0f);
  }
};
template <class C>
struct MaxHalf {
  JAXCCL_HD uint16_t operator()(uint16_t x, uint16_t y) const {
    const float xf = C::Decode(x), yf = C::Decode(y);
    if (xf != xf) return yf > Inf<float>::Neg() ? y : C::kNegInf;  // NaN accumulator: the identity
    return xf < yf ? y : x;
  }
};
template <class C>
struct MinHalf {
  JAXCCL_HD uint16_t operator()(uint16_t x, uint16_t y) const {
    const float xf = C::Decode(x), yf = C::Decode(y);
    if (xf != xf) return yf < Inf<float>::Pos() ? y : C::kPosInf;
    return yf < xf ? y : x;
  }
};

// Integers: U is the unsigned type of the same width (wrapping sums), S the type as compared.
template <typename U>
struct SumWrap {
  JAXCCL_HD U operator()(U x, U y) const { return static_cast<U>(x + y); }  // two's-complement wraparound
};
template <typename S>
struct MaxInt {
  JAXCCL_HD S operator()(S x, S y) const { return x < y ? y : x; }
};
template <typename S>
struct MinInt {
  JAXCCL_HD S operator()(S x, S y) const { return y < x ? y : x; }
};

// Elements begin, begin + stride, ... < n of d = step(x, y); a unit stride is its own loop so that host
// compilers vectorize it.
template <typename T, typename Step>
JAXCCL_HD void StepLanes(void* dst, const void* a, const void* b, size_t n, size_t begin, size_t stride) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  const Step step;
  if (stride == 1) {
    for (size_t i = begin; i < n; ++i) d[i] = step(x[i], y[i]);
  } else {
    for (size_t i = begin; i < n; i += stride) d[i] = step(x[i], y[i]);
  }
}

template <typename T, typename Sum, typename Max, typename Min>
JAXCCL_HD void OpLanes(ReduceOp op, void* dst, const void* a, const void* b, size_t n, size_t begin,
                       size_t stride) {
  switch (op) {
    case ReduceOp::kSum: StepLanes<T, Sum>(dst, a, b, n, begin, stride); break;
    case ReduceOp::kMax: StepLanes<T, Max>(dst, a, b, n, begin, stride); break;
    case ReduceOp::kMin: StepLanes<T, Min>(dst, a, b, n, begin, stride); break;
  }
}

template <typename S, typename U>
JAXCCL_HD void IntLanes(ReduceOp op, void* dst, const void* a, const void* b, size_t n, size_t begin,
                        size_t stride) {
  switch (op) {
    case ReduceOp::kSum: StepLanes<U, SumWrap<U>>(dst, a, b, n, begin, stride); break;
    case ReduceOp::kMax: StepLanes<S, MaxInt<S>>(dst, a, b, n, begin, stride); break;
    case ReduceOp::kMin: StepLanes<S, MinInt<S>>(dst, a, b, n, begin, stride); break;
  }
}

// Elements begin, begin + stride, ... < n of dst = a (+) b, a the accumulator (dst may alias a or b
// element for element). For complex types an element is two lanes and begin/stride count lanes.
// The CPU executor calls it with (0, 1), one GPU thread with (threadIdx.x, blockDim.x). Pairs that
// Reducible() refuses do nothing (the handlers refuse them first).
JAXCCL_HD void ReduceLanes(Reduction r, void* dst, const void* a, const void* b, size_t n, size_t begin,
                           size_t stride) {
  if (!Reducible(r.type, r.op)) return;
  switch (r.type) {
    case ElemType::kF32: OpLanes<float, SumFloat<float>, MaxFloat<float>, MinFloat<float>>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kF64: OpLanes<double, SumFloat<double>, MaxFloat<double>, MinFloat<double>>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kC64: StepLanes<float, SumFloat<float>>(dst, a, b, 2 * n, begin, stride); break;
    case ElemType::kC128: StepLanes<double, SumFloat<double>>(dst, a, b, 2 * n, begin, stride); break;
    case ElemType::kBF16: OpLanes<uint16_t, SumHalf<Bf16Codec>, MaxHalf<Bf16Codec>, MinHalf<Bf16Codec>>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kF16: OpLanes<uint16_t, SumHalf<F16Codec>, MaxHalf<F16Codec>, MinHalf<F16Codec>>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kS8: IntLanes<int8_t, uint8_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kS16: IntLanes<int16_t, uint16_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kS32: IntLanes<int32_t, uint32_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kS64: IntLanes<int64_t, uint64_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kU8:
    case ElemType::kPred: IntLanes<uint8_t, uint8_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kU16: IntLanes<uint16_t, uint16_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kU32: IntLanes<uint32_t, uint32_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kU64: IntLanes<uint64_t, uint64_t>(r.op, dst, a, b, n, begin, stride); break;
    case ElemType::kNone: break;
  }
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_REDUCE_H_
