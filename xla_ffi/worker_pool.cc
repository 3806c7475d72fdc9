#include "worker_pool.h"

#include <system_error>
#include <thread>

namespace jaxccl {

WorkerPool& WorkerPool::Get() {
  static WorkerPool* pool = new WorkerPool();  // never destroyed: its threads are detached
  return *pool;
}

ffi::Error WorkerPool::Run(std::vector<std::function<void()>>& tasks) {
  std::unique_lock<std::mutex> lock(mu_);
  const size_t count = tasks.size();
  for (auto& t : tasks) queue_.push_back(std::move(t));
  // Each queued task needs a thread of its own: start the ones the idle workers cannot cover.
  while (queue_.size() > idle_ + spawning_) {
    if (threads_ >= kMaxThreads) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        StrCat("jaxccl: the executor needs more than ", kMaxThreads, " worker threads"));
    }
    try {
      std::thread(&WorkerPool::Loop, this).detach();
    } catch (const std::system_error& e) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        StrCat("jaxccl: cannot start an executor worker thread: ", e.what()));
    }
    ++threads_;
    ++spawning_;
  }
  lock.unlock();
  for (size_t i = 0; i < count; ++i) cv_.notify_one();
  return ffi::Error::Success();
}

void WorkerPool::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  --spawning_;
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return !queue_.empty(); });
    --idle_;
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // release what the task holds before going idle
    lock.lock();
  }
}

size_t WorkerPool::NumThreads() {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_;
}

size_t WorkerPool::NumIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_;
}

}  // namespace jaxccl
