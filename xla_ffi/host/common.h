// Small helpers shared by the CPU and CUDA executors.
#ifndef JAXCCL_XLA_FFI_COMMON_H_
#define JAXCCL_XLA_FFI_COMMON_H_

#include <chrono>
#include <sstream>
#include <string>
#include <thread>
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

// A wait loop's pause between two looks at what it waits for: `yields` yields first (what it waits for usually
// comes from a thread that runs as soon as this one lets it), then sleeps of `sleep` each (the other threads, and
// processes on the same cores, run). Reset() after progress starts over with yields.
class Backoff {
 public:
  Backoff(int yields, std::chrono::microseconds sleep) : yields_(yields), sleep_(sleep) {}
  void Pause() {
    if (spins_ < yields_) {
      ++spins_;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(sleep_);
    }
  }
  void Reset() { spins_ = 0; }

 private:
  int yields_;
  std::chrono::microseconds sleep_;
  int spins_ = 0;
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_COMMON_H_
