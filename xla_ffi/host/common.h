// Small helpers shared by the CPU and CUDA executors.
#ifndef JAXCCL_XLA_FFI_COMMON_H_
#define JAXCCL_XLA_FFI_COMMON_H_

#include <chrono>
#include <sstream>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxccl {

namespace ffi = xla::ffi;
using Clock = std::chrono::steady_clock;

inline Clock::time_point DeadlineAfter(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

template <typename... Args>
std::string StrCat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <typename T>
ffi::ErrorOr<T> ErrorResult(ffi::Error e) {
  return ffi::Unexpected<ffi::Error>(std::move(e));
}

// Formats a duration in seconds the way error messages print it ("60 s", "0.25 s").
inline std::string Seconds(double s) { return StrCat(s, " s"); }

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_COMMON_H_
