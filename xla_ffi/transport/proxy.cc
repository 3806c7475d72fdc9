#include "transport/proxy.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cpu/executor.h"  // the identity checks' switch and test hook (IdentityChecks, TakeStaleInjection)
#include "transport/shared_sends.h"

namespace jaxccl {

namespace {
std::mutex group_mu;
std::vector<std::shared_ptr<const ProcessGroup>>& Groups() {
  static auto* g = new std::vector<std::shared_ptr<const ProcessGroup>>();
  return *g;
}

// A message's tag: (slot, spanning group, launch, part, connection, message). Launch numbers wrap: processes
// stay within one launch of each other on a group's slot (every launch waits for the others' messages).
// The part is 0 for a message (with its trailer in host memory) and 1 for the trailer of a message in device
// memory, which travels as a transfer of its own.
constexpr int kSlotBits = 8, kGroupBits = 8, kLaunchBits = 7, kPartBits = 1, kConnBits = 12, kMsgBits = 12;
static_assert(kSlotBits + kGroupBits + kLaunchBits + kPartBits + kConnBits + kMsgBits == kTransportTagBits,
              "tag layout fills the tag");
static_assert(kMaxSpanningGroups == 1 << kGroupBits, "every spanning group has a tag");
}  // namespace

int64_t ProcessGroup::NextLaunch(int64_t slot) const {
  std::lock_guard<std::mutex> lock(launches_mu_);
  return launches_[slot]++;
}

int64_t NextLaunchNumber(const ProcessGroup& group, int64_t slot) { return group.NextLaunch(slot); }

namespace {
std::atomic<int64_t> in_place_receives{0};
std::atomic<int64_t> in_place_disconnects{0};
}  // namespace

int64_t InPlaceReceives() { return in_place_receives.load(); }
int64_t InPlaceDisconnects() { return in_place_disconnects.load(); }

ffi::Error AttachProcessGroups(Transport* transport, int32_t process_id,
                               const std::vector<std::vector<int32_t>>& process_of_rank, int32_t* first,
                               int32_t* layout) {
  if (transport == nullptr) return ffi::Error::InvalidArgument("jaxccl: no transport to attach");
  if (process_of_rank.empty() || process_of_rank[0].empty()) {
    return ffi::Error::InvalidArgument("jaxccl: the mesh to attach has no device");
  }
  std::lock_guard<std::mutex> lock(group_mu);
  std::vector<std::shared_ptr<const ProcessGroup>>& attached = Groups();
  int32_t spanning = 0, layouts = 0;
  for (const auto& g : attached) {
    if (g->transport != transport) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "jaxccl: another transport is attached; detach it before attaching this one");
    }
    if (g->tag_index >= 0) spanning = std::max(spanning, g->tag_index + 1);
    layouts = std::max(layouts, g->layout + 1);
  }
  const int32_t base = static_cast<int32_t>(attached.size());
  std::vector<std::shared_ptr<const ProcessGroup>> groups;
  int32_t local = 0;
  for (size_t i = 0; i < process_of_rank.size(); ++i) {
    const std::vector<int32_t>& procs = process_of_rank[i];
    if (procs.size() != process_of_rank[0].size()) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl: group ", i, " has ", procs.size(), " ranks but group 0 has ",
                                                process_of_rank[0].size()));
    }
    auto g = std::make_shared<ProcessGroup>();
    g->process_id = process_id;
    g->index = base + static_cast<int32_t>(i);
    g->layout = layouts;
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
    g->tag_index = spans ? spanning++ : -1;
    g->transport = transport;
    groups.push_back(std::move(g));
  }
  if (local == 0) return ffi::Error::InvalidArgument("jaxccl: the process group has no rank in this process");
  if (spanning > kMaxSpanningGroups) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: ", spanning, " groups of the attached layouts span processes; at most ",
                                              kMaxSpanningGroups, " may (put more of each group in one process)"));
  }
  attached.insert(attached.end(), groups.begin(), groups.end());
  *first = base;
  *layout = layouts;
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

std::string DescribeOp(const Table& t, const ProcessGroup* group, int32_t g, int32_t o) {
  const TableTb& tb = t.tbs[g];
  const int32_t i = o - (tb.first_op - t.RankFirstOp(tb.rank));
  const OpCode kind = t.ops[tb.first_op + i].kind;
  // A peer in another process is named with its process.
  auto process = [&](int32_t peer) {
    return group == nullptr || group->Local(peer) ? std::string()
                                                  : StrCat(" in process ", group->process_of_rank[peer]);
  };
  std::string peers;
  if (OpReceives(kind)) peers += StrCat(" from rank ", tb.recv_peer, process(tb.recv_peer));
  if (OpSends(kind)) peers += StrCat(" to rank ", tb.send_peer, process(tb.send_peer));
  return StrCat("rank ", tb.rank, ", threadblock ", g - t.rank_first_tb[tb.rank], ", op ", i, " ('", OpName(kind), "'",
                peers, ", channel ", tb.channel, ")");
}

ffi::ErrorOr<uint64_t> Proxy::TagOf(int32_t conn, int32_t msg, int part) const {
  if (conn >= (1 << kConnBits) || msg >= (1 << kMsgBits)) {
    return ErrorResult<uint64_t>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: a schedule across processes may have at most ", 1 << kConnBits, " connections and ",
               1 << kMsgBits, " messages per connection and launch; connection ", conn, " message ", msg,
               " is beyond")));
  }
  const uint64_t slot = static_cast<uint64_t>(v_->slot) & ((1u << kSlotBits) - 1);
  const uint64_t group = static_cast<uint64_t>(group_->tag_index) & ((1u << kGroupBits) - 1);
  const uint64_t launch = static_cast<uint64_t>(launch_number_) & ((1u << kLaunchBits) - 1);
  const uint64_t head = ((slot << kGroupBits | group) << kLaunchBits | launch) << kPartBits | static_cast<uint64_t>(part);
  return ((head << kConnBits | static_cast<uint64_t>(conn)) << kMsgBits) | static_cast<uint64_t>(msg);
}

ffi::ErrorOr<std::unique_ptr<Proxy>> Proxy::Create(ProxyLaunch* launch, std::shared_ptr<const ProcessGroup> group,
                                                   int64_t launch_number, std::unique_ptr<ProxyLaunch> owned) {
  using R = std::unique_ptr<Proxy>;
  R proxy(new Proxy());
  proxy->owned_ = std::move(owned);
  proxy->l_ = launch;
  proxy->v_ = &launch->view();
  proxy->group_ = std::move(group);
  proxy->launch_number_ = launch_number;
  const ProxyLaunchView& v = *proxy->v_;
  proxy->split_ = v.memory == MemoryKind::kCuda;
  proxy->memory_ = launch->staging().kind();
  if (!proxy->split_ && proxy->memory_ != MemoryKind::kHost) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        "jaxccl: a launch whose messages are in device memory must send them with the device wire layout "
        "(ProxyLaunchView::memory = kCuda): a transfer never mixes device and host memory"));
  }
  const ProcessGroup& pg = *proxy->group_;
  const Table& t = *v.table;
  const int32_t tiles = v.tiles;
  proxy->shared_ = SharedSendsOf(v.table, tiles, pg.process_of_rank);
  // The receives from other processes, with their sizes, from the receiving ranks' programs.
  struct Planned {
    int32_t conn, msg, rank, peer_rank;
    size_t bytes;
    char* dst;  // where the op copies the message to (its output), if it may land there
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
    for (int32_t u_index = 0; u_index < tiles * tb.num_ops; ++u_index) {
      const Unit u = UnitOf(p, tb, u_index);
      const ProgOp op = p.op(u.op);
      if (!op.receives()) continue;
      if (u.recv_msg < 0 || u.recv_msg >= num_msgs || by_msg[u.recv_msg] >= 0) {
        return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: connection ", c, " has a malformed message ", u.recv_msg)));
      }
      const size_t bytes = v.buffers[rank].RecvBytes(op, u.tile);
      char* dst = nullptr;
      if (!proxy->split_ && bytes >= kInPlaceMinBytes && proxy->shared_->MayLandInPlace(c, u.recv_msg) &&
          pg.transport->EndableInFlight(pg.process_of_rank[conn.sender], bytes)) {
        dst = v.buffers[rank].Addr(op.dst_buf, op.dst_off, u.tile);
      }
      by_msg[u.recv_msg] = static_cast<int32_t>(plan.size());
      plan.push_back(Planned{c, u.recv_msg, rank, conn.sender, bytes, dst});
    }
    if (std::find(by_msg.begin(), by_msg.end(), -1) != by_msg.end()) {
      return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: connection ", c, " has a message no op receives")));
    }
    proxy->remote_in_conns_.push_back(c);
    proxy->order_.push_back(std::move(by_msg));
  }
  proxy->next_.assign(proxy->order_.size(), 0);
  // One transfer per group of messages that share it; a message sharing another's takes its transfer. In host
  // memory the trailer lands behind the message, unless it travels apart (device memory, or a message that may
  // land in place): then it has a host array of its own. A message that lands in place takes no staging.
  const size_t align = proxy->split_ ? 256 : 64;
  std::map<std::pair<int32_t, int32_t>, int32_t> transfer_of;  // by the (connection, message) that names it
  std::vector<size_t> offsets;
  size_t total = 0;
  proxy->recvs_.reserve(plan.size());
  for (const Planned& x : plan) {
    const MessageRef lead = proxy->shared_->LeaderOf(x.conn, x.msg);
    auto [it, fresh] = transfer_of.emplace(std::make_pair(lead.conn, lead.msg), static_cast<int32_t>(offsets.size()));
    if (fresh) {
      offsets.push_back(total);
      InTransfer in;
      in.bytes = x.bytes;
      in.split = proxy->TravelsApart(lead, x.bytes);
      in.in_place = x.dst != nullptr;
      in.data = x.dst;
      in.process = pg.process_of_rank[x.peer_rank];
      proxy->transfers_.push_back(in);
      if (!in.in_place) total += (x.bytes + (in.split ? 0 : kWireTrailerBytes) + align - 1) / align * align;
    } else if (proxy->transfers_[it->second].bytes != x.bytes) {
      return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl: message ", x.msg, " of connection ", x.conn,
                                                        " shares a transfer of another size")));
    }
    proxy->recvs_.push_back(Recv{x.conn, x.msg, x.rank, x.peer_rank, x.bytes, it->second});
  }
  auto staging = launch->staging().Acquire(std::max<size_t>(total, 256));
  if (!staging.has_value()) {
    return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                     StrCat("jaxccl: cannot allocate ", total, " bytes of ",
                                            MemoryKindName(proxy->memory_), " memory for messages from other processes: ",
                                            staging.error().message())));
  }
  proxy->staging_ = *staging;
  proxy->trailers_.assign(proxy->transfers_.size(), WireTrailer{});
  for (const auto& [lead, k] : transfer_of) {
    if (!proxy->transfers_[k].in_place) proxy->transfers_[k].data = proxy->staging_ + offsets[k];
    if (ffi::Error e = proxy->PostReceive(k, MessageRef{lead.first, lead.second}); e.failure()) {
      proxy->CancelAll();
      return ErrorResult<R>(std::move(e));
    }
  }
  if (TraceLaunches()) std::fprintf(stderr, "%s\n", proxy->Describe(/*pending_only=*/false).c_str());
  return proxy;
}

ffi::Error Proxy::PostReceive(int32_t k, const MessageRef& lead) {
  const ProcessGroup& pg = *group_;
  const TableConn& conn = v_->table->conns[lead.conn];
  InTransfer& x = transfers_[k];
  for (int part = 0; part < PartsOf(x.split); ++part) {
    auto tag = TagOf(lead.conn, lead.msg, part);
    if (!tag.has_value()) return std::move(tag.error());
    void* into = part == 0 ? static_cast<void*>(x.data) : static_cast<void*>(&trailers_[k]);
    const size_t bytes = part == 1 ? kWireTrailerBytes : x.split ? x.bytes : x.bytes + kWireTrailerBytes;
    const MemoryKind memory = part == 0 ? memory_ : MemoryKind::kHost;
    auto req = pg.transport->Irecv(pg.process_of_rank[conn.sender], *tag, into, bytes, memory);
    if (!req.has_value()) {
      return ffi::Error(req.error().errc().value_or(ffi::ErrorCode::kInternal),
                        StrCat("jaxccl: rank ", conn.receiver, " cannot receive from rank ", conn.sender, " in process ",
                               pg.process_of_rank[conn.sender], ": ", req.error().message()));
    }
    x.request[part] = *req;
    x.part_done[part] = false;
  }
  x.arrived = false;
  return ffi::Error::Success();
}

ffi::ErrorOr<bool> Proxy::Arrived(InTransfer& x, int32_t k, const Recv& r) {
  Transport& tr = *group_->transport;
  auto failed = [&](const ffi::Error& e) {
    return ErrorResult<bool>(ffi::Error(e.errc().value_or(ffi::ErrorCode::kInternal),
                                        StrCat("jaxccl: rank ", r.rank, " receiving from rank ", r.peer_rank,
                                               " in process ", group_->process_of_rank[r.peer_rank], ": ", e.message())));
  };
  for (int part = 0; part < PartsOf(x.split); ++part) {
    if (x.part_done[part]) continue;
    auto st = tr.Test(x.request[part]);
    if (!st.has_value()) {
      x.part_done[part] = true;  // failed: nothing to cancel
      return failed(st.error());
    }
    if (!*st) return false;
    auto c = tr.Wait(x.request[part], Clock::now());
    x.part_done[part] = true;
    if (!c.has_value()) return failed(c.error());
    const size_t expected = part == 1 ? kWireTrailerBytes : x.split ? r.bytes : r.bytes + kWireTrailerBytes;
    if (c->bytes != expected) {
      return failed(ffi::Error::Internal(
          part == 1 ? StrCat("the trailer of message ", r.msg, " has ", c->bytes, " bytes, expected ", kWireTrailerBytes)
          : x.split ? StrCat("message ", r.msg, " has ", c->bytes, " bytes, expected ", r.bytes)
                    : StrCat("message ", r.msg, " has ", c->bytes, " bytes, expected ", r.bytes, " and a trailer of ",
                             kWireTrailerBytes)));
    }
  }
  x.arrived = true;
  if (x.in_place) in_place_receives.fetch_add(1, std::memory_order_relaxed);
  WireTrailer got;
  if (x.split) {
    got = trailers_[k];
  } else {
    std::memcpy(&got, x.data + x.bytes, sizeof(got));
  }
  if ((got.magic != kWireTrailerMagic || got.identity != WireIdentity()) && IdentityChecks()) {
    const Table& t = *v_->table;
    const ProgramView p(t.programs[r.rank].data());
    const int32_t g = t.conns[r.conn].recv_tb;
    const int32_t o = p.tb(g - t.rank_first_tb[r.rank]).first_op;
    return ErrorResult<bool>(ffi::Error::Internal(
        StaleMessageError(l_->Where(g, o), r.msg, got.identity, WireIdentity(), v_->slot, v_->version) +
        StrCat(" (from process ", group_->process_of_rank[r.peer_rank], ", launch numbers on the wire)")));
  }
  return true;
}

bool TraceLaunches() {
  static const bool on = [] {
    const char* env = std::getenv("JAXCCL_TRANSPORT_TRACE");
    return env != nullptr && *env != '\0' && *env != '0';
  }();
  return on;
}

std::string Proxy::Describe(bool pending_only) const {
  const Table& t = *v_->table;
  std::string out = StrCat("[process ", group_->process_id, " slot ", v_->slot, " group ", group_->tag_index,
                           " launch ", launch_number_, " (tag ", launch_number_ & ((1 << kLaunchBits) - 1),
                           ") table version ", v_->version, " checksum ", t.checksum, " conns ", t.num_conns(),
                           " tiles ", v_->tiles, " memory ", MemoryKindName(memory_),
                           split_ ? " (trailers apart)" : "", "]");
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
                    x.in_place ? "in place," : "",
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

std::string Proxy::PendingProcesses() const {
  std::map<int32_t, std::pair<int64_t, int64_t>> waits;  // process -> (messages from it, transfers to it)
  for (const Recv& r : recvs_) {
    if (!r.delivered) ++waits[group_->process_of_rank[r.peer_rank]].first;
  }
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    for (const auto& [lead, x] : out_) {
      if (!x.done) ++waits[group_->process_of_rank[v_->table->conns[lead.first].receiver]].second;
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

Proxy::~Proxy() {
  if (thread_.joinable()) {
    thread_.join();
  } else if (!failed_) {
    CancelAll();  // never started: its receives must not land in memory given back below
  }
  // After a failure the transport may still own a cancelled receive's memory (a cancel that did not
  // finish): never reuse nor free it then (freeing it corrupted the heap when the bytes came later).
  if (staging_ != nullptr) l_->staging().Release(staging_, /*reusable=*/!failed_);
}

unsigned long long Proxy::WireIdentity() const {
  return LaunchIdentity(v_->table->checksum, static_cast<unsigned long long>(launch_number_));
}

void Proxy::Start() { thread_ = std::thread([this] { Run(); }); }

void Proxy::Send(int32_t rank, int32_t conn, int32_t msg, const void* data, size_t bytes, bool direct) {
  const int32_t peer = v_->table->conns[conn].receiver;
  const int32_t process = group_->process_of_rank[peer];
  const MessageRef lead = shared_->LeaderOf(conn, msg);
  std::lock_guard<std::mutex> lock(send_mu_);
  auto [it, fresh] = out_.try_emplace(std::make_pair(lead.conn, lead.msg));
  if (fresh) {  // the first of the transfer's messages posts it
    auto tag = TagOf(lead.conn, lead.msg);
    if (!tag.has_value()) {
      out_.erase(it);
      Fail(tag.error().message(), ffi::ErrorCode::kInvalidArgument);
      return;
    }
    OutTransfer& x = it->second;
    x.split = TravelsApart(lead, bytes);
    x.trailer = WireTrailer{WireIdentity(), kWireTrailerMagic};
    if (TakeStaleInjection(v_->slot, /*remote=*/true)) {
      x.trailer.identity = LaunchIdentity(v_->table->checksum, launch_number_ - 1);
    }
    auto cannot = [&](const ffi::Error& e) {
      Fail(StrCat("jaxccl: rank ", rank, " cannot send message ", msg, " to rank ", peer, ": ", e.message()),
           e.errc().value_or(ffi::ErrorCode::kInternal));
    };
    auto req = x.split ? group_->transport->Isend(process, *tag, data, bytes, memory_)
                      : group_->transport->IsendWithTrailer(process, *tag, data, bytes, &x.trailer, sizeof(x.trailer),
                                                            MemoryKind::kHost);
    if (!req.has_value()) {
      out_.erase(it);
      cannot(req.error());
      return;
    }
    x.request[0] = *req;
    if (x.split) {
      auto trailer_tag = TagOf(lead.conn, lead.msg, /*part=*/1);
      auto treq = group_->transport->Isend(process, *trailer_tag, &x.trailer, sizeof(x.trailer), MemoryKind::kHost);
      if (!treq.has_value()) {
        x.part_done[1] = true;  // nothing posted; the message's part is cancelled with the launch
        cannot(treq.error());
        return;
      }
      x.request[1] = *treq;
    }
  }
  sends_.push_back(Send_{rank, conn, msg, peer, lead, direct});
  ++sends_posted_;
}

ffi::Error Proxy::Failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (failure_.empty()) return ffi::Error::Success();
  return ffi::Error(failure_code_, failure_);
}

void Proxy::Abort(const std::string& message, ffi::ErrorCode code) {
  l_->Fail(message, code);
  if (thread_.joinable()) {
    WaitDone();  // the thread sees the launch aborted and cancels what is in flight
  } else if (!failed_) {
    CancelAll();
  }
}

void Proxy::Fail(const std::string& message, ffi::ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) {
      failure_ = message;
      failure_code_ = code;
    }
  }
  l_->Fail(message, code);
}

void Proxy::FailWith(const std::string& message, ffi::ErrorCode code) {
  Fail(message, code);
  CancelAll();
}

void Proxy::CancelAll() {
  failed_ = true;
  // Waiting with a deadline that has passed cancels and frees a request.
  Transport& tr = *group_->transport;
  const auto now = Clock::now();
  std::vector<InTransfer*> draining;  // receives into the receivers' outputs, which go back to XLA
  for (InTransfer& x : transfers_) {
    for (int part = 0; part < kParts; ++part) {
      if (x.part_done[part] || x.request[part] == 0) {
        x.part_done[part] = true;
        continue;
      }
      if (part == 0 && x.in_place) {
        auto ended = tr.Drain(x.request[part], now);  // cancels it
        if (ended.has_value() && !*ended) {
          draining.push_back(&x);
          continue;
        }
      } else {
        (void)tr.Wait(x.request[part], now);
      }
      x.part_done[part] = true;
    }
    x.arrived = true;
  }
  // Matched receives end by themselves (EndableInFlight); the last resort cuts their senders off.
  const auto until = DeadlineAfter(kInPlaceDrainSeconds);
  while (!draining.empty()) {
    const bool late = Clock::now() >= until;
    for (auto it = draining.begin(); it != draining.end();) {
      InTransfer& x = **it;
      auto ended = tr.Drain(x.request[0], Clock::now());
      if (ended.has_value() && !*ended && !late) {
        ++it;
        continue;
      }
      if (ended.has_value() && !*ended) {
        tr.Disconnect(x.process, StrCat("a failed launch's receive from it did not end (slot ", v_->slot, ", launch ",
                                        launch_number_, ")"));
        in_place_disconnects.fetch_add(1, std::memory_order_relaxed);
      }
      x.part_done[0] = true;
      it = draining.erase(it);
    }
    if (!draining.empty()) std::this_thread::yield();
  }
  std::lock_guard<std::mutex> lock(send_mu_);
  for (auto& [lead, x] : out_) {
    for (int part = 0; part < kParts; ++part) {
      if (!x.done && !x.part_done[part] && x.request[part] != 0) (void)tr.Wait(x.request[part], now);
      x.part_done[part] = true;
    }
    x.done = true;
  }
  sends_.clear();
}

bool Proxy::ProgressSends(bool* progress) {
  Transport& tr = *group_->transport;
  const RegionLayout& layout = v_->layout;
  std::unique_lock<std::mutex> lock(send_mu_);
  for (auto& [lead, x] : out_) {
    if (x.done) continue;
    bool all = true;
    for (int part = 0; part < PartsOf(x.split); ++part) {
      if (x.part_done[part]) continue;
      auto st = tr.Test(x.request[part]);
      if (st.has_value() && !*st) {
        all = false;
        continue;
      }
      auto c = tr.Wait(x.request[part], Clock::now());
      x.part_done[part] = true;
      if (!st.has_value() || !c.has_value()) {
        const TableConn& conn = v_->table->conns[lead.first];
        const ffi::Error e = st.has_value() ? c.error() : st.error();
        lock.unlock();
        FailWith(StrCat("jaxccl: rank ", conn.sender, " sending to rank ", conn.receiver, " in process ",
                        group_->process_of_rank[conn.receiver], ": ", e.message()),
                 e.errc().value_or(ffi::ErrorCode::kInternal));
        return false;
      }
      // The transfer's record: its bytes, from the first part's post to the last part's completion.
      TransportCompletion& m = x.completion;
      const bool first = m.bytes == 0 && m.post_ns == 0;
      m.bytes += c->bytes;
      m.post_ns = first ? c->post_ns : std::min(m.post_ns, c->post_ns);
      m.done_ns = first ? c->done_ns : std::max(m.done_ns, c->done_ns);
    }
    x.done = all;
  }
  for (auto it = sends_.begin(); it != sends_.end();) {
    const OutTransfer& x = out_[std::make_pair(it->transfer.conn, it->transfer.msg)];
    if (!x.done) {
      ++it;
      continue;
    }
    const TransportCompletion& c = x.completion;
    AddTransportRecord(
        TransportRecord{it->rank, it->peer_rank, static_cast<int64_t>(c.bytes), c.post_ns, c.done_ns, group_->layout});
    // The slot's bytes have left: the slot is free, and the backend releases what it holds for the message.
    l_->Flag(it->rank, layout.consumed(), layout.cell(it->conn, it->msg))
        ->store(Tag(v_->epoch, it->msg + 1), std::memory_order_release);
    l_->SendDone(it->rank, it->conn, it->msg, it->direct);
    ++sends_done_;
    *progress = true;
    it = sends_.erase(it);
  }
  return true;
}

void Proxy::Run() {
  const RegionLayout& layout = v_->layout;
  const uint64_t epoch = v_->epoch;
  Backoff idle(64, std::chrono::microseconds(20));
  int64_t posted_seen = 0;
  while (true) {
    if (l_->Aborted()) {
      CancelAll();
      break;
    }
    l_->PollPosts(*this);  // a mapped launch's messages to other processes (Send)
    bool progress = false, failed = false;
    {
      const int64_t posted = sends_posted_.load(std::memory_order_relaxed);
      progress = posted != posted_seen;
      posted_seen = posted;
    }
    size_t delivered = 0;
    for (size_t k = 0; k < order_.size() && !failed; ++k) {
      const int32_t conn = remote_in_conns_[k];
      for (; next_[k] < static_cast<int32_t>(order_[k].size()); ++next_[k]) {
        Recv& r = recvs_[order_[k][next_[k]]];
        InTransfer& x = transfers_[r.transfer];
        if (!x.arrived) {
          auto arrived = Arrived(x, r.transfer, r);
          if (!arrived.has_value()) {
            FailWith(arrived.error().message(), arrived.error().errc().value_or(ffi::ErrorCode::kInternal));
            failed = true;
            break;
          }
          if (!*arrived) break;
        }
        // Message m owns slot m % num_slots: it may be posted once message m - num_slots was consumed.
        if (r.msg >= layout.num_slots &&
            l_->Flag(r.peer_rank, layout.consumed(), layout.cell(conn, r.msg - layout.num_slots))
                    ->load(std::memory_order_acquire) < Tag(epoch, r.msg - layout.num_slots + 1)) {
          break;
        }
        const size_t cell = layout.cell(conn, r.msg);
        *l_->Desc(r.rank, cell) = MsgDesc{reinterpret_cast<unsigned long long>(x.data), r.bytes, v_->identity, 0};
        l_->Flag(r.rank, layout.posted(), cell)->store(Tag(epoch, r.msg + 1), std::memory_order_release);
        r.delivered = true;
        l_->Delivered(r.rank, cell);
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
    if (Clock::now() >= v_->deadline) {
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
      FailWith(StrCat("jaxccl: deadline exceeded: ", what, " for ", Seconds(v_->timeout_s), "; this process's proxy: ",
                      Describe(/*pending_only=*/true)),
               ffi::ErrorCode::kDeadlineExceeded);
      break;
    }
    if (progress) {
      idle.Reset();
    } else {
      idle.Pause();
    }
  }
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_.store(true);
  }
  done_cv_.notify_all();
}

void Proxy::WaitDone() {
  std::unique_lock<std::mutex> lock(done_mu_);
  done_cv_.wait_until(lock, v_->deadline + std::chrono::seconds(2), [&] { return done_.load(); });
}

}  // namespace jaxccl
