#include "transport/shared_sends.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "core/program.h"
#include "core/protocol.h"
#include "core/stable_source.h"

namespace jaxccl {

namespace {
// Whether receiving op `r` of a rank's program may have its message land in place (SharedSends): the only
// writer of its output range, and every reader of the range follows it.
bool LandsInPlace(ProgramAncestry& a, int32_t r) {
  const ProgramView& p = a.program();
  const ProgOp op = p.op(r);
  if ((op.kind != OpCode::kRecv && op.kind != OpCode::kRecvCopySend) || op.dst_buf != BufferId::kOutput) return false;
  const int32_t lo = op.dst_off, hi = op.dst_off + op.count;
  auto overlaps = [&](BufferId buf, int32_t off, int32_t count) {
    return buf == BufferId::kOutput && off < hi && off + count > lo;
  };
  for (int32_t o = 0; o < p.num_ops(); ++o) {
    if (o == r) continue;
    const ProgOp w = p.op(o);
    if (OpWritesDst(w.kind) && overlaps(w.dst_buf, w.dst_off, w.count)) return false;
    // Every other op that reads the range reads its src (an op that sends its dst writes it: refused above).
    if (OpReadsSrc(w.kind) && overlaps(w.src_buf, w.src_off, w.count) && !a.Precedes(r, o)) return false;
  }
  return true;
}

// Marks the messages between processes that may land in place: alone on their transfer, received by an op
// that LandsInPlace.
void MarkInPlace(const Table& t, int32_t tiles, std::vector<ProgramAncestry>& ancestry, SharedSends* out) {
  std::map<std::pair<int32_t, int32_t>, int32_t> riders;  // per leading message: the messages on its transfer
  for (const auto& conn_leaders : out->leader) {
    for (const MessageRef& l : conn_leaders) ++riders[{l.conn, l.msg}];
  }
  out->in_place.resize(t.num_conns());
  for (int32_t c = 0; c < t.num_conns(); ++c) {
    if (out->leader[c].empty()) continue;
    const TableConn& conn = t.conns[c];
    const ProgramView p(t.programs[conn.receiver].data());
    const ProgTb tb = p.tb(conn.recv_tb - t.rank_first_tb[conn.receiver]);
    std::vector<uint8_t>& in_place = out->in_place[c];
    in_place.assign(out->leader[c].size(), 0);
    std::map<int32_t, bool> op_lands;  // per receiving op of the threadblock
    for (int32_t v = 0; v < tiles * tb.num_ops; ++v) {
      const Unit u = UnitOf(p, tb, v);
      if (u.recv_msg < 0 || u.recv_msg >= static_cast<int32_t>(in_place.size())) continue;
      const MessageRef lead = out->leader[c][u.recv_msg];
      if (!(lead == MessageRef{c, u.recv_msg}) || riders[{c, u.recv_msg}] != 1) continue;
      auto [it, fresh] = op_lands.try_emplace(u.op, false);
      if (fresh) it->second = LandsInPlace(ancestry[conn.receiver], u.op);
      in_place[u.recv_msg] = it->second ? 1 : 0;
    }
  }
}
}  // namespace

SharedSends ShareIdenticalSends(const Table& t, int32_t tiles, const std::vector<int32_t>& process_of_rank) {
  SharedSends out;
  out.leader.resize(t.num_conns());
  // (sender, receiving process, buffer, offset, count, tile, dependency) -> first message with them
  using Key = std::tuple<int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t>;
  std::map<Key, MessageRef> first;
  std::vector<ProgramAncestry> ancestry;
  ancestry.reserve(t.num_ranks);
  for (int32_t r = 0; r < t.num_ranks; ++r) ancestry.emplace_back(ProgramView(t.programs[r].data()));
  for (int32_t c = 0; c < t.num_conns(); ++c) {
    const TableConn& conn = t.conns[c];
    if (process_of_rank[conn.sender] == process_of_rank[conn.receiver]) continue;
    const ProgramView p(t.programs[conn.sender].data());
    const ProgTb tb = p.tb(conn.send_tb - t.rank_first_tb[conn.sender]);
    const int32_t per_tile = p.conn_msgs(c);
    std::vector<MessageRef>& leader = out.leader[c];
    leader.resize(static_cast<size_t>(tiles) * per_tile);
    for (int32_t m = 0; m < static_cast<int32_t>(leader.size()); ++m) {
      leader[m] = MessageRef{c, m};
      const int32_t tile = m / per_tile, o = p.send_op(tb, m % per_tile);
      const ProgOp op = p.op(o);
      if (op.kind != OpCode::kSend || op.send_msg != m % per_tile ||
          !SourceFinalAtDependency(ancestry[conn.sender], o)) {
        continue;
      }
      const Key key{conn.sender, process_of_rank[conn.receiver], static_cast<int32_t>(op.src_buf), op.send_offset(),
                    op.count, tile, op.src_buf == BufferId::kInput ? -1 : op.dep};
      auto [it, fresh] = first.emplace(key, MessageRef{c, m});
      if (!fresh) {
        leader[m] = it->second;
        ++out.shared;
      }
    }
  }
  MarkInPlace(t, tiles, ancestry, &out);
  return out;
}

namespace {
struct CachedSharing {
  std::weak_ptr<const Table> table;
  int32_t tiles;
  std::vector<int32_t> process_of_rank;
  std::shared_ptr<const SharedSends> sharing;
};
constexpr size_t kMaxCachedSharings = 16;  // tables in use at once: a few per communicator and collective
std::mutex cache_mu;
std::vector<CachedSharing>& Cache() {
  static auto* c = new std::vector<CachedSharing>();
  return *c;
}
}  // namespace

std::shared_ptr<const SharedSends> SharedSendsOf(const std::shared_ptr<const Table>& t, int32_t tiles,
                                                 const std::vector<int32_t>& process_of_rank) {
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    for (const CachedSharing& c : Cache()) {
      if (c.table.lock() == t && c.tiles == tiles && c.process_of_rank == process_of_rank) return c.sharing;
    }
  }
  auto sharing = std::make_shared<const SharedSends>(ShareIdenticalSends(*t, tiles, process_of_rank));
  std::lock_guard<std::mutex> lock(cache_mu);
  std::vector<CachedSharing>& cache = Cache();
  cache.erase(std::remove_if(cache.begin(), cache.end(), [](const CachedSharing& c) { return c.table.expired(); }),
              cache.end());
  if (cache.size() >= kMaxCachedSharings) cache.erase(cache.begin());
  cache.push_back(CachedSharing{t, tiles, process_of_rank, sharing});
  return sharing;
}

}  // namespace jaxccl
