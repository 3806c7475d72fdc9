// jaxccl's own persistent worker threads: the CPU executor runs every threadblock
// of a launch on one of them (never on XLA's thread pool, whose threads are the
// ones waiting for the collective). The pool grows when a launch needs more
// threads than are idle and never shrinks; threads are reused across launches.
#ifndef JAXCCL_XLA_FFI_WORKER_POOL_H_
#define JAXCCL_XLA_FFI_WORKER_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

#include "common.h"

namespace jaxccl {

class WorkerPool {
 public:
  static WorkerPool& Get();

  // Runs every task on its own thread concurrently (tasks may block on each other).
  ffi::Error Run(std::vector<std::function<void()>>& tasks);

  size_t NumThreads();
  size_t NumIdle();

 private:
  void Loop();

  static constexpr size_t kMaxThreads = 8192;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t idle_ = 0;
  size_t threads_ = 0;
  size_t spawning_ = 0;  // started but not yet waiting for work
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_WORKER_POOL_H_
