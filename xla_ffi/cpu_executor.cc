#include "cpu_executor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <thread>

#include "dtype.h"
#include "reduce.h"
#include "worker_pool.h"

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

bool ExecContext::Reset(const Table& t, size_t scratch_bytes) {
  ResizeStates(scratch, t.num_ranks);
  ResizeStates(conns, t.conns.size());
  ResizeStates(tbs, t.tbs.size());
  ResizeStates(ranks, t.num_ranks);
  for (int32_t r = 0; r < t.num_ranks; ++r) {
    if (!scratch[r]->Reserve(scratch_bytes)) return false;
    RankState& rs = *ranks[r];
    rs.tbs_left = t.rank_num_tbs[r];
    rs.pending_direct = 0;
    rs.waiting = false;
  }
  for (size_t k = 0; k < t.conns.size(); ++k) {
    ConnState& c = *conns[k];
    c.posted = c.consumed = 0;
    c.send_waiting = c.recv_waiting = false;
    c.ring.assign(t.num_slots, Message{});
    // Staged message m lives in buffer m % num_slots (at most num_slots messages are in flight); buffers
    // are allocated on first use, so only the slots staged messages actually hit take memory.
    if (t.conns[k].num_staged > 0) ResizeStates(c.staging, t.num_slots);
  }
  for (size_t g = 0; g < t.tbs.size(); ++g) {
    tbs[g]->done = 0;
    tbs[g]->waiters = 0;
  }
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

ffi::ErrorOr<std::shared_ptr<CpuLaunch>> CpuLaunch::Start(int64_t slot, int32_t axis_size,
                                                          const std::vector<CpuArrival>& arrivals) {
  using R = std::shared_ptr<CpuLaunch>;
  int64_t seq = 0;  // the launch's sequence number: the largest any rank issued (MCCL Sec. 6.2.2)
  for (const CpuArrival& a : arrivals) seq = std::max(seq, a.seq);
  auto snap = Registry::Get().Acquire(slot, seq);
  if (!snap.has_value()) return ErrorResult<R>(std::move(snap.error()));
  const Table& t = *snap->table;
  if (t.num_ranks != axis_size) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat("jaxccl: schedule for N=", t.num_ranks,
                                                             " installed on an axis of size ", axis_size,
                                                             " (slot ", slot, ", version ", snap->version, ")")));
  }
  const CpuArrival& a0 = arrivals[0];
  for (int32_t r = 0; r < axis_size; ++r) {
    const CpuArrival& a = arrivals[r];
    if (a.in_dtype != a0.in_dtype || a.out_dtype != a0.in_dtype) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: rank ", r, " has input dtype ", DTypeName(a.in_dtype), " and output dtype ",
                 DTypeName(a.out_dtype), "; expected ", DTypeName(a0.in_dtype), " for both on every rank")));
    }
    if (a.in_elems != a0.in_elems) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat("jaxccl: rank ", r, " has ", a.in_elems,
                                                               " input elements but rank 0 has ", a0.in_elems)));
    }
  }
  const ffi::DataType dtype = a0.in_dtype;
  const size_t esize = CopyableByteWidth(dtype);
  if (esize == 0) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: dtype ", DTypeName(dtype), " is not supported (sub-byte and token types cannot be moved)")));
  }
  auto period = PeriodElements(t, a0.in_elems);
  if (!period.has_value()) return ErrorResult<R>(std::move(period.error()));
  const int64_t expected_out = OutputElements(t, *period);
  for (int32_t r = 0; r < axis_size; ++r) {
    if (arrivals[r].out_elems != expected_out) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat(
          "jaxccl: rank ", r, "'s output has ", arrivals[r].out_elems, " elements; ", CollectiveName(t.collective),
          " of ", a0.in_elems, " input elements over ", axis_size, " ranks produces ", expected_out)));
    }
  }
  SumFn sum = nullptr;
  if (t.has_reduction) {
    sum = SumFor(dtype);
    if (sum == nullptr) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat(
          "jaxccl: reductions support F32, BF16, F16 and S32; got ", DTypeName(dtype), " (", CollectiveName(t.collective),
          ")")));
    }
  }

  R launch(new CpuLaunch());
  launch->table_ = snap->table;
  launch->version_ = snap->version;
  launch->pool_ = ContextPoolFor(slot);
  launch->ctx_ = launch->pool_->Acquire();
  launch->io_ = arrivals;
  launch->esize_ = esize;
  launch->period_elems_ = *period;
  launch->sum_ = sum;
  launch->timeout_s_ = Registry::Get().timeout_s();
  launch->slot_ = slot;
  launch->start_ns_ = NowNs();
  launch->net_ = NetworkOfSlot(slot);
  if (launch->net_) {
    if (launch->net_->num_ranks() != t.num_ranks) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: slot ", slot, " runs on an emulated network of ", launch->net_->num_ranks(),
                 " GPUs but its schedule has ", t.num_ranks, " ranks")));
    }
    launch->pace_ = launch->net_->pacing();
    launch->measure_ = launch->net_->measuring() && !t.has_reduction;  // MCCL Sec. 3: no reductions
    if (launch->measure_) launch->caches_.resize(t.tbs.size());
  }
  const size_t scratch_bytes = static_cast<size_t>(ChunkStart(t.scratch_chunks, t.chunks_per_period, *period)) * esize;
  if (!launch->ctx_->Reset(t, scratch_bytes)) {
    return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                     StrCat("jaxccl: cannot allocate ", scratch_bytes, " bytes of scratch per rank")));
  }
  launch->deadline_ = DeadlineAfter(launch->timeout_s_);
  launch->tbs_running_.store(t.num_tbs());
  std::vector<std::function<void()>> tasks;
  tasks.reserve(t.tbs.size());
  for (int32_t g = 0; g < t.num_tbs(); ++g) tasks.emplace_back([launch, g] { launch->RunThreadblock(g); });
  if (ffi::Error e = WorkerPool::Get().Run(tasks); e.failure()) {
    launch->Fail(e.message(), ffi::ErrorCode::kResourceExhausted);  // queued threadblocks see the abort and leave at once
  }
  return launch;
}

CpuLaunch::~CpuLaunch() {
  if (pool_ && ctx_) pool_->Release(std::move(ctx_));
}

char* CpuLaunch::Ptr(int32_t rank, BufferId buf, int32_t chunk) const {
  const int64_t elem = ChunkStart(chunk, table_->chunks_per_period, period_elems_);
  char* base = nullptr;
  switch (buf) {
    case BufferId::kInput: base = const_cast<char*>(static_cast<const char*>(io_[rank].in)); break;
    case BufferId::kOutput: base = static_cast<char*>(io_[rank].out); break;
    case BufferId::kScratch: base = ctx_->scratch[rank]->data(); break;
    case BufferId::kNone: return nullptr;
  }
  return base == nullptr ? nullptr : base + static_cast<size_t>(elem) * esize_;
}

size_t CpuLaunch::Bytes(int32_t off, int32_t count) const {
  const int64_t c = table_->chunks_per_period;
  return static_cast<size_t>(ChunkStart(off + count, c, period_elems_) - ChunkStart(off, c, period_elems_)) * esize_;
}

std::string CpuLaunch::Where(int32_t g, int32_t i, const TableOp& op) const {
  const TableTb& tb = table_->tbs[g];
  std::string peers;
  if (OpReceives(op.kind)) peers += StrCat(" from rank ", tb.recv_peer);
  if (OpSends(op.kind)) peers += StrCat(" to rank ", tb.send_peer);
  return StrCat("rank ", tb.rank, ", threadblock ", g - table_->rank_first_tb[tb.rank], ", op ", i, " ('",
                OpName(op.kind), "'", peers, ", channel ", tb.channel, ")");
}

void CpuLaunch::Fail(const std::string& message, ffi::ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.empty()) {
      error_ = message;
      error_code_ = code;
    }
  }
  aborted_.store(true);
  // Wake every waiter; each re-checks aborted_ under its mutex, so no wakeup is lost.
  for (auto& c : ctx_->conns) {
    std::lock_guard<std::mutex> lock(c->mu);
    c->cv_send.notify_all();
    c->cv_recv.notify_all();
  }
  for (auto& tb : ctx_->tbs) {
    std::lock_guard<std::mutex> lock(tb->mu);
    tb->cv.notify_all();
  }
  for (auto& r : ctx_->ranks) {
    std::lock_guard<std::mutex> lock(r->mu);
    r->cv.notify_all();
  }
}

void CpuLaunch::RunThreadblock(int32_t g) {
  const TableTb& tb = table_->tbs[g];
  TbState& st = *ctx_->tbs[g];
  for (int32_t i = 0; i < tb.num_ops && !aborted_.load(std::memory_order_relaxed); ++i) {
    const TableOp& op = table_->ops[tb.first_op + i];
    if (!WaitDependency(g, i, op) || !Execute(g, i, op)) break;
    std::lock_guard<std::mutex> lock(st.mu);
    st.done = i + 1;
    if (st.waiters > 0) st.cv.notify_all();
  }
  if (measure_) net_->Flush(slot_, tb.rank, g - table_->rank_first_tb[tb.rank], caches_[g]);
  FinishThreadblock(g);
}

void CpuLaunch::FinishThreadblock(int32_t g) {
  // The launch time is recorded before the last rank is released, so it is there when the call returns.
  const bool last = tbs_running_.fetch_sub(1) == 1;
  if (last && !aborted_.load()) Registry::Get().RecordLaunchTime(slot_, NowNs() - start_ns_);
  RankState& rs = *ctx_->ranks[table_->tbs[g].rank];
  {
    std::lock_guard<std::mutex> lock(rs.mu);
    --rs.tbs_left;
    if (rs.waiting) rs.cv.notify_all();
  }
  if (last) {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_cv_.notify_all();
  }
}

bool CpuLaunch::WaitDependency(int32_t g, int32_t i, const TableOp& op) {
  if (op.dep_tb < 0) return true;
  const int32_t rank = table_->tbs[g].rank;
  const int32_t dg = table_->GlobalTb(rank, op.dep_tb);
  if (dg == g) return true;  // an earlier op of the same threadblock: program order
  TbState& dep = *ctx_->tbs[dg];
  std::unique_lock<std::mutex> lock(dep.mu);
  ++dep.waiters;
  const bool ok = dep.cv.wait_until(lock, deadline_, [&] { return dep.done > op.dep_op || aborted_.load(); });
  --dep.waiters;
  if (aborted_.load()) return false;
  if (!ok) {
    lock.unlock();
    Fail(StrCat("jaxccl: deadline exceeded: ", Where(g, i, op), " waited ", Seconds(timeout_s_), " for op ",
                op.dep_op, " of threadblock ", op.dep_tb, " of its rank, which did not complete"));
    return false;
  }
  return true;
}

bool CpuLaunch::WaitMessage(int32_t g, int32_t i, const TableOp& op, Message* msg) {
  ConnState& c = *ctx_->conns[table_->tbs[g].recv_conn];
  std::unique_lock<std::mutex> lock(c.mu);
  c.recv_waiting = true;
  const bool ok = c.cv_recv.wait_until(lock, deadline_, [&] { return c.posted > op.recv_msg || aborted_.load(); });
  c.recv_waiting = false;
  if (aborted_.load()) return false;
  if (!ok) {
    lock.unlock();
    Fail(StrCat("jaxccl: deadline exceeded: ", Where(g, i, op), " waited ", Seconds(timeout_s_), " for message ",
                op.recv_msg, " of its connection, which never arrived (deadlock or a failed peer)"));
    return false;
  }
  *msg = c.ring[op.recv_msg % table_->num_slots];
  return true;
}

bool CpuLaunch::WaitDelivered(int32_t g, int32_t i, const TableOp& op, const Message& msg) {
  if (!pace_) return true;
  // Sleep in bounded steps so an abort elsewhere is seen promptly.
  constexpr int64_t kStepNs = 5'000'000;
  for (int64_t now = NowNs(); now < msg.ready_ns; now = NowNs()) {
    if (aborted_.load(std::memory_order_relaxed)) return false;
    if (Clock::now() >= deadline_) {
      Fail(StrCat("jaxccl: deadline exceeded: ", Where(g, i, op), " waited ", Seconds(timeout_s_),
                  " for the emulated links to carry ", msg.bytes, " bytes (a link capacity far too low?)"));
      return false;
    }
    std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(kStepNs, msg.ready_ns - now)));
  }
  return true;
}

void CpuLaunch::ConsumeMessage(int32_t g, const Message& msg, int64_t delivered_ns) {
  const TableTb& tb = table_->tbs[g];
  ConnState& c = *ctx_->conns[tb.recv_conn];
  {
    std::lock_guard<std::mutex> lock(c.mu);
    ++c.consumed;
    if (measure_) net_->OnDelivered(tb.recv_peer, tb.rank, msg.bytes, delivered_ns, c.posted == c.consumed, &caches_[g]);
    if (c.send_waiting) c.cv_send.notify_one();
  }
  if (msg.direct) {
    RankState& sender = *ctx_->ranks[tb.recv_peer];
    std::lock_guard<std::mutex> lock(sender.mu);
    if (--sender.pending_direct == 0 && sender.waiting) sender.cv.notify_all();
  }
}

bool CpuLaunch::WaitSlot(int32_t g, int32_t i, const TableOp& op) {
  ConnState& c = *ctx_->conns[table_->tbs[g].send_conn];
  const int64_t slots = table_->num_slots;
  std::unique_lock<std::mutex> lock(c.mu);
  c.send_waiting = true;
  const bool ok = c.cv_send.wait_until(lock, deadline_, [&] { return c.posted - c.consumed < slots || aborted_.load(); });
  c.send_waiting = false;
  if (aborted_.load()) return false;
  if (!ok) {
    lock.unlock();
    Fail(StrCat("jaxccl: deadline exceeded: ", Where(g, i, op), " waited ", Seconds(timeout_s_),
                " for a free slot: all ", slots, " slots of its connection stayed full (deadlock or a failed peer)"));
    return false;
  }
  return true;
}

void CpuLaunch::PostMessage(int32_t g, int32_t i, const TableOp& op, Message msg) {
  const TableTb& tb = table_->tbs[g];
  if (msg.direct) {
    RankState& me = *ctx_->ranks[tb.rank];
    std::lock_guard<std::mutex> lock(me.mu);
    ++me.pending_direct;
  }
  const int64_t post_ns = net_ ? NowNs() : 0;
  Transfer t;
  msg.post_ns = post_ns;
  msg.src_tb = g - table_->rank_first_tb[tb.rank];
  msg.src_op = i;
  if (pace_) {
    t = net_->Reserve(tb.rank, tb.send_peer, msg.bytes, post_ns);
    msg.ready_ns = t.ready_ns;
    msg.tx_end_ns = t.tx_end_ns;
  }
  ConnState& c = *ctx_->conns[tb.send_conn];
  std::lock_guard<std::mutex> lock(c.mu);
  if (measure_) net_->OnPost(tb.rank, tb.send_peer, post_ns, c.posted == c.consumed, pace_ ? &t : nullptr);
  c.ring[op.send_msg % table_->num_slots] = msg;
  c.posted = op.send_msg + 1;
  if (c.recv_waiting) c.cv_recv.notify_one();
}

bool CpuLaunch::Send(int32_t g, int32_t i, const TableOp& op, BufferId buf, int32_t off) {
  return WaitSlot(g, i, op) && Post(g, i, op, buf, off);
}

AlignedBuffer* CpuLaunch::Staging(int32_t g, int32_t i, const TableOp& op, size_t bytes) {
  ConnState& c = *ctx_->conns[table_->tbs[g].send_conn];
  AlignedBuffer* stage = c.staging[op.send_msg % table_->num_slots].get();
  if (!stage->Reserve(bytes)) {
    Fail(StrCat("jaxccl: cannot allocate ", bytes, " bytes of staging memory at ", Where(g, i, op)),
         ffi::ErrorCode::kResourceExhausted);
    return nullptr;
  }
  return stage;
}

bool CpuLaunch::Post(int32_t g, int32_t i, const TableOp& op, BufferId buf, int32_t off) {
  const size_t bytes = Bytes(off, op.count);
  const char* src = Ptr(table_->tbs[g].rank, buf, off);
  if (op.direct()) {
    PostMessage(g, i, op, Message{src, bytes, true});
    return true;
  }
  AlignedBuffer* stage = Staging(g, i, op, bytes);
  if (stage == nullptr) return false;
  if (bytes > 0) std::memcpy(stage->data(), src, bytes);
  PostMessage(g, i, op, Message{stage->data(), bytes, false});
  return true;
}

bool CpuLaunch::Deliver(int32_t g, int32_t i, const TableOp& op, void* dst, const void* local, const Message& msg) {
  if (!WaitDelivered(g, i, op, msg)) return false;
  // Done = when the last byte left the bottleneck link (propagation is not throughput): the link's own
  // time, or the time this thread observed the message less the route's latency.
  int64_t delivered_ns = 0;
  if (measure_) {
    delivered_ns = !pace_ ? NowNs() : net_->link_timestamps() ? msg.tx_end_ns : NowNs() - (msg.ready_ns - msg.tx_end_ns);
  }
  if (net_ && net_->tracing()) {
    const TableTb& tb = table_->tbs[g];
    net_->Trace(TraceRecord{tb.recv_peer, tb.rank, msg.src_tb, msg.src_op, g - table_->rank_first_tb[tb.rank], i,
                            static_cast<int64_t>(msg.bytes), msg.post_ns, pace_ ? msg.tx_end_ns : 0, NowNs()});
  }
  if (msg.bytes > 0) {
    if (local == nullptr) {
      std::memcpy(dst, msg.data, msg.bytes);
    } else {
      sum_(dst, local, msg.data, msg.bytes / esize_);
    }
  }
  ConsumeMessage(g, msg, delivered_ns);
  return true;
}

bool CpuLaunch::Execute(int32_t g, int32_t i, const TableOp& op) {
  const int32_t rank = table_->tbs[g].rank;
  Message msg;
  switch (op.kind) {
    case OpCode::kNop: return true;
    case OpCode::kCopy: {
      const size_t bytes = Bytes(op.src_off, op.count);
      char* dst = Ptr(rank, op.dst_buf, op.dst_off);
      const char* src = Ptr(rank, op.src_buf, op.src_off);
      if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
      return true;
    }
    case OpCode::kReduce: {
      const size_t bytes = Bytes(op.src_off, op.count);
      char* dst = Ptr(rank, op.dst_buf, op.dst_off);
      if (bytes > 0) sum_(dst, dst, Ptr(rank, op.src_buf, op.src_off), bytes / esize_);
      return true;
    }
    case OpCode::kSend: return Send(g, i, op, op.src_buf, op.src_off);
    case OpCode::kRecv:
    case OpCode::kRecvCopySend:
    case OpCode::kRecvReduceCopy:
    case OpCode::kRecvReduceCopySend: {
      // A receive that forwards starts only when its message is there AND its outgoing slot is free, as
      // MSCCL's primitives, the CUDA kernel and the reference interpreter do (both conditions only ever
      // become true, so waiting for them in turn is the same as waiting for both).
      const bool forwards = op.kind == OpCode::kRecvCopySend || op.kind == OpCode::kRecvReduceCopySend;
      if (!WaitMessage(g, i, op, &msg) || (forwards && !WaitSlot(g, i, op))) return false;
      if (msg.bytes != Bytes(op.dst_off, op.count)) {
        Fail(StrCat("jaxccl: ", Where(g, i, op), " received ", msg.bytes, " bytes but expects ",
                    Bytes(op.dst_off, op.count)),
             ffi::ErrorCode::kInternal);
        return false;
      }
      const bool reduce = op.kind == OpCode::kRecvReduceCopy || op.kind == OpCode::kRecvReduceCopySend;
      if (!Deliver(g, i, op, Ptr(rank, op.dst_buf, op.dst_off), reduce ? Ptr(rank, op.src_buf, op.src_off) : nullptr,
                   msg)) {
        return false;
      }
      return forwards ? Post(g, i, op, op.dst_buf, op.dst_off) : true;
    }
    case OpCode::kRecvReduceSend: {
      // The sum exists only in the outgoing staging slot: take the slot first, then reduce into it.
      if (!WaitMessage(g, i, op, &msg) || !WaitSlot(g, i, op)) return false;
      const size_t bytes = Bytes(op.src_off, op.count);
      if (msg.bytes != bytes) {
        Fail(StrCat("jaxccl: ", Where(g, i, op), " received ", msg.bytes, " bytes but expects ", bytes),
             ffi::ErrorCode::kInternal);
        return false;
      }
      AlignedBuffer* stage = Staging(g, i, op, bytes);
      if (stage == nullptr) return false;
      if (!Deliver(g, i, op, stage->data(), Ptr(rank, op.src_buf, op.src_off), msg)) return false;
      PostMessage(g, i, op, Message{stage->data(), bytes, false});
      return true;
    }
  }
  return true;
}

ffi::Error CpuLaunch::WaitRank(int32_t rank) {
  RankState& rs = *ctx_->ranks[rank];
  // The threadblocks' own waits expire at deadline_; the grace lets them report which op was stuck.
  const Clock::time_point latch_deadline = deadline_ + std::chrono::seconds(1);
  {
    std::unique_lock<std::mutex> lock(rs.mu);
    rs.waiting = true;
    const bool ok = rs.cv.wait_until(lock, latch_deadline, [&] {
      return (rs.tbs_left == 0 && rs.pending_direct == 0) || aborted_.load();
    });
    rs.waiting = false;
    if (!ok) {
      const std::string what = rs.tbs_left > 0 ? StrCat(rs.tbs_left, " threadblock(s) still running")
                                               : StrCat(rs.pending_direct, " direct message(s) never consumed");
      lock.unlock();
      Fail(StrCat("jaxccl: deadline exceeded: rank ", rank, " did not finish within ", Seconds(timeout_s_), ": ",
                  what));
    }
  }
  if (!aborted_.load()) return ffi::Error::Success();
  // Other ranks' threadblocks may still be reading this rank's buffers: XLA may free them only once every
  // threadblock of the launch has left (they all see the abort promptly; the bound is a last resort).
  {
    std::unique_lock<std::mutex> lock(done_mu_);
    done_cv_.wait_until(lock, DeadlineAfter(10.0), [&] { return tbs_running_.load() == 0; });
  }
  std::lock_guard<std::mutex> lock(error_mu_);
  return ffi::Error(error_code_, error_);
}

}  // namespace jaxccl
