#include "cpu/executor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#if defined(__x86_64__) || defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include "core/launch.h"
#include "core/stable_source.h"
#include "host/launch.h"
#include "transport/proxy.h"

namespace jaxccl {

// ------------------------------------------------------------------ memory

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

bool AlignedBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return true;
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* p = nullptr;
  if (posix_memalign(&p, 64, rounded) != 0) return false;
  std::free(data_);
  data_ = static_cast<char*>(p);
  capacity_ = rounded;
  return true;
}

template <typename T>
static void ResizeStates(std::vector<std::unique_ptr<T>>& v, size_t n) {
  while (v.size() < n) v.push_back(std::make_unique<T>());
}

bool ExecContext::Reset(const Table& t, const RegionLayout& layout, size_t scratch_bytes, const RegionOwner& next) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free,
                "flag regions are arrays of lock-free 64-bit atomics");
  ResizeStates(regions, t.num_ranks);
  ResizeStates(scratch, t.num_ranks);
  ResizeStates(waits, t.num_ranks);
  ResizeStates(meters, t.conns.size());
  ResizeStates(ranks, t.num_ranks);
  ResizeStates(staging, layout.cells());
  if (timing.size() < layout.cells()) timing.resize(layout.cells());
  // Kept memory holds only tags of older epochs as long as the owner stays; another table or layout
  // would read its descriptors as tags (core/protocol.h), so it starts from zero, like fresh memory.
  const bool clear = !owned || RegionNeedsClearing(owner, next);
  owned = false;  // until every region is sized and cleared: a failed allocation leaves them to clear next time
  for (int32_t r = 0; r < t.num_ranks; ++r) {
    AlignedBuffer& region = *regions[r];
    const size_t had = region.capacity();
    if (!region.Reserve(layout.bytes())) return false;
    if (clear || region.capacity() != had) std::memset(region.data(), 0, region.capacity());
    if (!scratch[r]->Reserve(scratch_bytes)) return false;
    RankState& rs = *ranks[r];
    rs.pending_direct = 0;
    rs.waiting = false;
  }
  for (auto& m : meters) m->in_flight = 0;
  owner = next;
  owned = true;
  ++epoch;
  return true;
}

std::unique_ptr<ExecContext> ExecContextPool::Acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return std::make_unique<ExecContext>();
  auto ctx = std::move(free_.back());
  free_.pop_back();
  return ctx;
}

void ExecContextPool::Release(std::unique_ptr<ExecContext> ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.size() < kMaxFree) free_.push_back(std::move(ctx));
}

size_t ExecContextPool::NumFree() {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

namespace {
std::mutex pools_mu;
std::map<int64_t, std::shared_ptr<ExecContextPool>>& Pools() {
  static auto* pools = new std::map<int64_t, std::shared_ptr<ExecContextPool>>();
  return *pools;
}
}  // namespace

namespace {
std::atomic<bool> g_program_order{false};
std::atomic<int32_t> g_tile_cap{kMaxTiles};
std::atomic<bool> g_identity_checks{true};
std::atomic<int64_t> g_stale_slot{0};  // 0: no injection armed (slots start at 1)
std::atomic<bool> g_stale_remote_only{false};
}  // namespace

std::string StaleMessageError(const std::string& where, int64_t msg, unsigned long long got,
                              unsigned long long expected, int64_t slot, int64_t version) {
  auto name = [](unsigned long long id) {
    std::ostringstream os;
    os << "table 0x" << std::hex << IdentityTable(id) << std::dec << " launch " << IdentityLaunch(id);
    return os.str();
  };
  return StrCat("jaxccl: stale message: ", where, " received message ", msg, " of ", name(got),
                " but runs ", name(expected), " (slot ", slot, ", version ", version,
                "); a message outlived its launch and was refused");
}

void SetIdentityChecks(bool on) { g_identity_checks.store(on); }
bool IdentityChecks() { return g_identity_checks.load(); }
void InjectStaleMessage(int64_t slot, bool across_processes) {
  g_stale_remote_only.store(across_processes);
  g_stale_slot.store(slot);
}
bool TakeStaleInjection(int64_t slot, bool remote) {
  if (g_stale_slot.load(std::memory_order_relaxed) != slot) return false;
  if (!remote && g_stale_remote_only.load()) return false;
  int64_t armed = slot;
  return g_stale_slot.compare_exchange_strong(armed, 0);
}

void SetProgramOrder(bool on) { g_program_order.store(on); }
bool ProgramOrder() { return g_program_order.load(); }

bool SetTileCap(int32_t max_tiles) {
  if (max_tiles < 1 || max_tiles > kMaxTiles) return false;
  g_tile_cap.store(max_tiles);
  return true;
}
int32_t TileCap() { return g_tile_cap.load(); }

std::shared_ptr<ExecContextPool> ContextPoolFor(int64_t slot) {
  std::lock_guard<std::mutex> lock(pools_mu);
  auto& p = Pools()[slot];
  if (!p) p = std::make_shared<ExecContextPool>();
  return p;
}

void DropContextPool(int64_t slot) {
  std::lock_guard<std::mutex> lock(pools_mu);
  Pools().erase(slot);
}

size_t NumContextPools() {
  std::lock_guard<std::mutex> lock(pools_mu);
  return Pools().size();
}

// ------------------------------------------------------------------ launch

namespace {
// Per rank, the direct sends whose bytes a fold computes (CpuLaunch::FindPushes), as sorted (dependency,
// send) pairs: plain direct sends of the range a fold writes whose dependency is one of the fold's
// continuations (program.h, next_fold) and whose source is final at it (core/stable_source.h).
void FoldSends(const Table& t, std::vector<std::vector<std::pair<int32_t, int32_t>>>* out) {
  out->assign(t.num_ranks, {});
  for (int32_t r = 0; r < t.num_ranks; ++r) {
    const ProgramView p(t.programs[r].data());
    std::vector<char> continues(p.num_ops(), 0);
    for (int32_t o = 0; o < p.num_ops(); ++o) {
      const int32_t next = p.op(o).next_fold;
      if (next >= 0) continues[next] = 1;
    }
    ProgramAncestry ancestry(p);
    for (int32_t o = 0; o < p.num_ops(); ++o) {
      const ProgOp op = p.op(o);
      if (op.kind != OpCode::kSend || !op.direct() || op.dep < 0 || !continues[op.dep]) continue;
      const ProgOp last = p.op(op.dep);
      if (op.src_buf != last.dst_buf || op.src_off != last.dst_off || op.count != last.count) continue;
      if (SourceFinalAtDependency(ancestry, o)) (*out)[r].emplace_back(op.dep, o);
    }
    std::sort((*out)[r].begin(), (*out)[r].end());
  }
}
}  // namespace

// ------------------------------------------------------------------ across processes

namespace {
// Staging memory of finished launches' proxies, reused by the next (a fresh allocation of many MiB would fault
// in every page again on every launch).
constexpr size_t kMaxPooledStaging = 4;
std::mutex staging_mu;
std::vector<std::unique_ptr<AlignedBuffer>>& StagingPool() {
  static auto* p = new std::vector<std::unique_ptr<AlignedBuffer>>();
  return *p;
}

// The proxy's staging on the CPU: pooled host memory.
class CpuStaging final : public StagingMemory {
 public:
  MemoryKind kind() const override { return MemoryKind::kHost; }
  ffi::ErrorOr<char*> Acquire(size_t bytes) override {
    std::unique_ptr<AlignedBuffer> b;
    {
      std::lock_guard<std::mutex> lock(staging_mu);
      auto& pool = StagingPool();
      if (!pool.empty()) {
        b = std::move(pool.back());
        pool.pop_back();
      }
    }
    if (!b) b = std::make_unique<AlignedBuffer>();
    if (!b->Reserve(bytes + kAlign)) {
      return ErrorResult<char*>(
          ffi::Error(ffi::ErrorCode::kResourceExhausted, StrCat("no ", bytes, " bytes of memory")));
    }
    const uintptr_t at = (reinterpret_cast<uintptr_t>(b->data()) + kAlign - 1) / kAlign * kAlign;
    char* data = reinterpret_cast<char*>(at);
    held_.emplace_back(data, std::move(b));
    return data;
  }
  void Release(char* data, bool reusable) override {
    for (auto it = held_.begin(); it != held_.end(); ++it) {
      if (it->first != data) continue;
      std::unique_ptr<AlignedBuffer> b = std::move(it->second);
      held_.erase(it);
      if (!reusable) {
        (void)b.release();  // the transport may still write into it
        return;
      }
      std::lock_guard<std::mutex> lock(staging_mu);
      if (StagingPool().size() < kMaxPooledStaging) StagingPool().push_back(std::move(b));
      return;
    }
  }

 private:
  static constexpr size_t kAlign = 256;  // AlignedBuffer gives 64
  std::vector<std::pair<char*, std::unique_ptr<AlignedBuffer>>> held_;
};
}  // namespace

// The launch as its proxy sees it (transport/proxy_launch.h): the proxy posts into the ranks' regions and wakes
// their threads; a rank thread hands its messages to other processes to the proxy itself (CpuLaunch::Post).
class CpuLaunch::ProxyView final : public ProxyLaunch {
 public:
  explicit ProxyView(CpuLaunch* l) : l_(l) {
    v_.table = l->table_;
    v_.slot = l->slot_;
    v_.version = l->version_;
    v_.tiles = l->tiles_;
    v_.layout = l->layout_;
    v_.epoch = l->epoch_;
    v_.identity = l->identity();
    v_.deadline = l->deadline_;
    v_.timeout_s = l->timeout_s_;
    v_.buffers = l->buffers_;
    v_.memory = MemoryKind::kHost;
    // The timing of a message from another process is empty (no pacing, not direct): the proxy posts it
    // without writing it, so the cells of those connections are cleared before any is posted.
    const Table& t = *l->table_;
    for (int32_t c = 0; c < t.num_conns(); ++c) {
      if (!l->Local(t.conns[c].receiver) || l->Local(t.conns[c].sender)) continue;
      for (int32_t s = 0; s < l->layout_.num_slots; ++s) l->ctx_->timing[l->layout_.cell(c, s)] = MessageTiming{};
    }
  }
  const ProxyLaunchView& view() const override { return v_; }
  std::atomic<uint64_t>* Flag(int32_t rank, size_t offset, size_t index) const override {
    return l_->Flag(rank, offset, index);
  }
  MsgDesc* Desc(int32_t rank, size_t cell) const override { return l_->Desc(rank, cell); }
  void Delivered(int32_t rank, size_t cell) override { l_->Wake(rank); }
  void SendDone(int32_t rank, int32_t conn, int32_t msg, bool direct) override {
    l_->Wake(rank);
    if (!direct) return;
    RankState& sender = *l_->ctx_->ranks[rank];
    std::lock_guard<std::mutex> lock(sender.mu);
    if (--sender.pending_direct == 0 && sender.waiting) sender.cv.notify_all();
  }
  void Fail(const std::string& message, ffi::ErrorCode code) override { l_->Fail(message, code); }
  bool Aborted() const override { return l_->aborted_.load(); }
  std::string Where(int32_t global_tb, int32_t rank_op) const override { return l_->Where(global_tb, rank_op); }
  StagingMemory& staging() override { return staging_; }

 private:
  CpuLaunch* l_;
  ProxyLaunchView v_;
  CpuStaging staging_;
};

ffi::ErrorOr<std::shared_ptr<CpuLaunch>> CpuLaunch::Start(int64_t slot, int32_t axis_size,
                                                          const std::vector<CpuArrival>& arrivals,
                                                          std::shared_ptr<const ProcessGroup> group) {
  using R = std::shared_ptr<CpuLaunch>;
  std::vector<LaunchArrival> calls(axis_size);
  for (int32_t r = 0; r < axis_size; ++r) {
    const CpuArrival& a = arrivals[r];
    calls[r] = ArrivalOf(a.in_dtype, a.out_dtype, a.in_elems, a.out_elems, a.reduce_op, a.seq);
    calls[r].present = !group || group->Local(r);
  }
  auto snap = Registry::Get().Acquire(slot, AgreedSequence(calls));
  if (!snap.has_value()) return ErrorResult<R>(std::move(snap.error()));
  const Table& t = *snap->table;
  // With link emulation the program runs in tiles, so that relayed messages pipeline as on a GPU.
  std::shared_ptr<Network> net = group ? nullptr : NetworkOfSlot(slot);  // across processes the links are real
  const bool pace = net && net->pacing();
  LaunchOptions options;
  options.pipelined = pace && !ProgramOrder();
  options.max_tiles = TileCap();
  options.slot = slot;
  options.version = snap->version;
  LaunchPlan plan;
  if (LaunchError e = PlanLaunch(t, calls, options, &plan); !e.ok()) return ErrorResult<R>(LaunchRefusal(e));

  R launch(new CpuLaunch());
  launch->table_ = snap->table;
  launch->version_ = snap->version;
  launch->pool_ = ContextPoolFor(slot);
  launch->ctx_ = launch->pool_->Acquire();
  launch->io_ = arrivals;
  launch->reduction_ = plan.reduction;
  launch->timeout_s_ = Registry::Get().timeout_s();
  launch->slot_ = slot;
  launch->start_ns_ = NowNs();
  launch->group_ = group;
  launch->net_ = std::move(net);
  if (launch->net_) {
    if (launch->net_->num_ranks() != t.num_ranks) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: slot ", slot, " runs on an emulated network of ", launch->net_->num_ranks(),
                 " GPUs but its schedule has ", t.num_ranks, " ranks")));
    }
    launch->pace_ = pace;
    launch->measure_ = launch->net_->measuring() && !t.has_reduction;  // MCCL Sec. 3: no reductions
    if (launch->measure_) launch->caches_.resize(t.tbs.size());
  }
  launch->tiles_ = plan.tiles;
  launch->lookahead_ = ProgramOrder() ? 1 : kLookahead;
  launch->op_stride_ = plan.op_stride;
  launch->layout_ = plan.layout;
  const RegionOwner owner{snap->version, t.checksum, launch->layout_};
  if (!launch->ctx_->Reset(t, launch->layout_, plan.scratch_bytes, owner)) {
    const std::string what = StrCat("jaxccl: cannot allocate ", plan.scratch_bytes, " bytes of scratch per rank");
    return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kResourceExhausted, what));
  }
  if (launch->ctx_->fold_sends_version != snap->version) {
    FoldSends(t, &launch->ctx_->fold_sends);
    launch->ctx_->fold_sends_version = snap->version;
  }
  launch->epoch_ = launch->ctx_->epoch;
  launch->buffers_.resize(axis_size);
  launch->rank_first_op_.resize(axis_size);
  for (int32_t r = 0; r < axis_size; ++r) {
    launch->buffers_[r] = RankBuffers{static_cast<const char*>(arrivals[r].in), static_cast<char*>(arrivals[r].out),
                                      launch->ctx_->scratch[r]->data(), plan.period_elems, t.chunks_per_period,
                                      plan.esize, launch->tiles_};
    launch->rank_first_op_[r] = t.RankFirstOp(r);
  }
  launch->deadline_ = DeadlineAfter(launch->timeout_s_);
  launch->deadline_ns_ = NowNs() + static_cast<int64_t>(launch->timeout_s_ * 1e9);
  launch->fold_patience_until_.assign(axis_size, 0);
  launch->ranks_running_.store(group ? group->num_local : axis_size);
  if (group) {
    launch->proxy_view_ = std::make_unique<ProxyView>(launch.get());
    auto proxy = Proxy::Create(launch->proxy_view_.get(), group, NextLaunchNumber(*group, slot));
    if (!proxy.has_value()) return ErrorResult<R>(std::move(proxy.error()));
    launch->proxy_ = std::move(*proxy);
    launch->proxy_->Start();
  }
  return launch;
}

CpuLaunch::~CpuLaunch() {
  proxy_.reset();  // joins its thread before the memory it uses goes back to the pool
  proxy_view_.reset();
  if (pool_ && ctx_) pool_->Release(std::move(ctx_));
}

bool CpuLaunch::Local(int32_t rank) const { return !group_ || group_->Local(rank); }

std::atomic<uint64_t>* CpuLaunch::Flag(int32_t rank, size_t offset, size_t index) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(ctx_->regions[rank]->data() + offset) + index;
}

MsgDesc* CpuLaunch::Desc(int32_t rank, size_t cell) const {
  return reinterpret_cast<MsgDesc*>(ctx_->regions[rank]->data() + layout_.msgs()) + cell;
}

std::string CpuLaunch::Where(int32_t g, int32_t o) const { return DescribeOp(*table_, group_.get(), g, o); }

void CpuLaunch::Fail(const std::string& message, ffi::ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.empty()) {
      error_ = message;
      error_code_ = code;
    }
  }
  aborted_.store(true);
  // Wake every sleeper; each re-checks aborted_, so no wakeup is lost.
  for (int32_t r = 0; r < table_->num_ranks; ++r) Wake(r);
  for (auto& r : ctx_->ranks) {
    std::lock_guard<std::mutex> lock(r->mu);
    r->cv.notify_all();
  }
}

constexpr int kYieldsBeforeSleep = 16;

// The CPU's view of the flags for the core's readiness rule. A message is there once its posted tag is,
// and, with link pacing, once the emulated links delivered it (the earliest such time is remembered, so
// the threadblock sleeps exactly until then).
struct CpuProbe {
  const CpuLaunch* l;
  int32_t rank;
  int64_t now_ns = 0;
  int64_t wake_ns = INT64_MAX;

  bool Done(int32_t tile, int32_t o) const {
    return l->Flag(rank, l->layout_.op_done(), static_cast<size_t>(tile) * l->op_stride_ + o)
               ->load(std::memory_order_acquire) >= Tag(l->epoch_, 1);
  }
  bool Posted(int32_t conn, int32_t m) {
    const size_t cell = l->layout_.cell(conn, m);
    if (l->Flag(rank, l->layout_.posted(), cell)->load(std::memory_order_acquire) < Tag(l->epoch_, m + 1)) return false;
    if (!l->pace_) return true;
    const int64_t ready = l->ctx_->timing[cell].ready_ns;
    if (now_ns == 0) now_ns = NowNs();
    if (ready <= now_ns) return true;
    wake_ns = std::min(wake_ns, ready);
    return false;
  }
  bool SlotFree(int32_t conn, int32_t m) const {
    const size_t cell = l->layout_.cell(conn, m);
    const int32_t slots = l->layout_.num_slots;
    return l->Flag(rank, l->layout_.consumed(), cell)->load(std::memory_order_acquire) >= Tag(l->epoch_, m - slots + 1);
  }
};

// Denormals-are-zero and flush-to-zero for the scope's float arithmetic, as XLA:CPU computes (x86; other
// CPUs keep the caller's mode, which is XLA's own on its threads).
struct FlushDenormalsScope {
#if defined(__x86_64__) || defined(__SSE2__)
  static constexpr unsigned kFtzDaz = 0x8040u;  // MXCSR bits 15 (FTZ) and 6 (DAZ)
  const unsigned saved = _mm_getcsr();
  FlushDenormalsScope() {
    if ((saved & kFtzDaz) != kFtzDaz) _mm_setcsr(saved | kFtzDaz);
  }
  ~FlushDenormalsScope() {
    if ((saved & kFtzDaz) != kFtzDaz) _mm_setcsr(saved);
  }
#endif
};

// The core's reductions (core/reduce.h), contiguous, compiled for the widest vector unit this CPU has:
// the module is built for baseline x86-64, whose SSE2 loops are a half or a quarter as wide.
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
__attribute__((target_clones("avx512f", "avx2", "default"), flatten))
#endif
void CpuReduce(Reduction r, char* dst, const char* a, const char* b, size_t n) {
  const FlushDenormalsScope flush;  // the arithmetic mode of XLA:CPU's threads (core/reduce.h)
  ReduceLanes(r, dst, a, b, n, 0, 1);
}

void CpuLaunch::RunRank(int32_t rank) {
  const ProgramView p(table_->programs[rank].data());
  const int32_t first_tb = table_->rank_first_tb[rank], ntb = p.num_tbs();
  std::vector<ProgTb> tbs(ntb);
  std::vector<int32_t> first(ntb, 0);
  std::vector<int32_t> ready(ntb, kAllDone);  // per threadblock: its next ready unit in this round
  for (int32_t j = 0; j < ntb; ++j) tbs[j] = p.tb(j);
  TbWait& w = *ctx_->waits[rank];
  while (!aborted_.load(std::memory_order_relaxed)) {
    const uint64_t seen = w.events.load(std::memory_order_seq_cst);
    CpuProbe probe{this, rank};
    bool progress = false, all_done = true, failed = false;
    int32_t stuck = -1;
    // Runs threadblock j's ready unit; true when that ends the round (it ran, or Fail), false when it is a
    // fold that waits for its other terms (and its threadblock with it).
    auto run = [&](int32_t j) {
      bool deferred = false;
      failed = !Execute(first_tb + j, p, tbs[j], UnitOf(p, tbs[j], ready[j]), &deferred);
      if (deferred) {
        if (stuck < 0) stuck = j;
        probe.wake_ns = std::min(probe.wake_ns, fold_patience_until_[rank]);
      }
      progress = !failed && !deferred;
      return progress || failed;
    };
    // Sends go first: a posted message lets a peer go on, and a direct one costs only its flags.
    for (int32_t j = 0; j < ntb && !aborted_.load(std::memory_order_relaxed); ++j) {
      ready[j] = NextReadyUnit(p, tbs[j], tiles_, &first[j], probe, lookahead_);
      if (ready[j] == kAllDone) continue;
      all_done = false;
      if (ready[j] == kNoneReady) {
        if (stuck < 0) stuck = j;
        continue;
      }
      if (p.op(UnitOf(p, tbs[j], ready[j]).op).sends() && run(j)) break;
    }
    // Then the first other ready unit, in threadblock order: earlier threadblocks' work goes first (a fold
    // before the copies that wait for other ranks' folds); the next round rescans from the first.
    for (int32_t j = 0; j < ntb && !progress && !failed && !aborted_.load(std::memory_order_relaxed); ++j) {
      if (ready[j] >= 0 && !p.op(UnitOf(p, tbs[j], ready[j]).op).sends() && run(j)) break;
    }
    if (all_done) break;
    if (progress) continue;
    if (!Sleep(rank, seen, probe.wake_ns)) {
      FailStuck(first_tb + stuck, p, tbs[stuck], first[stuck]);
      break;
    }
  }
  if (measure_) {
    for (int32_t j = 0; j < ntb; ++j) net_->Flush(slot_, rank, j, caches_[first_tb + j]);
  }
  FinishRank(rank);
}

bool CpuLaunch::Sleep(int32_t rank, uint64_t seen, int64_t wake_ns) {
  TbWait& w = *ctx_->waits[rank];
  const int64_t until_ns = std::min(wake_ns, deadline_ns_);
  // Yield a few times first: the flag usually comes from a peer that runs as soon as this thread lets it,
  // and a yield costs less than a futex sleep and wake-up.
  for (int k = 0; k < kYieldsBeforeSleep && NowNs() < until_ns; ++k) {
    if (w.events.load(std::memory_order_seq_cst) != seen || aborted_.load()) return true;
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(w.mu);
  w.sleeping.store(true, std::memory_order_seq_cst);
  auto changed = [&] { return w.events.load(std::memory_order_seq_cst) != seen || aborted_.load(); };
  while (!changed()) {
    const int64_t now = NowNs();
    if (now >= until_ns) break;
    w.cv.wait_for(lock, std::chrono::nanoseconds(until_ns - now));
  }
  w.sleeping.store(false, std::memory_order_relaxed);
  return changed() || NowNs() < deadline_ns_;
}

void CpuLaunch::Wake(int32_t rank) {
  TbWait& w = *ctx_->waits[rank];
  w.events.fetch_add(1, std::memory_order_seq_cst);
  if (w.sleeping.load(std::memory_order_seq_cst)) {
    std::lock_guard<std::mutex> lock(w.mu);
    w.cv.notify_one();
  }
}

void CpuLaunch::FailStuck(int32_t g, const ProgramView& p, const ProgTb& tb, int32_t first) {
  if (aborted_.load()) return;
  const int32_t rank = table_->tbs[g].rank;
  CpuProbe probe{this, rank};
  const Unit u = UnitOf(p, tb, first);
  const ProgOp op = p.op(u.op);
  std::string what;
  switch (StuckReason(p, tb, u, op, probe)) {
    case kTimeoutDependency:
      what = op.dep >= 0 && !probe.Done(u.tile, op.dep)
                 ? StrCat("for op ", rank_first_op_[rank] + op.dep - table_->tbs[table_->op_tb[rank_first_op_[rank] + op.dep]].first_op,
                          " of threadblock ", table_->op_tb[rank_first_op_[rank] + op.dep] - table_->rank_first_tb[rank],
                          " of its rank, which did not complete")
                 : "for earlier ops of its rank that touch its chunks, which did not complete";
      break;
    case kTimeoutMessage:
      what = StrCat("for message ", u.recv_msg, " of its connection, which never arrived (deadlock or a failed peer)");
      break;
    default:
      what = StrCat("for a free slot: all ", p.num_slots(),
                    " slots of its connection stayed full (deadlock or a failed peer)");
  }
  Fail(StrCat("jaxccl: deadline exceeded: ", Where(g, u.op), " waited ", Seconds(timeout_s_), " ", what,
              proxy_ ? proxy_->PendingProcesses() : std::string()));
}

void CpuLaunch::FinishRank(int32_t rank) {
  // The launch time is recorded before the last rank is released, so it is there when the call returns.
  const bool last = ranks_running_.fetch_sub(1) == 1;
  if (last && !aborted_.load()) Registry::Get().RecordLaunchTime(slot_, NowNs() - start_ns_);
  if (last) {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_cv_.notify_all();
  }
}

bool CpuLaunch::ExecuteFold(int32_t g, const ProgramView& p, const ProgTb& tb, const Unit& u, bool* handled,
                            bool* deferred) {
  constexpr int kMaxChain = 64;
  constexpr size_t kBlockBytes = 16 << 10;
  *handled = false;
  *deferred = false;
  const int32_t rank = table_->tbs[g].rank;
  const RankBuffers& rb = buffers_[rank];
  struct Link {
    int32_t g;
    ProgTb tb;
    Unit u;
    ProgOp op;
  };
  Link chain[kMaxChain];
  int32_t n = 0;
  chain[n++] = Link{g, tb, u, p.op(u.op)};
  // A continuation is ready when everything but the chain's own ops is: its probe counts them done.
  struct ChainProbe {
    CpuProbe base;
    const Link* chain;
    int32_t n;
    bool Done(int32_t tile, int32_t o) {
      for (int32_t k = 0; k < n; ++k) {
        if (chain[k].u.op == o && chain[k].u.tile == tile) return true;
      }
      return base.Done(tile, o);
    }
    bool Posted(int32_t conn, int32_t m) { return base.Posted(conn, m); }
    bool SlotFree(int32_t conn, int32_t m) { return base.SlotFree(conn, m); }
  };
  bool complete = true;  // every step of the fold is in the chain
  for (int32_t y = chain[0].op.next_fold; y >= 0 && n < kMaxChain;) {
    const int32_t gy = table_->op_tb[rank_first_op_[rank] + y];
    const ProgTb tby = p.tb(gy - table_->rank_first_tb[rank]);
    const Unit uy = UnitOf(p, tby, u.tile * tby.num_ops + (y - tby.first_op));
    const ProgOp opy = p.op(y);
    ChainProbe probe{CpuProbe{this, rank}, chain, n};
    if (probe.base.Done(uy.tile, y)) break;
    if (!UnitReady(p, tby, uy, opy, probe)) {
      complete = false;
      break;
    }
    chain[n++] = Link{gy, tby, uy, opy};
    y = opy.next_fold;
  }
  // A fold whose later terms are not there yet waits for them (its rank sleeps, and the other ranks use
  // the cores), so that it runs as one pass instead of one pass per late term. The wait is bounded: a
  // term may depend on this rank's progress, and then the ready part runs after the patience.
  int64_t& patience_until = fold_patience_until_[rank];
  if (!complete) {
    const int64_t now = NowNs();
    if (patience_until == 0) {
      const size_t range = rb.Bytes(chain[0].op.dst_off, chain[0].op.count, u.tile);
      patience_until = now + std::clamp<int64_t>(static_cast<int64_t>(range), kFoldPatienceMinNs, kFoldPatienceMaxNs);
    }
    if (now < patience_until) {
      *handled = true;
      *deferred = true;
      return true;
    }
  }
  patience_until = 0;
  if (n < 2) return true;
  *handled = true;
  // The terms of the fold, in order: the first op's value (a message, its src, or dst + src), then one
  // term per continuation (its message, or its src for `re`).
  const char* terms[kMaxChain + 1];
  size_t bytes[kMaxChain];
  MessageTiming timing[kMaxChain];
  int32_t num_terms = 0;
  for (int32_t k = 0; k < n; ++k) {
    const Link& l = chain[k];
    const char* msg = nullptr;
    if (l.op.receives()) {
      MsgDesc d;
      if (!TakeMessage(l.g, l.tb, l.op, l.u, &d, &timing[k])) return false;
      msg = reinterpret_cast<const char*>(d.ptr);
      bytes[k] = d.bytes;
    }
    // A continuation adds into the range in place (its `a` is what the fold wrote): only its `b` is a term.
    const DataStep d = OpDataStep(l.op, l.u.tile, rb, msg, l.op.receives() ? bytes[k] : 0, nullptr);
    if (k == 0) terms[num_terms++] = d.a;
    if (d.b != nullptr) terms[num_terms++] = d.b;
  }
  char* dst = rb.Addr(chain[0].op.dst_buf, chain[0].op.dst_off, u.tile);
  const size_t total = rb.Bytes(chain[0].op.dst_off, chain[0].op.count, u.tile);
  const size_t esize = static_cast<size_t>(rb.esize);
  const size_t block = kBlockBytes / esize * esize;
  // Direct sends of the finished fold whose receivers only copy it: the fold writes their copies too,
  // from the cache, and the message is never posted (its send and receive are done with the fold).
  Push pushes[kMaxPushes];
  int32_t num_pushes = 0;
  if (complete && !net_) {
    Unit units[kMaxChain];
    for (int32_t k = 0; k < n; ++k) units[k] = chain[k].u;
    num_pushes = FindPushes(rank, p, units, n, total, pushes);
  }
  for (size_t at = 0; at < total; at += block) {
    const size_t len = std::min(block, total - at);
    CpuReduce(reduction_, dst + at, terms[0] + at, terms[1] + at, len / esize);
    for (int32_t k = 2; k < num_terms; ++k) CpuReduce(reduction_, dst + at, dst + at, terms[k] + at, len / esize);
    for (int32_t k = 0; k < num_pushes; ++k) std::memcpy(pushes[k].dst + at, dst + at, len);
  }
  for (int32_t k = 0; k < n; ++k) {
    const Link& l = chain[k];
    if (l.op.receives()) Consume(l.g, l.tb, l.u, timing[k], bytes[k]);
    Flag(rank, layout_.op_done(), static_cast<size_t>(l.u.tile) * op_stride_ + l.u.op)
        ->store(Tag(epoch_, 1), std::memory_order_release);
  }
  for (int32_t k = 0; k < num_pushes; ++k) {
    const Push& x = pushes[k];
    const size_t cell = layout_.cell(x.conn, x.msg);
    Flag(rank, layout_.consumed(), cell)->store(Tag(epoch_, x.msg + 1), std::memory_order_release);
    Flag(rank, layout_.op_done(), static_cast<size_t>(x.tile) * op_stride_ + x.send_op)
        ->store(Tag(epoch_, 1), std::memory_order_release);
    Flag(x.peer, layout_.op_done(), static_cast<size_t>(x.tile) * op_stride_ + x.recv_op)
        ->store(Tag(epoch_, 1), std::memory_order_release);
    Wake(x.peer);
  }
  return true;
}

int32_t CpuLaunch::FindPushes(int32_t rank, const ProgramView& p, const Unit* chain, int32_t n, size_t bytes,
                              Push* out) {
  struct ChainDoneProbe {  // the fold's own ops count as done
    CpuProbe base;
    const Unit* chain;
    int32_t n;
    bool Done(int32_t tile, int32_t o) {
      for (int32_t k = 0; k < n; ++k) {
        if (chain[k].op == o && chain[k].tile == tile) return true;
      }
      return base.Done(tile, o);
    }
    bool Posted(int32_t conn, int32_t m) { return base.Posted(conn, m); }
    bool SlotFree(int32_t conn, int32_t m) { return base.SlotFree(conn, m); }
  } probe{CpuProbe{this, rank}, chain, n};
  const Unit& last = chain[n - 1];
  int32_t num = 0;
  const auto& sends = ctx_->fold_sends[rank];  // (dependency, send op), sorted
  auto it = std::lower_bound(sends.begin(), sends.end(), std::make_pair(last.op, INT32_MIN));
  for (; it != sends.end() && it->first == last.op && num < kMaxPushes; ++it) {
    const int32_t s = it->second;
    const ProgOp op = p.op(s);
    const ProgTb tb = p.tb(table_->op_tb[rank_first_op_[rank] + s] - table_->rank_first_tb[rank]);
    const Unit us = UnitOf(p, tb, last.tile * tb.num_ops + (s - tb.first_op));
    if (probe.Done(us.tile, s) || !UnitReady(p, tb, us, op, probe)) continue;
    // The receive of message us.send_msg at the peer: a plain copy whose other conditions hold.
    const int32_t peer = tb.send_peer;
    if (!Local(peer)) continue;  // its buffer is in another process
    const ProgramView pp(table_->programs[peer].data());
    for (int32_t j = 0; j < pp.num_tbs(); ++j) {
      const ProgTb rtb = pp.tb(j);
      if (rtb.recv_conn != tb.send_conn) continue;
      for (int32_t v = last.tile * rtb.num_ops; v < (last.tile + 1) * rtb.num_ops; ++v) {
        const Unit ur = UnitOf(pp, rtb, v);
        if (ur.recv_msg != us.send_msg) continue;
        const ProgOp rop = pp.op(ur.op);
        CpuProbe pprobe{this, peer};
        struct PostedProbe {
          CpuProbe& base;
          bool Done(int32_t tile, int32_t o) { return base.Done(tile, o); }
          bool Posted(int32_t, int32_t) { return true; }
          bool SlotFree(int32_t conn, int32_t m) { return base.SlotFree(conn, m); }
        } rprobe{pprobe};
        if (rop.kind == OpCode::kRecv && buffers_[peer].Bytes(rop.dst_off, rop.count, ur.tile) == bytes &&
            !pprobe.Done(ur.tile, ur.op) && UnitReady(pp, rtb, ur, rop, rprobe)) {
          out[num++] = Push{buffers_[peer].Addr(rop.dst_buf, rop.dst_off, ur.tile), peer, tb.send_conn, us.send_msg,
                            us.tile, s, ur.op};
        }
        break;
      }
      break;
    }
  }
  return num;
}

bool CpuLaunch::Execute(int32_t g, const ProgramView& p, const ProgTb& tb, const Unit& u, bool* deferred) {
  const int32_t rank = table_->tbs[g].rank;
  const ProgOp op = p.op(u.op);
  const int32_t o = u.op;
  *deferred = false;
  if (!reduction_.none() && lookahead_ > 1 && op.next_fold >= 0) {
    bool handled = false;
    if (!ExecuteFold(g, p, tb, u, &handled, deferred)) return false;
    if (handled) return true;
  }
  const RankBuffers& rb = buffers_[rank];
  const char* msg = nullptr;
  size_t msg_bytes = 0;
  MessageTiming timing;
  if (op.receives()) {
    MsgDesc d;
    if (!TakeMessage(g, tb, op, u, &d, &timing)) return false;
    msg = reinterpret_cast<const char*>(d.ptr);
    msg_bytes = d.bytes;
  }
  char* stage = nullptr;
  if (op.sends() && !op.direct()) {
    const size_t bytes = op.kind == OpCode::kRecvReduceSend ? msg_bytes : rb.SendBytes(op, u.tile);
    AlignedBuffer& buf = *ctx_->staging[layout_.cell(tb.send_conn, u.send_msg)];
    if (!buf.Reserve(bytes)) {
      Fail(StrCat("jaxccl: cannot allocate ", bytes, " bytes of staging memory at ", Where(g, o)),
           ffi::ErrorCode::kResourceExhausted);
      return false;
    }
    stage = buf.data();
  }
  CpuMover mover;
  const Outgoing out = RunOpData(op, u.tile, rb, reduction_, msg, msg_bytes, stage, mover);
  if (op.receives()) Consume(g, tb, u, timing, msg_bytes);
  if (op.sends()) Post(g, tb, u, op, out);
  Flag(rank, layout_.op_done(), static_cast<size_t>(u.tile) * op_stride_ + o)->store(Tag(epoch_, 1), std::memory_order_release);
  return true;
}

void CpuLaunch::Consume(int32_t g, const ProgTb& tb, const Unit& u, const MessageTiming& timing, size_t bytes) {
  const int32_t o = u.op;
  const int32_t rank = table_->tbs[g].rank;
  if (measure_ || (net_ && net_->tracing())) {
    const int64_t now = NowNs();
    if (measure_) {
      // Done = when the last byte left the metered link (propagation is not throughput; Transfer says which
      // link): the link's own time, or the time this thread observed the message less what followed it.
      const int64_t delivered_ns = !pace_                    ? now
                                   : net_->link_timestamps() ? timing.meter_end_ns
                                                             : now - (timing.ready_ns - timing.meter_end_ns);
      ConnMeter& cm = *ctx_->meters[tb.recv_conn];
      std::lock_guard<std::mutex> lock(cm.mu);
      const bool now_idle = --cm.in_flight == 0;
      net_->OnDelivered(tb.recv_peer, rank, bytes, delivered_ns, now_idle, &caches_[g]);
    }
    if (net_->tracing()) {
      net_->Trace(TraceRecord{tb.recv_peer, rank, timing.src_tb, timing.src_op, g - table_->rank_first_tb[rank],
                              o - (table_->tbs[g].first_op - rank_first_op_[rank]), static_cast<int64_t>(bytes), timing.post_ns,
                              pace_ ? timing.tx_end_ns : 0, now});
    }
  }
  const size_t cell = layout_.cell(tb.recv_conn, u.recv_msg);
  Flag(tb.recv_peer, layout_.consumed(), cell)->store(Tag(epoch_, u.recv_msg + 1), std::memory_order_release);
  // The sender waits for this consumption only to reuse the slot for message recv_msg + num_slots.
  const ProgramView p(table_->programs[rank].data());
  if (u.recv_msg + layout_.num_slots < tiles_ * p.conn_msgs(tb.recv_conn)) Wake(tb.recv_peer);
  if (timing.direct) {
    RankState& sender = *ctx_->ranks[tb.recv_peer];
    std::lock_guard<std::mutex> lock(sender.mu);
    if (--sender.pending_direct == 0 && sender.waiting) sender.cv.notify_all();
  }
}

void CpuLaunch::Post(int32_t g, const ProgTb& tb, const Unit& u, const ProgOp& op, const Outgoing& out) {
  const int32_t rank = table_->tbs[g].rank;
  const int32_t o = u.op;
  if (op.direct()) {
    RankState& me = *ctx_->ranks[rank];
    std::lock_guard<std::mutex> lock(me.mu);
    ++me.pending_direct;
  }
  const size_t cell = layout_.cell(tb.send_conn, u.send_msg);
  MessageTiming& timing = ctx_->timing[cell];
  timing = MessageTiming{};
  timing.direct = op.direct();
  if (net_) {
    timing.post_ns = NowNs();
    timing.src_tb = g - table_->rank_first_tb[rank];
    timing.src_op = o - (table_->tbs[g].first_op - rank_first_op_[rank]);
    Transfer t;
    if (pace_) {
      t = net_->Reserve(rank, tb.send_peer, out.bytes, timing.post_ns);
      timing.ready_ns = t.ready_ns;
      timing.tx_end_ns = t.tx_end_ns;
      timing.meter_end_ns = t.meter_end_ns;
    }
    if (measure_) {
      ConnMeter& cm = *ctx_->meters[tb.send_conn];
      std::lock_guard<std::mutex> lock(cm.mu);
      const bool became_busy = cm.in_flight++ == 0;
      net_->OnPost(rank, tb.send_peer, timing.post_ns, became_busy, pace_ ? &t : nullptr);
    }
  }
  if (!Local(tb.send_peer)) {
    proxy_->Send(rank, tb.send_conn, u.send_msg, out.ptr, out.bytes, op.direct());
    return;
  }
  const unsigned long long id =
      TakeStaleInjection(slot_, /*remote=*/false) ? LaunchIdentity(table_->checksum, epoch_ - 1) : identity();
  *Desc(tb.send_peer, cell) = MsgDesc{reinterpret_cast<unsigned long long>(out.ptr), out.bytes, id, 0};
  Flag(tb.send_peer, layout_.posted(), cell)->store(Tag(epoch_, u.send_msg + 1), std::memory_order_release);
  Wake(tb.send_peer);
}

unsigned long long CpuLaunch::identity() const { return LaunchIdentity(table_->checksum, epoch_); }

bool CpuLaunch::TakeMessage(int32_t g, const ProgTb& tb, const ProgOp& op, const Unit& u, MsgDesc* out,
                            MessageTiming* timing) {
  const int32_t rank = table_->tbs[g].rank;
  const size_t cell = layout_.cell(tb.recv_conn, u.recv_msg);
  *out = *Desc(rank, cell);
  *timing = ctx_->timing[cell];
  if (out->identity != identity() && g_identity_checks.load(std::memory_order_relaxed)) {
    Fail(StaleMessageError(Where(g, u.op), u.recv_msg, out->identity, identity(), slot_, version_),
         ffi::ErrorCode::kInternal);
    return false;
  }
  const size_t expects = buffers_[rank].RecvBytes(op, u.tile);
  if (out->bytes != expects) {
    Fail(StrCat("jaxccl: ", Where(g, u.op), " received ", out->bytes, " bytes but expects ", expects),
         ffi::ErrorCode::kInternal);
    return false;
  }
  return true;
}

ffi::Error CpuLaunch::WaitRank(int32_t rank) {
  RunRank(rank);
  // Across processes: staged messages may still be on the wire; the launch's memory stays until they left.
  if (proxy_) proxy_->WaitDone();
  RankState& rs = *ctx_->ranks[rank];
  // A rank returns once its direct messages were consumed: receivers read its buffers in place.
  {
    std::unique_lock<std::mutex> lock(rs.mu);
    rs.waiting = true;
    const bool ok = rs.cv.wait_until(lock, deadline_ + std::chrono::seconds(1),
                                     [&] { return rs.pending_direct == 0 || aborted_.load(); });
    rs.waiting = false;
    if (!ok) {
      const int64_t pending = rs.pending_direct;
      lock.unlock();
      Fail(StrCat("jaxccl: deadline exceeded: rank ", rank, " did not finish within ", Seconds(timeout_s_), ": ",
                  pending, " direct message(s) never consumed", proxy_ ? proxy_->PendingProcesses() : std::string()));
    }
  }
  if (!aborted_.load()) return ffi::Error::Success();
  // Other ranks' threadblocks may still be reading this rank's buffers: XLA may free them only once every
  // threadblock of the launch has left (they all see the abort promptly; the bound is a last resort).
  {
    std::unique_lock<std::mutex> lock(done_mu_);
    done_cv_.wait_until(lock, DeadlineAfter(10.0), [&] { return ranks_running_.load() == 0; });
  }
  std::lock_guard<std::mutex> lock(error_mu_);
  return ffi::Error(error_code_, error_);
}

}  // namespace jaxccl
