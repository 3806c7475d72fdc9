#include "transport/proxy.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/executor.h"
#include "transport/shared_sends.h"

namespace jaxccl {

namespace {
std::mutex group_mu;
std::vector<std::shared_ptr<const ProcessGroup>>& Groups() {
  static auto* g = new std::vector<std::shared_ptr<const ProcessGroup>>();
  return *g;
}

// A message's tag: (slot, spanning group, launch, connection, message). Launch numbers wrap: processes
// stay within one launch of each other on a group's slot (every launch waits for the others' messages).
constexpr int kSlotBits = 8, kGroupBits = 8, kLaunchBits = 8, kConnBits = 12, kMsgBits = 12;
static_assert(kSlotBits + kGroupBits + kLaunchBits + kConnBits + kMsgBits == kTransportTagBits,
              "tag layout fills the tag");
static_assert(kMaxSpanningGroups == 1 << kGroupBits, "every spanning group has a tag");
}  // namespace

int64_t ProcessGroup::NextLaunch(int64_t slot) const {
  std::lock_guard<std::mutex> lock(launches_mu_);
  return launches_[slot]++;
}

int64_t NextLaunchNumber(const ProcessGroup& group, int64_t slot) { return group.NextLaunch(slot); }

ffi::Error AttachProcessGroups(Transport* transport, int32_t process_id,
                               const std::vector<std::vector<int32_t>>& process_of_rank) {
  if (transport == nullptr) return ffi::Error::InvalidArgument("jaxccl: no transport to attach");
  if (process_of_rank.empty() || process_of_rank[0].empty()) {
    return ffi::Error::InvalidArgument("jaxccl: the mesh to attach has no device");
  }
  std::vector<std::shared_ptr<const ProcessGroup>> groups;
  int32_t local = 0, spanning = 0;
  for (size_t i = 0; i < process_of_rank.size(); ++i) {
    const std::vector<int32_t>& procs = process_of_rank[i];
    if (procs.size() != process_of_rank[0].size()) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl: group ", i, " has ", procs.size(), " ranks but group 0 has ",
                                                process_of_rank[0].size()));
    }
    auto g = std::make_shared<ProcessGroup>();
    g->process_id = process_id;
    g->index = static_cast<int32_t>(i);
    g->process_of_rank = procs;
    bool spans = false;
    for (int32_t p : procs) {
      if (p < 0 || p >= transport->num_processes()) {
        return ffi::Error::InvalidArgument(StrCat("jaxccl: process ", p, " of group ", i, " is not one of the ",
                                                  transport->num_processes(), " processes of the transport"));
      }
      g->local_index.push_back(p == process_id ? g->num_local++ : -1);
      spans |= p != procs[0];
    }
    local += g->num_local;
    if (spans) g->tag_index = spanning++;
    g->transport = transport;
    groups.push_back(std::move(g));
  }
  if (local == 0) return ffi::Error::InvalidArgument("jaxccl: the process group has no rank in this process");
  if (spanning > kMaxSpanningGroups) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: ", spanning, " groups of the collective's axes span processes; at most ",
                                              kMaxSpanningGroups, " may (put more of each group in one process)"));
  }
  std::lock_guard<std::mutex> lock(group_mu);
  Groups() = std::move(groups);
  return ffi::Error::Success();
}

void DetachProcessGroups() {
  std::lock_guard<std::mutex> lock(group_mu);
  Groups().clear();
}

ffi::ErrorOr<std::shared_ptr<const ProcessGroup>> ProcessGroupOf(int32_t index) {
  using R = std::shared_ptr<const ProcessGroup>;
  std::lock_guard<std::mutex> lock(group_mu);
  if (Groups().empty()) {
    return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                     "jaxccl: a native collective across processes needs the processes' transport: call "
                                     "jaxccl.distributed.transport.attach(transport, mesh, axis_name) in every process first"));
  }
  if (index < 0 || index >= static_cast<int32_t>(Groups().size())) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: the collective's group ", index, " is not one of the ", Groups().size(),
               " groups of the attached mesh (attach the axes this collective runs over)")));
  }
  return Groups()[index];
}

namespace {
std::mutex records_mu;
std::vector<TransportRecord>& Records() {
  static auto* r = new std::vector<TransportRecord>();
  return *r;
}
int64_t records_dropped = 0;
}  // namespace

void AddTransportRecord(const TransportRecord& r) {
  std::lock_guard<std::mutex> lock(records_mu);
  if (Records().size() >= kMaxTransportRecords) {
    ++records_dropped;
    return;
  }
  Records().push_back(r);
}

std::vector<TransportRecord> DrainTransportRecords(int64_t* dropped) {
  std::lock_guard<std::mutex> lock(records_mu);
  std::vector<TransportRecord> out;
  out.swap(Records());
  *dropped = records_dropped;
  records_dropped = 0;
  return out;
}

ffi::ErrorOr<uint64_t> CpuProxy::TagOf(int32_t conn, int32_t msg) const {
  if (conn >= (1 << kConnBits) || msg >= (1 << kMsgBits)) {
    return ErrorResult<uint64_t>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: a schedule across processes may have at most ", 1 << kConnBits, " connections and ",
               1 << kMsgBits, " messages per connection and launch; connection ", conn, " message ", msg,
               " is beyond")));
  }
  const uint64_t slot = static_cast<uint64_t>(l_->slot_) & ((1u << kSlotBits) - 1);
  const uint64_t group = static_cast<uint64_t>(group_->tag_index) & ((1u << kGroupBits) - 1);
  const uint64_t launch = static_cast<uint64_t>(launch_number_) & ((1u << kLaunchBits) - 1);
  return ((((slot << kGroupBits | group) << kLaunchBits | launch) << kConnBits | static_cast<uint64_t>(conn))
          << kMsgBits) |
         static_cast<uint64_t>(msg);
}

namespace {
// Staging memory of finished launches, reused by the next (a fresh allocation of many MiB would fault
// in every page again on every launch).
constexpr size_t kMaxPooledStaging = 4;
std::mutex staging_mu;
std::vector<std::unique_ptr<AlignedBuffer>>& StagingPool() {
  static auto* p = new std::vector<std::unique_ptr<AlignedBuffer>>();
  return *p;
}
std::unique_ptr<AlignedBuffer> TakeStaging() {
  std::lock_guard<std::mutex> lock(staging_mu);
  auto& pool = StagingPool();
  if (pool.empty()) return std::make_unique<AlignedBuffer>();
  std::unique_ptr<AlignedBuffer> b = std::move(pool.back());
  pool.pop_back();
  return b;
}
void ReturnStaging(std::unique_ptr<AlignedBuffer> b) {
  std::lock_guard<std::mutex> lock(staging_mu);
  if (StagingPool().size() < kMaxPooledStaging) StagingPool().push_back(std::move(b));
}
}  // namespace

ffi::ErrorOr<std::unique_ptr<CpuProxy>> CpuProxy::Create(CpuLaunch* launch, std::shared_ptr<const ProcessGroup> group,
                                                         int64_t launch_number) {
  using R = std::unique_ptr<CpuProxy>;
  R proxy(new CpuProxy());
  proxy->l_ = launch;
  proxy->group_ = std::move(group);
  proxy->launch_number_ = launch_number;
  const ProcessGroup& pg = *proxy->group_;
  const Table& t = *launch->table_;
  const int32_t tiles = launch->tiles_;
  proxy->shared_ = SharedSendsOf(launch->table_, tiles, pg.process_of_rank);
  // The receives from other processes, with their sizes, from the receiving ranks' programs.
  struct Planned {
    int32_t conn, msg, rank, peer_rank;
    size_t bytes;
  };
  std::vector<Planned> plan;
  for (int32_t c = 0; c < t.num_conns(); ++c) {
    const TableConn& conn = t.conns[c];
    const bool in = pg.Local(conn.receiver) && !pg.Local(conn.sender);
    const bool out = pg.Local(conn.sender) && !pg.Local(conn.receiver);
    if (out) proxy->sends_expected_ += static_cast<int64_t>(tiles) * ProgramView(t.programs[conn.sender].data()).conn_msgs(c);
    if (!in) continue;
    const int32_t rank = conn.receiver;
    const ProgramView p(t.programs[rank].data());
    const ProgTb tb = p.tb(conn.recv_tb - t.rank_first_tb[rank]);
    const int32_t num_msgs = tiles * p.conn_msgs(c);
    std::vector<int32_t> by_msg(num_msgs, -1);
    for (int32_t v = 0; v < tiles * tb.num_ops; ++v) {
      const Unit u = UnitOf(p, tb, v);
      const ProgOp op = p.op(u.op);
      if (!op.receives()) continue;
      if (u.recv_msg < 0 || u.recv_msg >= num_msgs || by_msg[u.recv_msg] >= 0) {
        return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: connection ", c, " has a malformed message ", u.recv_msg)));
      }
      const size_t bytes = launch->buffers_[rank].RecvBytes(op, u.tile);
      by_msg[u.recv_msg] = static_cast<int32_t>(plan.size());
      plan.push_back(Planned{c, u.recv_msg, rank, conn.sender, bytes});
    }
    if (std::find(by_msg.begin(), by_msg.end(), -1) != by_msg.end()) {
      return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: connection ", c, " has a message no op receives")));
    }
    proxy->remote_in_conns_.push_back(c);
    proxy->order_.push_back(std::move(by_msg));
  }
  proxy->next_.assign(proxy->order_.size(), 0);
  // One transfer per group of messages that share it; a message sharing another's takes its transfer.
  std::map<std::pair<int32_t, int32_t>, int32_t> transfer_of;  // by the (connection, message) that names it
  std::vector<size_t> offsets;
  size_t total = 0;
  proxy->recvs_.reserve(plan.size());
  for (const Planned& x : plan) {
    const MessageRef lead = proxy->shared_->LeaderOf(x.conn, x.msg);
    auto [it, fresh] = transfer_of.emplace(std::make_pair(lead.conn, lead.msg), static_cast<int32_t>(offsets.size()));
    if (fresh) {
      offsets.push_back(total);
      proxy->transfers_.push_back(InTransfer{0, nullptr, x.bytes});
      total += (x.bytes + kWireTrailerBytes + 63) / 64 * 64;
    } else if (proxy->transfers_[it->second].bytes != x.bytes) {
      return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: message ", x.msg, " of connection ", x.conn,
                                                        " shares a transfer of another size")));
    }
    proxy->recvs_.push_back(Recv{x.conn, x.msg, x.rank, x.peer_rank, x.bytes, it->second});
  }
  proxy->staging_ = TakeStaging();
  if (!proxy->staging_->Reserve(std::max<size_t>(total, 64))) {
    return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                     StrCat("jaxccl: cannot allocate ", total, " bytes for messages from other processes")));
  }
  for (const auto& [lead, k] : transfer_of) {
    InTransfer& x = proxy->transfers_[k];
    x.data = proxy->staging_->data() + offsets[k];
    auto tag = proxy->TagOf(lead.first, lead.second);
    if (!tag.has_value()) {
      proxy->CancelAll();
      return ErrorResult<R>(std::move(tag.error()));
    }
    const int32_t sender = t.conns[lead.first].sender;
    auto req = pg.transport->Irecv(pg.process_of_rank[sender], *tag, x.data, x.bytes + kWireTrailerBytes);
    if (!req.has_value()) {
      proxy->CancelAll();
      return ErrorResult<R>(ffi::Error(req.error().errc().value_or(ffi::ErrorCode::kInternal),
                                       StrCat("jaxccl: rank ", t.conns[lead.first].receiver, " cannot receive from rank ",
                                              sender, ": ", req.error().message())));
    }
    x.request = *req;
    x.arrived = false;
  }
  if (TraceLaunches()) std::fprintf(stderr, "%s\n", proxy->Describe(/*pending_only=*/false).c_str());
  return proxy;
}

bool TraceLaunches() {
  static const bool on = [] {
    const char* env = std::getenv("JAXCCL_TRANSPORT_TRACE");
    return env != nullptr && *env != '\0' && *env != '0';
  }();
  return on;
}

std::string CpuProxy::Describe(bool pending_only) const {
  const Table& t = *l_->table_;
  std::string out = StrCat("[process ", group_->process_id, " slot ", l_->slot_, " group ", group_->tag_index,
                           " launch ", launch_number_, " (tag ", launch_number_ & ((1 << kLaunchBits) - 1),
                           ") table version ", l_->version_, " checksum ", t.checksum, " conns ", t.num_conns(),
                           " tiles ", l_->tiles_, "]");
  constexpr int kMaxListed = 16;
  int listed = 0, hidden = 0;
  std::string recvs;
  for (const Recv& r : recvs_) {
    const InTransfer& x = transfers_[r.transfer];
    if (pending_only && r.delivered) continue;
    if (++listed > kMaxListed) {
      ++hidden;
      continue;
    }
    const MessageRef lead = shared_->LeaderOf(r.conn, r.msg);
    recvs += StrCat(" c", r.conn, "m", r.msg, "<-r", r.peer_rank, "(tag c", lead.conn, "m", lead.msg, ",", r.bytes, "B,",
                    r.delivered ? "delivered" : x.arrived ? "arrived" : "posted", ")");
  }
  out += StrCat(" receives", pending_only ? " not delivered" : "", " (", recvs_.size(), " in all):", recvs.empty() ? " none" : recvs);
  if (hidden > 0) out += StrCat(" +", hidden, " more");
  std::string sends;
  listed = hidden = 0;
  int64_t posted = 0, done = 0;
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    for (const auto& [lead, x] : out_) {
      ++posted;
      done += x.done;
      if (pending_only && x.done) continue;
      if (++listed > kMaxListed) {
        ++hidden;
        continue;
      }
      sends += StrCat(" c", lead.first, "m", lead.second, "->r", t.conns[lead.first].receiver, "(", x.done ? "done" : "in flight", ")");
    }
    out += StrCat("; sends: ", sends_done_, " of ", sends_expected_, " messages complete, transfers posted ", posted,
                  ", done ", done, pending_only ? "; not done:" : ":", sends.empty() ? " none" : sends);
  }
  if (hidden > 0) out += StrCat(" +", hidden, " more");
  return out;
}

std::string CpuProxy::PendingProcesses() const {
  std::map<int32_t, std::pair<int64_t, int64_t>> waits;  // process -> (messages from it, transfers to it)
  for (const Recv& r : recvs_) {
    if (!r.delivered) ++waits[group_->process_of_rank[r.peer_rank]].first;
  }
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    for (const auto& [lead, x] : out_) {
      if (!x.done) ++waits[group_->process_of_rank[l_->table_->conns[lead.first].receiver]].second;
    }
  }
  if (waits.empty()) return "";
  std::string out = "; the launch waits for ";
  bool first = true;
  for (const auto& [process, n] : waits) {
    out += StrCat(first ? "" : ", ", "process ", process, " (", n.first, " message(s) from it not arrived, ", n.second,
                  " transfer(s) to it not done)");
    first = false;
  }
  return out;
}

CpuProxy::~CpuProxy() {
  if (thread_.joinable()) thread_.join();
  // After a failure the transport may still own a cancelled receive's memory (a cancel that did not
  // finish): never reuse nor free it then (freeing it corrupted the heap when the bytes came later).
  if (staging_ && failed_) (void)staging_.release();
  if (staging_) ReturnStaging(std::move(staging_));
}

unsigned long long CpuProxy::WireIdentity() const {
  return LaunchIdentity(l_->table_->checksum, static_cast<unsigned long long>(launch_number_));
}

void CpuProxy::Start() { thread_ = std::thread([this] { Run(); }); }

void CpuProxy::Send(int32_t rank, int32_t conn, int32_t msg, const void* data, size_t bytes, bool direct) {
  const int32_t peer = l_->table_->conns[conn].receiver;
  const MessageRef lead = shared_->LeaderOf(conn, msg);
  std::lock_guard<std::mutex> lock(send_mu_);
  auto [it, fresh] = out_.try_emplace(std::make_pair(lead.conn, lead.msg));
  if (fresh) {  // the first of the transfer's messages posts it
    auto tag = TagOf(lead.conn, lead.msg);
    if (!tag.has_value()) {
      out_.erase(it);
      l_->Fail(tag.error().message(), ffi::ErrorCode::kInvalidArgument);
      return;
    }
    OutTransfer& x = it->second;
    x.trailer = WireTrailer{WireIdentity(), kWireTrailerMagic};
    if (TakeStaleInjection(l_->slot_, /*remote=*/true)) {
      x.trailer.identity = LaunchIdentity(l_->table_->checksum, launch_number_ - 1);
    }
    auto req = group_->transport->IsendWithTrailer(group_->process_of_rank[peer], *tag, data, bytes, &x.trailer,
                                                   sizeof(x.trailer));
    if (!req.has_value()) {
      out_.erase(it);
      l_->Fail(StrCat("jaxccl: rank ", rank, " cannot send message ", msg, " to rank ", peer, ": ", req.error().message()),
               req.error().errc().value_or(ffi::ErrorCode::kInternal));
      return;
    }
    it->second.request = *req;
  }
  sends_.push_back(Send_{rank, conn, msg, peer, lead, direct});
}

void CpuProxy::FailWith(const std::string& message, ffi::ErrorCode code) {
  l_->Fail(message, code);
  CancelAll();
}

void CpuProxy::CancelAll() {
  failed_ = true;
  // Waiting with a deadline that has passed cancels and frees a request.
  const auto now = Clock::now();
  for (InTransfer& x : transfers_) {
    if (!x.arrived && x.request != 0) (void)group_->transport->Wait(x.request, now);
    x.arrived = true;
  }
  std::lock_guard<std::mutex> lock(send_mu_);
  for (auto& [lead, x] : out_) {
    if (!x.done) (void)group_->transport->Wait(x.request, now);
    x.done = true;
  }
  sends_.clear();
}

bool CpuProxy::ProgressSends(bool* progress) {
  Transport& tr = *group_->transport;
  const RegionLayout& layout = l_->layout_;
  std::unique_lock<std::mutex> lock(send_mu_);
  for (auto& [lead, x] : out_) {
    if (x.done) continue;
    auto st = tr.Test(x.request);
    if (st.has_value() && !*st) continue;
    auto c = tr.Wait(x.request, Clock::now());
    x.done = true;
    if (!st.has_value() || !c.has_value()) {
      const TableConn& conn = l_->table_->conns[lead.first];
      const ffi::Error e = st.has_value() ? c.error() : st.error();
      lock.unlock();
      FailWith(StrCat("jaxccl: rank ", conn.sender, " sending to rank ", conn.receiver, " in process ",
                      group_->process_of_rank[conn.receiver], ": ", e.message()),
               e.errc().value_or(ffi::ErrorCode::kInternal));
      return false;
    }
    x.completion = *c;
  }
  for (auto it = sends_.begin(); it != sends_.end();) {
    const OutTransfer& x = out_[std::make_pair(it->transfer.conn, it->transfer.msg)];
    if (!x.done) {
      ++it;
      continue;
    }
    const TransportCompletion& c = x.completion;
    AddTransportRecord(TransportRecord{it->rank, it->peer_rank, static_cast<int64_t>(c.bytes), c.post_ns, c.done_ns});
    // The slot's bytes have left: the slot is free, and a direct send's buffer is released.
    l_->Flag(it->rank, layout.consumed(), layout.cell(it->conn, it->msg))
        ->store(Tag(l_->epoch_, it->msg + 1), std::memory_order_release);
    l_->Wake(it->rank);
    if (it->direct) {
      RankState& sender = *l_->ctx_->ranks[it->rank];
      std::lock_guard<std::mutex> rl(sender.mu);
      if (--sender.pending_direct == 0 && sender.waiting) sender.cv.notify_all();
    }
    ++sends_done_;
    *progress = true;
    it = sends_.erase(it);
  }
  return true;
}

void CpuProxy::Run() {
  Transport& tr = *group_->transport;
  const RegionLayout& layout = l_->layout_;
  const uint64_t epoch = l_->epoch_;
  int idle = 0;
  auto peer_error = [&](int32_t rank, int32_t peer_rank, const char* what, const ffi::Error& e) {
    FailWith(StrCat("jaxccl: rank ", rank, " ", what, " rank ", peer_rank, " in process ", group_->process_of_rank[peer_rank],
                    ": ", e.message()),
             e.errc().value_or(ffi::ErrorCode::kInternal));
  };
  while (true) {
    if (l_->aborted_.load()) {
      CancelAll();
      break;
    }
    bool progress = false, failed = false;
    size_t delivered = 0;
    for (size_t k = 0; k < order_.size() && !failed; ++k) {
      const int32_t conn = remote_in_conns_[k];
      for (; next_[k] < static_cast<int32_t>(order_[k].size()); ++next_[k]) {
        Recv& r = recvs_[order_[k][next_[k]]];
        InTransfer& x = transfers_[r.transfer];
        if (!x.arrived) {
          auto st = tr.Test(x.request);
          if (!st.has_value()) {
            x.arrived = true;
            peer_error(r.rank, r.peer_rank, "receiving from", st.error());
            failed = true;
            break;
          }
          if (!*st) break;
          auto c = tr.Wait(x.request, Clock::now());
          x.arrived = true;
          if (!c.has_value() || c->bytes != r.bytes + kWireTrailerBytes) {
            peer_error(r.rank, r.peer_rank, "receiving from",
                       c.has_value() ? ffi::Error::Internal(StrCat("message ", r.msg, " has ", c->bytes,
                                                                   " bytes, expected ", r.bytes, " and a trailer of ",
                                                                   kWireTrailerBytes))
                                     : c.error());
            failed = true;
            break;
          }
          WireTrailer got;
          std::memcpy(&got, x.data + x.bytes, sizeof(got));
          if ((got.magic != kWireTrailerMagic || got.identity != WireIdentity()) && IdentityChecks()) {
            const ProgramView p(l_->table_->programs[r.rank].data());
            const int32_t g = l_->table_->conns[r.conn].recv_tb;
            const int32_t o = p.tb(g - l_->table_->rank_first_tb[r.rank]).first_op;
            FailWith(StaleMessageError(l_->Where(g, o), r.msg, got.identity, WireIdentity(), l_->slot_, l_->version_) +
                         StrCat(" (from process ", group_->process_of_rank[r.peer_rank], ", launch numbers on the wire)"),
                     ffi::ErrorCode::kInternal);
            failed = true;
            break;
          }
        }
        // Message m owns slot m % num_slots: it may be posted once message m - num_slots was consumed.
        if (r.msg >= layout.num_slots &&
            l_->Flag(r.peer_rank, layout.consumed(), layout.cell(conn, r.msg - layout.num_slots))
                    ->load(std::memory_order_acquire) < Tag(epoch, r.msg - layout.num_slots + 1)) {
          break;
        }
        const size_t cell = layout.cell(conn, r.msg);
        *l_->Desc(r.rank, cell) = MsgDesc{reinterpret_cast<unsigned long long>(x.data), r.bytes, l_->identity(), 0};
        l_->ctx_->timing[cell] = MessageTiming{};
        l_->Flag(r.rank, layout.posted(), cell)->store(Tag(epoch, r.msg + 1), std::memory_order_release);
        r.delivered = true;
        l_->Wake(r.rank);
        progress = true;
      }
      if (next_[k] == static_cast<int32_t>(order_[k].size())) ++delivered;
    }
    if (failed) break;
    if (!ProgressSends(&progress)) break;
    bool sends_left;
    {
      std::lock_guard<std::mutex> lock(send_mu_);
      sends_left = sends_done_ < sends_expected_;
    }
    if (delivered == order_.size() && !sends_left) break;
    if (Clock::now() >= l_->deadline_) {
      std::string what;
      for (size_t k = 0; k < order_.size() && what.empty(); ++k) {
        if (next_[k] < static_cast<int32_t>(order_[k].size())) {
          const Recv& r = recvs_[order_[k][next_[k]]];
          what = StrCat("rank ", r.rank, " waited for message ", r.msg, " of connection ", r.conn, " from rank ",
                        r.peer_rank, " in process ", group_->process_of_rank[r.peer_rank],
                        transfers_[r.transfer].arrived ? " (arrived; its slot stayed full)" : ", which never arrived (a failed or hung process?)");
        }
      }
      if (what.empty()) {
        std::lock_guard<std::mutex> lock(send_mu_);
        what = StrCat(sends_expected_ - sends_done_, " message(s) to other processes were not sent or did not complete");
        if (!sends_.empty()) {  // name the process the oldest pending send goes to, as for a receive
          const Send_& s = sends_.front();
          what += StrCat(" (rank ", s.rank, "'s message ", s.msg, " of connection ", s.conn, " to rank ", s.peer_rank,
                         " in process ", group_->process_of_rank[s.peer_rank], ": a failed or hung process?)");
        }
      }
      FailWith(StrCat("jaxccl: deadline exceeded: ", what, " for ", Seconds(l_->timeout_s_), "; this process's proxy: ",
                      Describe(/*pending_only=*/true)),
               ffi::ErrorCode::kDeadlineExceeded);
      break;
    }
    if (progress) {
      idle = 0;
    } else if (++idle < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_.store(true);
  }
  done_cv_.notify_all();
}

void CpuProxy::WaitDone() {
  std::unique_lock<std::mutex> lock(done_mu_);
  done_cv_.wait_until(lock, l_->deadline_ + std::chrono::seconds(2), [&] { return done_.load(); });
}

}  // namespace jaxccl
