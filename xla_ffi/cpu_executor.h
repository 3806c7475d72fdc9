// The CPU emulation executor: runs one launch of a compiled table over the
// buffers of all ranks of a group, each threadblock on a jaxccl worker thread.
//
// Protocol (docs/schedule-ir.md, "Op semantics"): a connection (sender, receiver,
// channel) is a FIFO ring of `num_slots` message slots. A send waits while the
// ring is full, then posts either a pointer into its own buffer (a *direct*
// send: the receiver copies straight from there, one copy per chunk) or a copy
// in a staging buffer owned by the slot. A receive waits for its message,
// copies or reduces it into place, and frees the slot. A rank leaves only after
// its threadblocks finished and its direct messages were consumed. Every wait
// blocks on a condition variable with the launch deadline and, on expiry,
// fails the launch with an error naming rank, threadblock and op.
#ifndef JAXCCL_XLA_FFI_CPU_EXECUTOR_H_
#define JAXCCL_XLA_FFI_CPU_EXECUTOR_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "network.h"
#include "registry.h"
#include "table.h"

namespace jaxccl {

// One rank's buffers, as its FFI call saw them.
struct CpuArrival {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_elems = 0;
  int64_t out_elems = 0;
  ffi::DataType in_dtype = ffi::DataType::INVALID;
  ffi::DataType out_dtype = ffi::DataType::INVALID;
  int64_t seq = 0;  // this rank's sequence number of the call on its slot (hot-swap transition point)
};

// 64-byte aligned, grow-only byte buffer (scratch and staging memory is reused across launches).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  bool Reserve(size_t bytes);  // false if the allocation failed
  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

struct Message {
  const char* data = nullptr;
  size_t bytes = 0;
  bool direct = false;
  int64_t ready_ns = 0;  // with link pacing: when the emulated links have carried it (steady clock)
  int64_t tx_end_ns = 0;  // with link pacing: when its last byte left the bottleneck link
  int64_t post_ns = 0;    // with a network: when the sender posted it
  int32_t src_tb = 0;     // the sending threadblock (within its rank) and op, for traces
  int32_t src_op = 0;
};

struct alignas(64) ConnState {
  std::mutex mu;
  std::condition_variable cv_send;  // the sender waits for a free slot
  std::condition_variable cv_recv;  // the receiver waits for a message
  int64_t posted = 0;
  int64_t consumed = 0;
  bool send_waiting = false;
  bool recv_waiting = false;
  std::vector<Message> ring;
  std::vector<std::unique_ptr<AlignedBuffer>> staging;  // one per slot, grown on first use
};

struct alignas(64) TbState {
  std::mutex mu;
  std::condition_variable cv;
  int32_t done = 0;  // ops completed
  int32_t waiters = 0;
};

struct alignas(64) RankState {
  std::mutex mu;
  std::condition_variable cv;
  int32_t tbs_left = 0;
  int64_t pending_direct = 0;  // direct messages of this rank not yet consumed
  bool waiting = false;
};

// Reusable per-launch memory and synchronization state of one schedule slot.
struct ExecContext {
  std::vector<std::unique_ptr<AlignedBuffer>> scratch;  // per rank
  std::vector<std::unique_ptr<ConnState>> conns;
  std::vector<std::unique_ptr<TbState>> tbs;
  std::vector<std::unique_ptr<RankState>> ranks;
  // Sizes everything for `t` and resets counters; false if scratch memory could not be allocated.
  bool Reset(const Table& t, size_t scratch_bytes);
};

class ExecContextPool {
 public:
  std::unique_ptr<ExecContext> Acquire();
  void Release(std::unique_ptr<ExecContext> ctx);
  size_t NumFree();

 private:
  static constexpr size_t kMaxFree = 4;
  std::mutex mu_;
  std::vector<std::unique_ptr<ExecContext>> free_;
};

class CpuLaunch {
 public:
  // Starts the launch: checks the arrivals against the table and runs its threadblocks.
  static ffi::ErrorOr<std::shared_ptr<CpuLaunch>> Start(int64_t slot, int32_t axis_size,
                                                        const std::vector<CpuArrival>& arrivals);
  ~CpuLaunch();

  // Called by rank `rank`'s XLA thread: waits until that rank may return.
  ffi::Error WaitRank(int32_t rank);

  int64_t version() const { return version_; }

 private:
  CpuLaunch() = default;

  void RunThreadblock(int32_t g);
  bool Execute(int32_t g, int32_t i, const TableOp& op);
  bool WaitDependency(int32_t g, int32_t i, const TableOp& op);
  bool WaitMessage(int32_t g, int32_t i, const TableOp& op, Message* msg);
  // Sleeps until the emulated links delivered msg (no-op without pacing); false (after Fail) on abort/deadline.
  bool WaitDelivered(int32_t g, int32_t i, const TableOp& op, const Message& msg);
  // Frees msg's slot; `delivered_ns` (when its bytes became visible) feeds the measurement accumulators.
  void ConsumeMessage(int32_t g, const Message& msg, int64_t delivered_ns);
  bool WaitSlot(int32_t g, int32_t i, const TableOp& op);
  void PostMessage(int32_t g, int32_t i, const TableOp& op, Message msg);
  // Send waits for a free slot, then Post stages (unless direct) and posts the message.
  bool Send(int32_t g, int32_t i, const TableOp& op, BufferId buf, int32_t off);
  bool Post(int32_t g, int32_t i, const TableOp& op, BufferId buf, int32_t off);
  // The outgoing staging slot of op's message, grown to `bytes`; nullptr (after Fail) if allocation fails.
  AlignedBuffer* Staging(int32_t g, int32_t i, const TableOp& op, size_t bytes);
  // Every message that reaches a rank passes through Deliver: it waits for the emulated links
  // (WaitDelivered), then the receiving threadblock copies it (local == nullptr) or sums it with `local`
  // into dst and frees its slot. False (after Fail) if the wait failed.
  bool Deliver(int32_t g, int32_t i, const TableOp& op, void* dst, const void* local, const Message& msg);
  void Fail(const std::string& message, ffi::ErrorCode code = ffi::ErrorCode::kDeadlineExceeded);
  void FinishThreadblock(int32_t g);

  char* Ptr(int32_t rank, BufferId buf, int32_t chunk) const;
  size_t Bytes(int32_t off, int32_t count) const;
  std::string Where(int32_t g, int32_t i, const TableOp& op) const;

  std::shared_ptr<const Table> table_;
  int64_t version_ = 0;
  std::shared_ptr<ExecContextPool> pool_;
  std::unique_ptr<ExecContext> ctx_;
  std::vector<CpuArrival> io_;
  size_t esize_ = 0;
  int64_t period_elems_ = 0;
  using SumFnPtr = void (*)(void*, const void*, const void*, size_t);
  SumFnPtr sum_ = nullptr;
  Clock::time_point deadline_;
  double timeout_s_ = 0;
  int64_t slot_ = 0;
  int64_t start_ns_ = 0;
  std::shared_ptr<Network> net_;             // link emulation / measurement of the slot (may be null)
  bool pace_ = false;
  bool measure_ = false;                     // measuring this launch (never for reductions)
  std::vector<MeasurementCache> caches_;     // per threadblock, when measuring

  std::atomic<bool> aborted_{false};
  std::mutex error_mu_;
  std::string error_;
  ffi::ErrorCode error_code_ = ffi::ErrorCode::kOk;
  std::atomic<int32_t> tbs_running_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
};

// The context pool of a schedule slot (created on first use, dropped with remove()).
std::shared_ptr<ExecContextPool> ContextPoolFor(int64_t slot);
void DropContextPool(int64_t slot);
size_t NumContextPools();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CPU_EXECUTOR_H_
