#include "transport/mapped_launch.h"

#include "core/program.h"
#include "transport/proxy.h"

namespace jaxccl {

ffi::ErrorOr<std::unique_ptr<MappedLaunch>> MappedLaunch::Create(const MappedLaunchSpec& spec,
                                                                 std::shared_ptr<const ProcessGroup> group) {
  using R = std::unique_ptr<MappedLaunch>;
  auto refuse = [](const std::string& what) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat("jaxccl: mapped launch: ", what)));
  };
  const ProxyLaunchView& v = spec.view;
  if (!group) return refuse("no process group");
  if (!v.table) return refuse("no table");
  const Table& t = *v.table;
  const auto n = static_cast<size_t>(t.num_ranks);
  if (group->process_of_rank.size() != n || spec.regions.size() != n || v.buffers.size() != n) {
    return refuse(StrCat("the table has ", n, " ranks, the group ", group->process_of_rank.size(), ", the spec ",
                         spec.regions.size(), " regions and ", v.buffers.size(), " rank buffers"));
  }
  for (size_t r = 0; r < n; ++r) {
    if (spec.regions[r] == nullptr || reinterpret_cast<uintptr_t>(spec.regions[r]) % 8 != 0) {
      return refuse(StrCat("rank ", r, "'s flag region is null or not 8-byte aligned"));
    }
  }
  if (spec.staging == nullptr) return refuse("no staging memory");
  if (v.layout.num_slots != t.num_slots || v.layout.num_conns != t.num_conns() || v.tiles < 1) {
    return refuse("the view's layout or tiles do not fit the table");
  }
  R l(new MappedLaunch());
  l->spec_ = spec;
  l->group_ = std::move(group);
  for (int32_t r = 0; r < t.num_ranks; ++r) {
    if (l->group_->Local(r)) l->local_.push_back(r);
  }
  for (int32_t c = 0; c < t.num_conns(); ++c) {
    const TableConn& conn = t.conns[c];
    if (!l->group_->Local(conn.sender) || l->group_->Local(conn.receiver)) continue;
    OutConn o{c, conn.sender, conn.receiver, v.tiles * ProgramView(t.programs[conn.sender].data()).conn_msgs(c), {}};
    for (int32_t s = 0; s < v.layout.num_slots; ++s) o.next.push_back(s);
    l->out_.push_back(std::move(o));
  }
  return l;
}

std::atomic<uint64_t>* MappedLaunch::Flag(int32_t rank, size_t offset, size_t index) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(spec_.regions[rank] + offset) + index;
}

MsgDesc* MappedLaunch::Desc(int32_t rank, size_t cell) const {
  return reinterpret_cast<MsgDesc*>(spec_.regions[rank] + spec_.view.layout.msgs()) + cell;
}

std::atomic<int32_t>* MappedLaunch::ErrorWord(int32_t rank) const {
  static_assert(sizeof(std::atomic<int32_t>) == 4 && std::atomic<int32_t>::is_always_lock_free,
                "an error word is a lock-free 32-bit atomic");
  return reinterpret_cast<std::atomic<int32_t>*>(spec_.regions[rank] + spec_.view.layout.error());
}

void MappedLaunch::PollPosts(ProxyHandle& proxy) {
  const ProxyLaunchView& v = spec_.view;
  const RegionLayout& layout = v.layout;
  for (OutConn& o : out_) {
    // Message m owns slot m % num_slots and is posted only after m - num_slots was consumed, which the proxy
    // stores once it sent it: on each slot the messages come in order, one at a time.
    for (int32_t& m : o.next) {
      if (m >= o.total) continue;
      const size_t cell = layout.cell(o.conn, m);
      if (Flag(o.receiver, layout.posted(), cell)->load(std::memory_order_acquire) < Tag(v.epoch, m + 1)) continue;
      const MsgDesc d = *Desc(o.receiver, cell);
      if (d.identity != v.identity) {
        const TableConn& conn = v.table->conns[o.conn];
        const int32_t rank_op = ProgramView(v.table->programs[o.sender].data())
                                    .tb(conn.send_tb - v.table->rank_first_tb[o.sender])
                                    .first_op;
        Fail(StrCat("jaxccl: ", Where(conn.send_tb, rank_op), " posted message ", m, " to rank ", o.receiver,
                    " with the identity ", d.identity, " of another launch (this launch's: ", v.identity, ")"),
             ffi::ErrorCode::kInternal);
        return;
      }
      proxy.Send(o.sender, o.conn, m, reinterpret_cast<const void*>(d.ptr), static_cast<size_t>(d.bytes),
                 /*direct=*/false);
      m += layout.num_slots;
    }
  }
}

void MappedLaunch::Fail(const std::string& message, ffi::ErrorCode code) {
  failed_.store(true);
  for (int32_t r : local_) {
    std::atomic<int32_t>* e = ErrorWord(r);
    int32_t ok = kProtocolOk;
    if (e[0].compare_exchange_strong(ok, kPeerFailed)) {
      e[1].store(-1, std::memory_order_relaxed);  // no threadblock, no op: the proxy's error says what failed
      e[2].store(-1, std::memory_order_relaxed);
    }
  }
}

bool MappedLaunch::Aborted() const {
  if (failed_.load()) return true;
  for (int32_t r : local_) {
    if (ErrorWord(r)->load(std::memory_order_acquire) != kProtocolOk) return true;
  }
  return false;
}

std::string MappedLaunch::Where(int32_t global_tb, int32_t rank_op) const {
  return DescribeOp(*spec_.view.table, group_.get(), global_tb, rank_op);
}

ffi::ErrorOr<std::unique_ptr<ProxyHandle>> StartMappedProxy(const MappedLaunchSpec& spec,
                                                            std::shared_ptr<const ProcessGroup> group) {
  using R = std::unique_ptr<ProxyHandle>;
  auto launch = MappedLaunch::Create(spec, group);
  if (!launch.has_value()) return ErrorResult<R>(std::move(launch.error()));
  ProxyLaunch* raw = launch->get();
  auto proxy = Proxy::Create(raw, group, NextLaunchNumber(*group, spec.view.slot), std::move(*launch));
  if (!proxy.has_value()) return ErrorResult<R>(std::move(proxy.error()));
  (*proxy)->Start();
  return R(std::move(*proxy));
}

}  // namespace jaxccl
