// The CPU emulation executor: runs one launch of a compiled table over the buffers of all ranks of a
// group; each rank's XLA thread runs that rank's threadblocks (the GPU runs them as thread blocks).
//
// It runs the executor core (core/protocol.h) that the CUDA kernel runs: the per-rank programs, the
// flag regions with their epoch tags (std::atomic here, device memory there), dataflow order within
// each threadblock, the op data step and the meter (core/meter.h). What is the CPU's own: one thread
// per rank interleaves the rank's threadblocks (a unit never blocks once it runs, so this is the same
// dataflow execution with no thread hand-off between them); a rank with no ready unit sleeps on a
// condition variable until a flag it may need changes (or until the emulated links deliver a message
// it waits for), byte moves are memcpy and vectorized
// loops, and with a Network every message is paced over the emulated links. Every wait ends at the
// launch deadline and then fails the launch with an error naming rank, threadblock and op. A rank
// leaves only after its threadblocks finished and its direct messages were consumed.
#ifndef JAXCCL_XLA_FFI_CPU_EXECUTOR_H_
#define JAXCCL_XLA_FFI_CPU_EXECUTOR_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "host/common.h"
#include "core/protocol.h"
#include "cpu/link_emulation.h"
#include "host/registry.h"
#include "host/table.h"

namespace jaxccl {

struct ProcessGroup;
class ProxyHandle;

// One rank's buffers, as its FFI call saw them.
struct CpuArrival {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_elems = 0;
  int64_t out_elems = 0;
  ffi::DataType in_dtype = ffi::DataType::INVALID;
  ffi::DataType out_dtype = ffi::DataType::INVALID;
  int64_t seq = 0;  // this rank's sequence number of the call on its slot (hot-swap transition point)
  ReduceOp reduce_op = ReduceOp::kSum;  // the call's operator (used when its table reduces)
};

// 64-byte aligned, grow-only byte buffer (scratch, staging and flag memory is reused across launches).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  bool Reserve(size_t bytes);  // false if the allocation failed
  char* data() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  char* data_ = nullptr;
  size_t capacity_ = 0;
};

// What the CPU adds to a posted message (MsgDesc holds pointer and bytes): its passage through the
// emulated links and who sent it, for pacing, the meter and traces. Written before the posted tag.
struct MessageTiming {
  int64_t ready_ns = 0;   // with link pacing: when the emulated links have carried it (steady clock)
  int64_t tx_end_ns = 0;  // with link pacing: when its last byte left the bottleneck link
  int64_t meter_end_ns = 0;  // with link pacing: the end of the interval the meter sees (Transfer)
  int64_t post_ns = 0;    // with a network: when the sender posted it
  int32_t src_tb = 0;     // the sending threadblock (within its rank) and op, for traces
  int32_t src_op = 0;
  bool direct = false;
};

// A rank's sleep: `events` counts flag changes it may care about.
struct alignas(64) TbWait {
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<uint64_t> events{0};
  std::atomic<bool> sleeping{false};
};

// Messages of a connection in flight, for the meter (a connection is active while it has any).
struct alignas(64) ConnMeter {
  std::mutex mu;
  int32_t in_flight = 0;
};

struct alignas(64) RankState {
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending_direct = 0;  // direct messages of this rank not yet consumed
  bool waiting = false;
};

// Reusable per-launch memory and synchronization state of one schedule slot.
struct ExecContext {
  uint64_t epoch = 0;  // tags of this launch (core/protocol.h)
  RegionOwner owner{};  // what the regions' contents belong to (cleared when a launch's differs)
  bool owned = false;
  std::vector<std::unique_ptr<AlignedBuffer>> regions;  // per rank, RegionLayout bytes of 64-bit atomics
  std::vector<std::unique_ptr<AlignedBuffer>> scratch;  // per rank
  std::vector<std::unique_ptr<AlignedBuffer>> staging;  // per (connection, slot) cell, grown on first use
  std::vector<MessageTiming> timing;                    // per (connection, slot) cell
  std::vector<std::unique_ptr<TbWait>> waits;           // per rank
  std::vector<std::unique_ptr<ConnMeter>> meters;       // per connection
  std::vector<std::unique_ptr<RankState>> ranks;
  // Per rank: the direct sends a fold may write itself (CpuLaunch::FindPushes) as (the fold's last op, send)
  // pairs, sorted; derived from the table of version fold_sends_version.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> fold_sends;
  int64_t fold_sends_version = -1;
  // Sizes everything for `t` and starts a new epoch; clears the regions when `next` is not their owner
  // (core/protocol.h, RegionNeedsClearing). False if memory could not be allocated.
  bool Reset(const Table& t, const RegionLayout& layout, size_t scratch_bytes, const RegionOwner& next);
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

// How long a fold waits for its late terms before it runs the ready ones: 1 ns per byte of its range
// (about the time of the extra pass it saves), within these bounds.
inline constexpr int64_t kFoldPatienceMinNs = 20'000;
inline constexpr int64_t kFoldPatienceMaxNs = 2'000'000;

class CpuLaunch {
 public:
  // Starts the launch: checks the arrivals against the table and runs its threadblocks. With a process
  // group (transport/proxy.h), only this process's ranks arrived (the others' entries are empty) and
  // connections to other processes go through the group's transport.
  static ffi::ErrorOr<std::shared_ptr<CpuLaunch>> Start(int64_t slot, int32_t axis_size,
                                                        const std::vector<CpuArrival>& arrivals,
                                                        std::shared_ptr<const ProcessGroup> group = nullptr);
  ~CpuLaunch();

  // Called by rank `rank`'s XLA thread: runs the rank's program, then waits until the rank may return.
  ffi::Error WaitRank(int32_t rank);

  int64_t version() const { return version_; }

 private:
  friend struct CpuProbe;
  // What the proxy of a launch across processes needs from it (transport/proxy_launch.h); executor.cc.
  class ProxyView;
  friend class ProxyView;
  CpuLaunch() = default;

  // Runs rank `rank`'s threadblocks on the calling thread (its XLA thread), in dataflow order.
  void RunRank(int32_t rank);
  // Runs unit `u` of global threadblock `g` (it is ready), or *deferred: it starts a fold whose later
  // terms are not there yet (ExecuteFold); false after Fail.
  bool Execute(int32_t g, const ProgramView& p, const ProgTb& tb, const Unit& u, bool* deferred);
  // Runs unit `u` and the ready units that continue its fold (program.h, next_fold) as one pass over the
  // range, in blocks that stay in the cache; *handled is false when there is nothing to fuse. While a
  // later step of the fold is not ready and the rank's fold patience lasts, it runs nothing: *deferred.
  bool ExecuteFold(int32_t g, const ProgramView& p, const ProgTb& tb, const Unit& u, bool* handled,
                   bool* deferred);
  // A direct send of a fold's result that the fold writes into its receiver's buffer itself.
  struct Push {
    char* dst;  // the receiver's destination
    int32_t peer, conn, msg, tile, send_op, recv_op;
  };
  static constexpr int32_t kMaxPushes = 64;
  // The pushes of the fold that `chain` (its n units, all ready) completes, of range `bytes`: the direct
  // sends of its result (ExecContext::fold_sends) that are ready once the fold is done, whose receives are
  // plain copies ready but for the message. Fills `out`, returns their number.
  int32_t FindPushes(int32_t rank, const ProgramView& p, const Unit* chain, int32_t n, size_t bytes, Push* out);
  void Post(int32_t g, const ProgTb& tb, const Unit& u, const ProgOp& op, const Outgoing& out);
  // The descriptor of the message unit `u` of threadblock `g` receives, checked: its identity is this
  // launch's (core/protocol.h, LaunchIdentity) and its size what the op expects. False after Fail.
  bool TakeMessage(int32_t g, const ProgTb& tb, const ProgOp& op, const Unit& u, MsgDesc* out, MessageTiming* timing);
  // This launch's message identity (LaunchIdentity of the table checksum and the epoch).
  unsigned long long identity() const;
  void Consume(int32_t g, const ProgTb& tb, const Unit& u, const MessageTiming& timing, size_t bytes);
  // Sleeps until a flag rank `rank` may need changes, `wake_ns` passes or the deadline; false at the deadline.
  bool Sleep(int32_t rank, uint64_t seen, int64_t wake_ns);
  void Wake(int32_t rank);
  void FailStuck(int32_t g, const ProgramView& p, const ProgTb& tb, int32_t first);
  void Fail(const std::string& message, ffi::ErrorCode code = ffi::ErrorCode::kDeadlineExceeded);
  void FinishRank(int32_t rank);

  std::atomic<uint64_t>* Flag(int32_t rank, size_t offset, size_t index) const;
  MsgDesc* Desc(int32_t rank, size_t cell) const;
  // Where(global threadblock, rank-local op): "rank R, threadblock T, op I ('kind' from rank P, channel C)".
  std::string Where(int32_t g, int32_t o) const;

  std::shared_ptr<const Table> table_;
  int64_t version_ = 0;
  std::shared_ptr<ExecContextPool> pool_;
  std::unique_ptr<ExecContext> ctx_;
  std::vector<CpuArrival> io_;
  std::vector<RankBuffers> buffers_;  // per rank
  std::vector<int32_t> rank_first_op_;
  RegionLayout layout_{};
  int32_t tiles_ = 1;      // tiles of this launch (core/protocol.h)
  int32_t lookahead_ = kLookahead;
  int32_t op_stride_ = 0;  // op_done entries per tile
  uint64_t epoch_ = 0;
  Reduction reduction_;  // none() when the table reduces nothing
  Clock::time_point deadline_;
  int64_t deadline_ns_ = 0;
  double timeout_s_ = 0;
  int64_t slot_ = 0;
  int64_t start_ns_ = 0;
  std::shared_ptr<Network> net_;             // link emulation / measurement of the slot (may be null)
  bool pace_ = false;
  bool measure_ = false;                     // measuring this launch (never for reductions)
  std::vector<MeasurementCache> caches_;     // per threadblock, when measuring
  // Per rank (its own thread's): until when a fold may wait for its late terms (0: none is waiting).
  std::vector<int64_t> fold_patience_until_;

  // Across processes (null in one process): the group, the proxy of this launch's remote connections and
  // the launch as the proxy sees it.
  std::shared_ptr<const ProcessGroup> group_;
  std::unique_ptr<ProxyView> proxy_view_;
  std::unique_ptr<ProxyHandle> proxy_;
  bool Local(int32_t rank) const;

  std::atomic<bool> aborted_{false};
  std::mutex error_mu_;
  std::string error_;
  ffi::ErrorCode error_code_ = ffi::ErrorCode::kOk;
  std::atomic<int32_t> ranks_running_{0};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
};

// The core's reductions (core/reduce.h) over `n` contiguous elements, in XLA:CPU's arithmetic mode and with the
// widest vector unit this CPU has.
void CpuReduce(Reduction r, char* dst, const char* a, const char* b, size_t n);

// Byte moves of the CPU for the core's data step (RunOpData): memmove (ranges of one buffer may coincide) and
// the core's reductions, contiguous.
struct CpuMover {
  void Copy(char* dst, const char* src, size_t bytes) const {
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
  }
  void Reduce(Reduction r, char* dst, const char* a, const char* b, size_t n) const { CpuReduce(r, dst, a, b, n); }
  void Barrier() const {}
};

// Program order (for comparisons): every threadblock runs its ops in order, untiled. Off by default.
void SetProgramOrder(bool on);
bool ProgramOrder();
// Cap on the tiles of a launch (for comparisons): 1..kMaxTiles; kMaxTiles by default.
bool SetTileCap(int32_t max_tiles);
int32_t TileCap();

// The error of a receiver that got a message of another table or launch (`where`: Where() of its op).
std::string StaleMessageError(const std::string& where, int64_t msg, unsigned long long got,
                              unsigned long long expected, int64_t slot, int64_t version);

// Comparisons only: whether receivers check each message's identity (default on).
void SetIdentityChecks(bool on);
bool IdentityChecks();
// Tests only: the next message posted on `slot` (with `across_processes`, the next one to another process)
// carries the identity of the slot's previous launch (a stale message), which its receiver must refuse.
void InjectStaleMessage(int64_t slot, bool across_processes = false);
// Whether an injection is armed for `slot` and a message of this kind (`remote`: to another process);
// disarms it (the message that takes it carries the stale identity).
bool TakeStaleInjection(int64_t slot, bool remote);

// The context pool of a schedule slot (created on first use, dropped with remove()).
std::shared_ptr<ExecContextPool> ContextPoolFor(int64_t slot);
void DropContextPool(int64_t slot);
size_t NumContextPools();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CPU_EXECUTOR_H_
