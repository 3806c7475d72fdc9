#include "transport/shared_sends.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "core/program.h"

namespace jaxccl {
namespace {

// Whether op `o` of a program is `dep` or comes before it through explicit dependencies.
bool Precedes(const ProgramView& p, int32_t o, int32_t dep, std::vector<int8_t>& memo) {
  // memo[op] == 1: op is dep or one of its ancestors (filled on the first call).
  if (memo.empty()) {
    memo.assign(p.num_ops(), 0);
    std::vector<int32_t> todo{dep};
    while (!todo.empty()) {
      const int32_t x = todo.back();
      todo.pop_back();
      if (x < 0 || x >= p.num_ops() || memo[x]) continue;
      memo[x] = 1;
      const ProgOp op = p.op(x);
      todo.push_back(op.dep);
      for (int32_t k = 0; k < op.num_waits; ++k) todo.push_back(p.wait(op.first_wait + k));
    }
  }
  return o >= 0 && o < static_cast<int32_t>(memo.size()) && memo[o] == 1;
}

bool Writes(const ProgOp& op) { return op.kind != OpCode::kSend && op.kind != OpCode::kNop && op.dst_buf != BufferId::kNone; }

// Whether the bytes of `send` (an op of program p) are final once its dependency is done.
bool StableSource(const ProgramView& p, const ProgOp& send, std::map<int32_t, std::vector<int8_t>>& ancestors) {
  if (send.src_buf == BufferId::kInput) return true;
  if (send.dep < 0) return false;
  const int32_t lo = send.send_offset(), hi = lo + send.count;
  std::vector<int8_t>& memo = ancestors[send.dep];
  for (int32_t o = 0; o < p.num_ops(); ++o) {
    const ProgOp w = p.op(o);
    if (!Writes(w) || w.dst_buf != send.src_buf || w.dst_off >= hi || w.dst_off + w.count <= lo) continue;
    if (!Precedes(p, o, send.dep, memo)) return false;
  }
  return true;
}

}  // namespace

SharedSends ShareIdenticalSends(const Table& t, int32_t tiles, const std::vector<int32_t>& process_of_rank) {
  SharedSends out;
  out.leader.resize(t.num_conns());
  // (sender, receiving process, buffer, offset, count, tile, dependency) -> first message with them
  using Key = std::tuple<int32_t, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t>;
  std::map<Key, MessageRef> first;
  std::vector<std::map<int32_t, std::vector<int8_t>>> ancestors(t.num_ranks);
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
      if (op.kind != OpCode::kSend || op.send_msg != m % per_tile || !StableSource(p, op, ancestors[conn.sender])) {
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
