#include "transport/handshake_harness.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/launch.h"
#include "cpu/executor.h"  // CpuMover: the CPU's byte moves for the core's data step
#include "host/core_api.h"
#include "host/launch.h"
#include "transport/mapped_launch.h"
#include "transport/proxy.h"

namespace jaxccl {
namespace {

// Host memory, 256-byte aligned, zeroed when it grows (as fresh device memory is zeroed before use).
class HostBlock {
 public:
  ~HostBlock() { std::free(data_); }
  bool Reserve(size_t bytes) {
    if (bytes <= bytes_) return true;
    const size_t rounded = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded);
    if (p == nullptr) return false;
    std::memset(p, 0, rounded);
    std::free(data_);
    data_ = static_cast<char*>(p);
    bytes_ = rounded;
    return true;
  }
  char* data() const { return data_; }

 private:
  char* data_ = nullptr;
  size_t bytes_ = 0;
};

// The proxy's staging: host memory (a GPU's is device memory).
class HostStaging final : public StagingMemory {
 public:
  MemoryKind kind() const override { return MemoryKind::kHost; }
  ffi::ErrorOr<char*> Acquire(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (p == nullptr) {
      return ErrorResult<char*>(
          ffi::Error(ffi::ErrorCode::kResourceExhausted, StrCat("no ", bytes, " bytes of memory")));
    }
    return static_cast<char*>(p);
  }
  void Release(char* data, bool reusable) override {
    if (reusable) std::free(data);  // else the transport may still write into it: never freed
  }
};

// A slot's memory, kept from launch to launch as the GPU keeps a slot's workspace.
struct SlotMemory {
  std::mutex mu;  // one launch of a slot at a time in this process
  unsigned long long epoch = 0;
  RegionOwner owner{};
  bool owned = false;
  std::vector<std::unique_ptr<HostBlock>> regions;  // per rank of the group: a local rank's, or a shadow
  std::vector<std::unique_ptr<HostBlock>> scratch, staging;  // per local rank
};

SlotMemory& MemoryOf(int64_t slot) {
  static std::mutex mu;
  static auto* slots = new std::map<int64_t, std::unique_ptr<SlotMemory>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& m = (*slots)[slot];
  if (!m) m = std::make_unique<SlotMemory>();
  return *m;
}

// One rank's flag region (core/protocol.h, RegionLayout) as host atomics.
struct HostRegion {
  char* base;
  RegionLayout layout;
  std::atomic<uint64_t>* op_done() const { return reinterpret_cast<std::atomic<uint64_t>*>(base + layout.op_done()); }
  std::atomic<uint64_t>* posted() const { return reinterpret_cast<std::atomic<uint64_t>*>(base + layout.posted()); }
  std::atomic<uint64_t>* consumed() const { return reinterpret_cast<std::atomic<uint64_t>*>(base + layout.consumed()); }
  MsgDesc* msgs() const { return reinterpret_cast<MsgDesc*>(base + layout.msgs()); }
  std::atomic<int32_t>* error() const { return reinterpret_cast<std::atomic<int32_t>*>(base + layout.error()); }
};

// The flags for the core's readiness rule, as the kernel's thread 0 reads them.
struct HostProbe {
  HostRegion me;
  unsigned long long epoch;
  int32_t op_stride, num_slots;
  bool Done(int32_t tile, int32_t o) const {
    return me.op_done()[static_cast<size_t>(tile) * op_stride + o].load(std::memory_order_acquire) >= Tag(epoch, 1);
  }
  bool Posted(int32_t conn, int32_t m) const {
    return me.posted()[me.layout.cell(conn, m)].load(std::memory_order_acquire) >= Tag(epoch, m + 1);
  }
  bool SlotFree(int32_t conn, int32_t m) const {
    return me.consumed()[me.layout.cell(conn, m)].load(std::memory_order_acquire) >= Tag(epoch, m - num_slots + 1);
  }
};

void RecordError(const HostRegion& me, int32_t code, int32_t tb, int32_t op) {
  std::atomic<int32_t>* e = me.error();
  int32_t ok = kProtocolOk;
  if (e[0].compare_exchange_strong(ok, code)) {
    e[1].store(tb);
    e[2].store(op);
  }
}

bool Failed(const HostRegion& me) { return me.error()->load(std::memory_order_acquire) != kProtocolOk; }

// The kernel's bounded back-off (__nanosleep there): yields first, then short sleeps.
Backoff KernelBackoff() { return Backoff(32, std::chrono::microseconds(50)); }

// One local rank's launch, as KernelArgs (kernels/interpreter.cuh) carries it.
struct HostKernel {
  const int32_t* prog;
  int32_t rank;
  int32_t tiles;
  Reduction reduction;
  RankBuffers buffers;
  unsigned long long epoch;
  unsigned long long identity;
  int64_t timeout_ns;
  RegionLayout layout;
  char* staging;
  size_t stage_bytes;
  std::vector<char*> regions;
};

constexpr int32_t kFailed = -3;

// Threadblock `t` of the kernel's rank: the interpreter kernel's loop, one thread doing what its thread 0 and its
// block do.
void RunThreadblock(const HostKernel& a, int32_t t) {
  const ProgramView p(a.prog);
  if (t >= p.num_tbs()) return;
  const ProgTb tb = p.tb(t);
  const HostRegion me{a.regions[a.rank], a.layout};
  const int64_t deadline = NowNs() + a.timeout_ns;
  const int32_t num_slots = p.num_slots();
  HostProbe probe{me, a.epoch, p.max_ops(), num_slots};
  int32_t first = 0;
  for (;;) {
    int32_t v = kNoneReady;
    for (Backoff backoff = KernelBackoff();; backoff.Pause()) {
      v = NextReadyUnit(p, tb, a.tiles, &first, probe);
      if (v != kNoneReady) break;
      if (Failed(me)) {
        v = kFailed;
        break;
      }
      if (NowNs() > deadline) {
        const Unit u = UnitOf(p, tb, first);
        RecordError(me, StuckReason(p, tb, u, p.op(u.op), probe), t, u.op - tb.first_op);
        v = kFailed;
        break;
      }
    }
    MsgDesc msg{};
    if (v >= 0) {
      const Unit u = UnitOf(p, tb, v);
      if (u.recv_msg >= 0) {
        msg = me.msgs()[a.layout.cell(tb.recv_conn, u.recv_msg)];
        const int32_t refused = MessageError(msg, a.identity, a.buffers.RecvBytes(p.op(u.op), u.tile));
        if (refused != kProtocolOk) {
          RecordError(me, refused, t, u.op - tb.first_op);
          v = kFailed;
        }
      }
    }
    if (v < 0) break;
    const Unit u = UnitOf(p, tb, v);
    const ProgOp op = p.op(u.op);
    char* stage = nullptr;
    if (op.sends() && !op.direct()) stage = a.staging + StageOffset(p, tb.send_conn, u.send_msg, a.stage_bytes);
    CpuMover mover;
    const Outgoing out =
        RunOpData(op, u.tile, a.buffers, a.reduction, reinterpret_cast<const char*>(msg.ptr), msg.bytes, stage, mover);
    if (u.recv_msg >= 0) {
      const HostRegion sender{a.regions[tb.recv_peer], a.layout};
      sender.consumed()[a.layout.cell(tb.recv_conn, u.recv_msg)].store(Tag(a.epoch, u.recv_msg + 1),
                                                                         std::memory_order_release);
    }
    if (u.send_msg >= 0) {
      const HostRegion receiver{a.regions[tb.send_peer], a.layout};
      const size_t cell = a.layout.cell(tb.send_conn, u.send_msg);
      receiver.msgs()[cell] = MsgDesc{reinterpret_cast<unsigned long long>(out.ptr), out.bytes, a.identity, 0};
      receiver.posted()[cell].store(Tag(a.epoch, u.send_msg + 1), std::memory_order_release);
    }
    me.op_done()[static_cast<size_t>(u.tile) * p.max_ops() + u.op].store(Tag(a.epoch, 1), std::memory_order_release);
  }
  // A rank leaves only after its messages were consumed: receivers read its buffers and staging in place.
  if (tb.send_conn >= 0 && tb.num_sends > 0 && !Failed(me)) {
    const int32_t total = a.tiles * tb.num_sends;
    for (int32_t s = 0; s < num_slots; ++s) {
      const int32_t last = LastMessageOfSlot(s, total, num_slots);
      if (last < 0) break;
      const std::atomic<uint64_t>& flag = me.consumed()[a.layout.cell(tb.send_conn, s)];
      for (Backoff backoff = KernelBackoff(); flag.load(std::memory_order_acquire) < Tag(a.epoch, last + 1);
           backoff.Pause()) {
        if (Failed(me)) break;
        if (NowNs() > deadline) {
          RecordError(me, kTimeoutDrain, t, tb.num_ops);
          break;
        }
      }
    }
  }
}

HarnessResult Refused(ffi::Error e) {
  HarnessResult r;
  r.error = std::move(e);
  return r;
}

ffi::Error CoreError(const std::string& what) { return ffi::Error::InvalidArgument(what); }

}  // namespace

HarnessResult RunMappedLaunch(const HarnessOptions& options, const std::vector<HarnessCall>& calls) {
  const CoreApi* core = GetCoreApi();
  std::string error;
  std::shared_ptr<const ProcessGroup> group;
  if (!core->process_group(options.group, &group, &error)) return Refused(CoreError(error));
  const int32_t n = static_cast<int32_t>(group->process_of_rank.size());
  if (calls.size() != static_cast<size_t>(group->num_local)) {
    return Refused(ffi::Error::InvalidArgument(StrCat("jaxccl harness: process ", group->process_id, " runs ",
                                                      group->num_local, " ranks of group ", options.group, ", got ",
                                                      calls.size(), " calls")));
  }
  std::vector<LaunchArrival> arrivals(n);
  for (LaunchArrival& a : arrivals) a.present = false;
  for (const HarnessCall& c : calls) {
    if (c.rank < 0 || c.rank >= n || !group->Local(c.rank) || arrivals[c.rank].present) {
      return Refused(ffi::Error::InvalidArgument(
          StrCat("jaxccl harness: rank ", c.rank, " is not a rank of process ", group->process_id, " (or twice)")));
    }
    int64_t seq = 0;
    if (!core->note_issued(options.slot, c.rank, &seq, &error)) return Refused(CoreError(error));
    arrivals[c.rank] = ArrivalOf(c.dtype, c.dtype, c.in_elems, c.out_elems, options.reduce_op, seq);
  }
  TableSnapshot snap;
  if (!core->acquire(options.slot, AgreedSequence(arrivals), &snap, &error)) return Refused(CoreError(error));
  const Table& t = *snap.table;
  LaunchOptions launch_options;  // pipelined, as a GPU
  launch_options.tiles = options.tiles;
  launch_options.slot = options.slot;
  launch_options.version = snap.version;
  LaunchPlan plan;
  if (LaunchError e = PlanLaunch(t, arrivals, launch_options, &plan); !e.ok()) return Refused(LaunchRefusal(e));
  const size_t stage_bytes = (plan.largest_staged + 255) / 256 * 256;

  SlotMemory& mem = MemoryOf(options.slot);
  std::lock_guard<std::mutex> lock(mem.mu);
  const RegionOwner owner{snap.version, t.checksum, plan.layout};
  const bool clear = !mem.owned || RegionNeedsClearing(mem.owner, owner);
  mem.owned = false;
  while (mem.regions.size() < static_cast<size_t>(n)) mem.regions.push_back(std::make_unique<HostBlock>());
  while (mem.scratch.size() < calls.size()) mem.scratch.push_back(std::make_unique<HostBlock>());
  while (mem.staging.size() < calls.size()) mem.staging.push_back(std::make_unique<HostBlock>());
  auto no_memory = [] {
    return Refused(ffi::Error(ffi::ErrorCode::kResourceExhausted, "jaxccl harness: out of memory"));
  };
  for (int32_t r = 0; r < n; ++r) {
    if (!mem.regions[r]->Reserve(plan.layout.bytes())) return no_memory();
    if (clear) std::memset(mem.regions[r]->data(), 0, plan.layout.bytes());
  }
  mem.owner = owner;
  mem.owned = true;
  const unsigned long long epoch = ++mem.epoch;

  MappedLaunchSpec spec;
  ProxyLaunchView& v = spec.view;
  v.table = snap.table;
  v.slot = options.slot;
  v.version = snap.version;
  v.tiles = plan.tiles;
  v.layout = plan.layout;
  v.epoch = epoch;
  v.identity = LaunchIdentity(t.checksum, epoch);
  v.timeout_s = core->timeout_s();
  v.deadline = DeadlineAfter(v.timeout_s);
  v.memory = options.wire;
  std::vector<HostKernel> kernels;
  for (size_t k = 0; k < calls.size(); ++k) {
    const HarnessCall& c = calls[k];
    const ProgramView program(t.programs[c.rank].data());
    if (!mem.scratch[k]->Reserve(plan.scratch_bytes + 1) ||
        !mem.staging[k]->Reserve(static_cast<size_t>(program.num_staged_conns()) * t.num_slots * stage_bytes + 1)) {
      return no_memory();
    }
    HostKernel kernel;
    kernel.prog = t.programs[c.rank].data();
    kernel.rank = c.rank;
    kernel.tiles = plan.tiles;
    kernel.reduction = plan.reduction;
    kernel.buffers = RankBuffers{static_cast<const char*>(c.in), static_cast<char*>(c.out), mem.scratch[k]->data(),
                                 plan.period_elems, t.chunks_per_period, plan.esize, plan.tiles};
    kernel.epoch = epoch;
    kernel.identity = v.identity;
    kernel.timeout_ns = static_cast<int64_t>((v.timeout_s + kMappedRankGraceS) * 1e9);
    kernel.layout = plan.layout;
    kernel.staging = mem.staging[k]->data();
    kernel.stage_bytes = stage_bytes;
    kernels.push_back(std::move(kernel));
    std::memset(mem.regions[c.rank]->data() + plan.layout.error(), 0, 16);  // before the proxy may store into it
  }
  v.buffers.assign(n, RankBuffers{nullptr, nullptr, nullptr, plan.period_elems, t.chunks_per_period, plan.esize,
                                  plan.tiles});
  for (const HostKernel& kernel : kernels) v.buffers[kernel.rank] = kernel.buffers;
  for (int32_t r = 0; r < n; ++r) spec.regions.push_back(mem.regions[r]->data());
  for (HostKernel& kernel : kernels) kernel.regions = spec.regions;
  HostStaging staging;
  spec.staging = &staging;

  std::unique_ptr<ProxyHandle> proxy;
  if (!core->start_mapped_proxy(spec, group, &proxy, &error)) return Refused(ffi::Error::Internal(error));
  std::vector<std::thread> threads;
  for (const HostKernel& kernel : kernels) {
    for (int32_t j = 0; j < t.rank_num_tbs[kernel.rank]; ++j) {
      threads.emplace_back([&kernel, j] { RunThreadblock(kernel, j); });
    }
  }
  for (std::thread& th : threads) th.join();
  proxy->WaitDone();

  HarnessResult result;
  for (const HostKernel& kernel : kernels) {
    const std::atomic<int32_t>* e = HostRegion{spec.regions[kernel.rank], plan.layout}.error();
    result.ranks.push_back(HarnessRankError{e[0].load(), e[1].load(), e[2].load()});
  }
  if (ffi::Error failure = proxy->Failure(); failure.failure()) {
    result.error = std::move(failure);  // it names the process; the ranks stopped on its kPeerFailed
    return result;
  }
  for (size_t k = 0; k < kernels.size(); ++k) {
    const HarnessRankError& e = result.ranks[k];
    if (e.code == kProtocolOk) continue;
    const bool timeout = e.code != kSizeMismatch && e.code != kStaleMessage;
    result.error = ffi::Error(timeout ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal,
                              StrCat("jaxccl harness: rank ", kernels[k].rank, ", threadblock ", e.tb, ", op ", e.op,
                                     " failed with protocol error ", e.code, " (core/protocol.h, ProtocolError)"));
    proxy->Abort(result.error.message(), timeout ? ffi::ErrorCode::kDeadlineExceeded : ffi::ErrorCode::kInternal);
    break;
  }
  return result;
}

}  // namespace jaxccl
