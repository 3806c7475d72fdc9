#include "host/table.h"

#include "core/program_builder.h"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

namespace jaxccl {
namespace {

constexpr const char* kHeaderNames[kHeaderWords] = {
    "magic",          "version",   "collective",       "num_ranks",        "chunks_per_period", "input_chunks",
    "output_chunks",  "scratch_chunks", "num_slots",   "num_threadblocks", "num_ops",           "flags",
    "digest_low32",   "num_connections", "checksum",   "reserved"};
constexpr const char* kTbNames[kTbWords] = {"rank",    "send_peer", "recv_peer", "channel",
                                            "first_op", "num_ops",  "send_conn", "recv_conn"};
constexpr const char* kOpNames[kOpWords] = {"kind",  "src_buf", "src_off", "dst_buf", "dst_off",
                                            "count", "dep_tb",  "dep_op",  "flags",   "reserved"};

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320: zlib's crc32) of a table's words as little-endian
// bytes, the checksum word itself left out: what jaxccl.schedule.table.checksum computes.
class Crc32 {
 public:
  Crc32() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      table_[i] = c;
    }
  }
  uint32_t OfTable(const int32_t* w, size_t n) const {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; ++i) {
      if (i == static_cast<size_t>(kHeaderChecksumWord)) continue;
      const uint32_t word = static_cast<uint32_t>(w[i]);
      for (int b = 0; b < 4; ++b) crc = table_[(crc ^ (word >> (8 * b))) & 0xFFu] ^ (crc >> 8);
    }
    return ~crc;
  }

 private:
  uint32_t table_[256];
};

class Parser {
 public:
  Parser(const int32_t* w, size_t n) : w_(w), n_(n) {}

  ffi::ErrorOr<std::shared_ptr<const Table>> Run();

 private:
  template <typename... Args>
  ffi::Error Bad(size_t word, Args&&... what) {
    std::ostringstream os;
    os << "invalid jaxccl schedule table: word " << word << " (" << Describe(word) << ") = ";
    if (word < n_) {
      os << w_[word];
    } else {
      os << "<missing>";
    }
    os << ": ";
    (os << ... << what);
    return ffi::Error::InvalidArgument(os.str());
  }

  std::string Describe(size_t word) const {
    std::ostringstream os;
    if (word < kHeaderWords) {
      os << "header " << kHeaderNames[word];
    } else if (word < tb_base_) {
      size_t k = word - rank_base_;
      os << "rank " << k / kRankWords << (k % kRankWords == 0 ? " first_threadblock" : " num_threadblocks");
    } else if (word < op_base_) {
      size_t k = word - tb_base_;
      os << "threadblock " << k / kTbWords << " " << kTbNames[k % kTbWords];
    } else {
      size_t k = word - op_base_;
      size_t op = k / kOpWords;
      os << "op " << op;
      if (op < op_owner_.size() && op_owner_[op].first >= 0) {
        os << " [rank " << op_owner_[op].first << ", threadblock " << op_owner_[op].second << ", op "
           << op - t_.tbs[t_.GlobalTb(op_owner_[op].first, op_owner_[op].second)].first_op << "]";
      }
      os << " " << kOpNames[k % kOpWords];
    }
    return os.str();
  }

  size_t TbWord(int32_t tb, int field) const { return tb_base_ + static_cast<size_t>(tb) * kTbWords + field; }
  size_t OpWord(int32_t op, int field) const { return op_base_ + static_cast<size_t>(op) * kOpWords + field; }

  ffi::Error Header();
  ffi::Error Ranks();
  ffi::Error Threadblocks();
  ffi::Error Ops();
  ffi::Error Connections();

  const int32_t* w_;
  size_t n_;
  size_t rank_base_ = kHeaderWords, tb_base_ = kHeaderWords, op_base_ = kHeaderWords;
  int32_t num_tbs_ = 0, num_ops_ = 0, num_conns_ = 0;
  int32_t scratch_used_ = 0;  // chunks 0..scratch_used_-1 of SCRATCH are named by some op
  std::vector<std::pair<int32_t, int32_t>> op_owner_;  // (rank, tb within rank) of every op
  Table t_;
};

ffi::Error Parser::Header() {
  if (n_ < kHeaderWords) {
    return Bad(n_, "table has ", n_, " words, fewer than the ", kHeaderWords, "-word header");
  }
  if (w_[0] != kTableMagic) return Bad(0, "not a jaxccl table (magic 0x4C43434A expected)");
  if (w_[1] != kTableVersion) return Bad(1, "unsupported table version (this executor reads version ", kTableVersion, ")");
  // Integrity before meaning: a table changed after compile_table sealed it is refused as such.
  static const Crc32 crc32;
  t_.checksum = static_cast<uint32_t>(w_[kHeaderChecksumWord]);
  if (const uint32_t actual = crc32.OfTable(w_, n_); actual != t_.checksum) {
    std::ostringstream os;
    os << std::hex << "checksum mismatch: the table's words hash to 0x" << actual << ", not 0x" << t_.checksum
       << " (the table changed after it was compiled; compile_table seals what it emits)";
    return Bad(kHeaderChecksumWord, os.str());
  }
  if (w_[2] < 0 || w_[2] > 3) return Bad(2, "collective code must be 0..3");
  t_.collective = static_cast<CollectiveCode>(w_[2]);
  if (w_[3] < 1 || w_[3] > kMaxTableRanks) return Bad(3, "num_ranks must be in 1..", kMaxTableRanks);
  t_.num_ranks = w_[3];
  if (w_[4] < 1) return Bad(4, "chunks_per_period must be >= 1");
  t_.chunks_per_period = w_[4];
  const int64_t n = t_.num_ranks, c = t_.chunks_per_period;
  int64_t in = 0, out = 0;
  switch (t_.collective) {
    case CollectiveCode::kAllGather: in = c, out = n * c; break;
    case CollectiveCode::kAllToAll: in = n * c, out = n * c; break;
    case CollectiveCode::kReduceScatter: in = n * c, out = c; break;
    case CollectiveCode::kAllReduce: in = c, out = c; break;
  }
  if (out > INT32_MAX) return Bad(4, "num_ranks * chunks_per_period overflows int32");
  if (w_[5] != in) return Bad(5, CollectiveName(t_.collective), " with N=", n, ", C=", c, " has ", in, " input chunks");
  if (w_[6] != out) {
    return Bad(6, CollectiveName(t_.collective), " with N=", n, ", C=", c, " has ", out, " output chunks");
  }
  t_.input_chunks = w_[5];
  t_.output_chunks = w_[6];
  if (w_[7] < 0) return Bad(7, "scratch_chunks must be >= 0");
  t_.scratch_chunks = w_[7];
  if (w_[8] < 1 || w_[8] > kMaxTableSlots) return Bad(8, "num_slots must be in 1..", kMaxTableSlots);
  t_.num_slots = w_[8];
  if (w_[9] < 0) return Bad(9, "num_threadblocks must be >= 0");
  if (w_[10] < 0) return Bad(10, "num_ops must be >= 0");
  num_tbs_ = w_[9];
  num_ops_ = w_[10];
  if (w_[11] & ~kTableFlagOrderedReduction) return Bad(11, "unknown flag bits (only bit 0 is defined)");
  t_.flags = w_[11];
  t_.digest_low32 = static_cast<uint32_t>(w_[kHeaderDigestWord]);
  if (w_[13] < 0) return Bad(13, "num_connections must be >= 0");
  num_conns_ = w_[13];
  if (w_[15] != 0) return Bad(15, "reserved, must be 0");

  // Every size is bounded before anything is sized by it: counts of rows by the table's length, the
  // rest by what those rows can describe and by the absolute limits of core/table_format.h.
  rank_base_ = kHeaderWords;
  tb_base_ = rank_base_ + static_cast<size_t>(n) * kRankWords;
  op_base_ = tb_base_ + static_cast<size_t>(num_tbs_) * kTbWords;
  const size_t expected = op_base_ + static_cast<size_t>(num_ops_) * kOpWords;
  if (n_ != expected) {
    return Bad(n_ < expected ? n_ : expected, "table has ", n_, " words but its header (N=", n, ", ", num_tbs_,
               " threadblocks, ", num_ops_, " ops) implies ", expected);
  }
  if (num_conns_ > num_tbs_) {
    return Bad(13, "more connections than threadblocks (", num_tbs_, "); each connection has its own sending one");
  }
  const int64_t cells = n * (static_cast<int64_t>(t_.input_chunks) + t_.output_chunks + t_.scratch_chunks);
  if (cells > kMaxChunkCells) {
    return Bad(7, "N x (input + output + scratch chunks) = ", cells, " chunk cells, above the limit of ",
               kMaxChunkCells);
  }
  if (n * num_conns_ > kMaxRankConnections) {
    return Bad(13, "N x num_connections = ", n * num_conns_, ", above the limit of ", kMaxRankConnections);
  }
  if (static_cast<int64_t>(num_conns_) * t_.num_slots > kMaxSlotCells) {
    return Bad(8, "num_connections x num_slots = ", static_cast<int64_t>(num_conns_) * t_.num_slots,
               ", above the limit of ", kMaxSlotCells);
  }
  return ffi::Error::Success();
}

ffi::Error Parser::Ranks() {
  int32_t next = 0;
  t_.rank_first_tb.resize(t_.num_ranks);
  t_.rank_num_tbs.resize(t_.num_ranks);
  for (int32_t r = 0; r < t_.num_ranks; ++r) {
    const size_t word = rank_base_ + static_cast<size_t>(r) * kRankWords;
    if (w_[word] != next) return Bad(word, "rank ", r, "'s threadblocks must start at ", next, " (ranks are contiguous)");
    if (w_[word + 1] < 0 || w_[word + 1] > num_tbs_ - next) {
      return Bad(word + 1, "rank ", r, " cannot have that many threadblocks (", num_tbs_ - next, " left)");
    }
    t_.rank_first_tb[r] = next;
    t_.rank_num_tbs[r] = w_[word + 1];
    next += w_[word + 1];
  }
  if (next != num_tbs_) {
    return Bad(rank_base_ + static_cast<size_t>(t_.num_ranks - 1) * kRankWords + 1, "ranks own ", next,
               " threadblocks but the header says ", num_tbs_);
  }
  return ffi::Error::Success();
}

ffi::Error Parser::Threadblocks() {
  t_.tbs.resize(num_tbs_);
  op_owner_.assign(num_ops_, {-1, -1});
  int32_t next_op = 0;
  std::set<std::tuple<int32_t, int32_t, int32_t>> send_keys, recv_keys;
  for (int32_t r = 0; r < t_.num_ranks; ++r) {
    for (int32_t j = 0; j < t_.rank_num_tbs[r]; ++j) {
      const int32_t g = t_.rank_first_tb[r] + j;
      const int32_t* f = w_ + TbWord(g, 0);
      TableTb& tb = t_.tbs[g];
      if (f[0] != r) return Bad(TbWord(g, 0), "threadblock belongs to rank ", r, " per the rank table");
      for (int k = 1; k <= 2; ++k) {
        if (f[k] < -1 || f[k] >= t_.num_ranks || f[k] == r) {
          return Bad(TbWord(g, k), "peer must be -1 or another rank of 0..", t_.num_ranks - 1);
        }
      }
      if (f[3] < 0) return Bad(TbWord(g, 3), "channel must be >= 0");
      if (f[4] != next_op) return Bad(TbWord(g, 4), "ops must be contiguous; expected first op ", next_op);
      if (f[5] < 0 || f[5] > num_ops_ - next_op) {
        return Bad(TbWord(g, 5), "threadblock cannot have that many ops (", num_ops_ - next_op, " left)");
      }
      if ((f[1] == -1) != (f[6] == -1) || f[6] < -1 || f[6] >= num_conns_) {
        return Bad(TbWord(g, 6), f[1] == -1 ? "no send peer, so the send connection must be -1"
                                            : "send connection must be in 0..num_connections-1");
      }
      if ((f[2] == -1) != (f[7] == -1) || f[7] < -1 || f[7] >= num_conns_) {
        return Bad(TbWord(g, 7), f[2] == -1 ? "no receive peer, so the receive connection must be -1"
                                            : "receive connection must be in 0..num_connections-1");
      }
      if (f[1] >= 0 && !send_keys.insert({r, f[1], f[3]}).second) {
        return Bad(TbWord(g, 1), "rank ", r, " has a second threadblock sending to rank ", f[1], " on channel ", f[3]);
      }
      if (f[2] >= 0 && !recv_keys.insert({r, f[2], f[3]}).second) {
        return Bad(TbWord(g, 2), "rank ", r, " has a second threadblock receiving from rank ", f[2], " on channel ",
                   f[3]);
      }
      tb = TableTb{f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]};
      for (int32_t i = 0; i < tb.num_ops; ++i) op_owner_[tb.first_op + i] = {r, j};
      next_op += f[5];
    }
  }
  if (next_op != num_ops_) {
    return Bad(num_tbs_ > 0 ? TbWord(num_tbs_ - 1, 5) : 10, "threadblocks own ", next_op,
               " ops but the header says ", num_ops_);
  }
  return ffi::Error::Success();
}

ffi::Error Parser::Ops() {
  t_.ops.resize(num_ops_);
  const int32_t c = t_.chunks_per_period;
  for (int32_t g = 0; g < num_tbs_; ++g) {
    const TableTb& tb = t_.tbs[g];
    for (int32_t i = 0; i < tb.num_ops; ++i) {
      const int32_t o = tb.first_op + i;
      const int32_t* f = w_ + OpWord(o, 0);
      if (f[0] < 0 || f[0] > static_cast<int32_t>(OpCode::kNop)) return Bad(OpWord(o, 0), "op kind must be 0..8");
      const OpCode kind = static_cast<OpCode>(f[0]);
      TableOp& op = t_.ops[o];
      op.kind = kind;
      const bool uses_src = OpReadsSrc(kind);
      const bool uses_dst = OpWritesDst(kind);
      if (OpSends(kind) && tb.send_peer < 0) {
        return Bad(OpWord(o, 0), "'", OpName(kind), "' sends but its threadblock has no send peer");
      }
      if (OpReceives(kind) && tb.recv_peer < 0) {
        return Bad(OpWord(o, 0), "'", OpName(kind), "' receives but its threadblock has no receive peer");
      }
      if (kind == OpCode::kNop) {
        if (f[5] != 0) return Bad(OpWord(o, 5), "a nop moves no data; count must be 0");
      } else if (f[5] < 1) {
        return Bad(OpWord(o, 5), "count must be >= 1");
      }
      for (int side = 0; side < 2; ++side) {
        const int fb = side == 0 ? 1 : 3;
        const bool used = side == 0 ? uses_src : uses_dst;
        if (!used) {
          if (f[fb] != -1) return Bad(OpWord(o, fb), "'", OpName(kind), "' has no ", side ? "dst" : "src", "; must be -1");
          if (f[fb + 1] != 0) return Bad(OpWord(o, fb + 1), "unused offset must be 0");
          continue;
        }
        if (f[fb] < 0 || f[fb] > 2) return Bad(OpWord(o, fb), "buffer must be 0 (input), 1 (output) or 2 (scratch)");
        const BufferId b = static_cast<BufferId>(f[fb]);
        if (side == 1 && b == BufferId::kInput) return Bad(OpWord(o, fb), "the input buffer is read-only");
        const int32_t size = t_.BufferChunks(b);
        if (f[fb + 1] < 0 || f[fb + 1] > size || f[5] > size - f[fb + 1]) {
          const bool offset_bad = f[fb + 1] < 0 || f[fb + 1] >= size;
          return Bad(OpWord(o, offset_bad ? fb + 1 : 5), "chunks ", f[fb + 1], "..", static_cast<int64_t>(f[fb + 1]) + f[5] - 1, " of ",
                     BufferName(b), " exceed its ", size, " chunks");
        }
        if (b == BufferId::kScratch) scratch_used_ = std::max(scratch_used_, f[fb + 1] + f[5]);
      }
      if (uses_src && uses_dst && (f[2] - f[4]) % c != 0) {
        return Bad(OpWord(o, 4), "src offset ", f[2], " and dst offset ", f[4], " differ in chunk class mod ", c);
      }
      op.src_buf = static_cast<BufferId>(f[1]);
      op.src_off = f[2];
      op.dst_buf = static_cast<BufferId>(f[3]);
      op.dst_off = f[4];
      op.count = f[5];
      const int32_t rank = tb.rank;
      const int32_t own = g - t_.rank_first_tb[rank];
      if (f[6] == -1) {
        if (f[7] != -1) return Bad(OpWord(o, 7), "no dependency threadblock, so the dependency op must be -1");
      } else {
        if (f[6] < 0 || f[6] >= t_.rank_num_tbs[rank]) {
          return Bad(OpWord(o, 6), "dependency threadblock must be -1 or 0..", t_.rank_num_tbs[rank] - 1,
                     " (an index within rank ", rank, ")");
        }
        const TableTb& dep = t_.tbs[t_.rank_first_tb[rank] + f[6]];
        if (f[7] < 0 || f[7] >= dep.num_ops) {
          return Bad(OpWord(o, 7), "dependency op must be in 0..", dep.num_ops - 1, " of threadblock ", f[6]);
        }
        if (f[6] == own && f[7] >= i) return Bad(OpWord(o, 7), "depends on a later op of its own threadblock");
      }
      op.dep_tb = f[6];
      op.dep_op = f[7];
      if (f[8] & ~kOpFlagDirect) return Bad(OpWord(o, 8), "unknown op flag bits (only bit 0, direct, is defined)");
      if ((f[8] & kOpFlagDirect) && (!OpSends(kind) || kind == OpCode::kRecvReduceSend)) {
        return Bad(OpWord(o, 8), "only s, rcs and rrcs sends can be direct");
      }
      op.flags = f[8];
      if (f[9] != 0) return Bad(OpWord(o, 9), "reserved, must be 0");
      if (OpReduces(kind)) t_.has_reduction = true;
    }
  }
  if (scratch_used_ != t_.scratch_chunks) {
    return Bad(7, "the ops use ", scratch_used_, " scratch chunks; a compiled table declares exactly the scratch it uses");
  }
  return ffi::Error::Success();
}

ffi::Error Parser::Connections() {
  t_.conns.assign(num_conns_, TableConn{});
  for (int32_t g = 0; g < num_tbs_; ++g) {
    const TableTb& tb = t_.tbs[g];
    for (int side = 0; side < 2; ++side) {
      const int32_t k = side == 0 ? tb.send_conn : tb.recv_conn;
      if (k < 0) continue;
      TableConn& cn = t_.conns[k];
      const int32_t sender = side == 0 ? tb.rank : tb.recv_peer;
      const int32_t receiver = side == 0 ? tb.send_peer : tb.rank;
      if (cn.sender >= 0 && (cn.sender != sender || cn.receiver != receiver || cn.channel != tb.channel)) {
        return Bad(TbWord(g, side == 0 ? 6 : 7), "connection ", k, " is rank ", cn.sender, " -> rank ", cn.receiver,
                   " channel ", cn.channel, ", not rank ", sender, " -> rank ", receiver, " channel ", tb.channel);
      }
      int32_t& end = side == 0 ? cn.send_tb : cn.recv_tb;
      if (end >= 0) {
        return Bad(TbWord(g, side == 0 ? 6 : 7), "connection ", k, " already has a ", side == 0 ? "sending" : "receiving",
                   " threadblock (", end, ")");
      }
      end = g;
      cn.sender = sender;
      cn.receiver = receiver;
      cn.channel = tb.channel;
    }
  }
  std::map<std::tuple<int32_t, int32_t, int32_t>, int32_t> seen;
  for (int32_t k = 0; k < num_conns_; ++k) {
    TableConn& cn = t_.conns[k];
    if (cn.send_tb < 0 || cn.recv_tb < 0) {
      return Bad(13, "connection ", k, " has no ", cn.send_tb < 0 ? "sending" : "receiving", " threadblock");
    }
    const auto key = std::make_tuple(cn.sender, cn.receiver, cn.channel);
    if (auto it = seen.find(key); it != seen.end()) {
      return Bad(TbWord(cn.send_tb, 6), "connections ", it->second, " and ", k, " are both rank ", cn.sender,
                 " -> rank ", cn.receiver, " channel ", cn.channel);
    }
    seen[key] = k;
    const TableTb& s = t_.tbs[cn.send_tb];
    const TableTb& r = t_.tbs[cn.recv_tb];
    std::vector<int32_t> sends, recvs;
    for (int32_t i = 0; i < s.num_ops; ++i) {
      if (OpSends(t_.ops[s.first_op + i].kind)) sends.push_back(s.first_op + i);
    }
    for (int32_t i = 0; i < r.num_ops; ++i) {
      if (OpReceives(t_.ops[r.first_op + i].kind)) recvs.push_back(r.first_op + i);
    }
    if (sends.size() != recvs.size()) {
      return Bad(TbWord(cn.recv_tb, 7), "connection ", k, " (rank ", cn.sender, " -> rank ", cn.receiver, " channel ",
                 cn.channel, ") carries ", sends.size(), " sends but ", recvs.size(), " receives");
    }
    cn.num_msgs = static_cast<int32_t>(sends.size());
    for (size_t m = 0; m < sends.size(); ++m) {
      TableOp& so = t_.ops[sends[m]];
      TableOp& ro = t_.ops[recvs[m]];
      so.send_msg = static_cast<int32_t>(m);
      ro.recv_msg = static_cast<int32_t>(m);
      if (!so.direct()) ++cn.num_staged;
      if (so.count != ro.count) {
        return Bad(OpWord(recvs[m], 5), "message ", m, " of connection ", k, " is sent with ", so.count,
                   " chunk(s) but received with ", ro.count);
      }
      if ((so.send_offset() - ro.recv_offset()) % t_.chunks_per_period != 0) {
        return Bad(OpWord(recvs[m], ro.kind == OpCode::kRecvReduceSend ? 2 : 4), "message ", m, " of connection ", k,
                   " is sent from chunk ", so.send_offset(), ", another chunk class mod ", t_.chunks_per_period);
      }
    }
  }
  return ffi::Error::Success();
}

ffi::ErrorOr<std::shared_ptr<const Table>> Parser::Run() {
  for (auto step : {&Parser::Header, &Parser::Ranks, &Parser::Threadblocks, &Parser::Ops, &Parser::Connections}) {
    if (ffi::Error e = (this->*step)(); e.failure()) return ffi::Unexpected<ffi::Error>(std::move(e));
  }
  t_.words.assign(w_, w_ + n_);
  BuildPrograms(&t_);
  return std::shared_ptr<const Table>(std::make_shared<Table>(std::move(t_)));
}

}  // namespace

ffi::ErrorOr<std::shared_ptr<const Table>> ParseTable(const int32_t* words, size_t num_words) {
  return Parser(words, num_words).Run();
}

}  // namespace jaxccl
