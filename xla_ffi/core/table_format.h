// The compiled schedule table (docs/schedule-ir.md, "Compiled table (version 1)") as plain structs and
// the rules every executor applies to it: op kinds and what they read, write, send and receive, chunk
// addressing, and the send/receive offset rule of a message. No FFI headers: the CUDA kernel includes
// this file as device code.
#ifndef JAXCCL_XLA_FFI_CORE_TABLE_FORMAT_H_
#define JAXCCL_XLA_FFI_CORE_TABLE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "hd.h"

namespace jaxccl {

inline constexpr int32_t kTableMagic = 0x4C43434A;  // "JCCL" little-endian
inline constexpr int32_t kTableVersion = 2;
inline constexpr int kHeaderWords = 16;
inline constexpr int kRankWords = 2;
inline constexpr int kTbWords = 8;
inline constexpr int kOpWords = 10;

enum class CollectiveCode : int32_t { kAllGather = 0, kAllToAll = 1, kReduceScatter = 2, kAllReduce = 3 };
enum class BufferId : int32_t { kNone = -1, kInput = 0, kOutput = 1, kScratch = 2 };

// Op kind codes follow OpKind declaration order in jaxccl/schedule/ir.py.
enum class OpCode : int32_t {
  kSend = 0,
  kRecv = 1,
  kRecvCopySend = 2,
  kRecvReduceCopy = 3,
  kRecvReduceSend = 4,
  kRecvReduceCopySend = 5,
  kCopy = 6,
  kReduce = 7,
  kNop = 8,
};
inline constexpr int32_t kNumOpCodes = 9;

// Header words with a meaning of their own beyond a count (docs/schedule-ir.md, "Compiled table").
inline constexpr int kHeaderDigestWord = 12;
inline constexpr int kHeaderChecksumWord = 14;

// Size limits a table must respect before anything is sized by it. A valid schedule respects them:
// kMaxChunkCells is the reference interpreter's MAX_CHUNK_CELLS (jaxccl/schedule/interpreter.py), the
// ranks x (input + output + scratch) chunks it tracks; the program builder tracks the same cells, every
// rank's program names every connection, and the executors keep num_slots cells per connection.
inline constexpr int32_t kMaxTableRanks = 1 << 16;
inline constexpr int32_t kMaxTableSlots = 1 << 16;
inline constexpr int64_t kMaxChunkCells = int64_t{1} << 26;
inline constexpr int64_t kMaxRankConnections = int64_t{1} << 26;  // num_ranks x num_connections
inline constexpr int64_t kMaxSlotCells = int64_t{1} << 26;        // num_connections x num_slots

inline constexpr int32_t kOpFlagDirect = 1;
inline constexpr int32_t kTableFlagOrderedReduction = 1;

JAXCCL_HD bool OpSends(OpCode k) {
  return k == OpCode::kSend || k == OpCode::kRecvCopySend || k == OpCode::kRecvReduceSend ||
         k == OpCode::kRecvReduceCopySend;
}

JAXCCL_HD bool OpReceives(OpCode k) {
  return k == OpCode::kRecv || k == OpCode::kRecvCopySend || k == OpCode::kRecvReduceCopy ||
         k == OpCode::kRecvReduceSend || k == OpCode::kRecvReduceCopySend;
}

JAXCCL_HD bool OpReduces(OpCode k) {
  return k == OpCode::kRecvReduceCopy || k == OpCode::kRecvReduceSend || k == OpCode::kRecvReduceCopySend ||
         k == OpCode::kReduce;
}

// Whether the op reads its src range (docs/schedule-ir.md, "Op semantics").
JAXCCL_HD bool OpReadsSrc(OpCode k) {
  return k == OpCode::kSend || k == OpCode::kRecvReduceCopy || k == OpCode::kRecvReduceSend ||
         k == OpCode::kRecvReduceCopySend || k == OpCode::kCopy || k == OpCode::kReduce;
}

// Whether the op writes its dst range (`re` also reads it).
JAXCCL_HD bool OpWritesDst(OpCode k) {
  return k == OpCode::kRecv || k == OpCode::kRecvCopySend || k == OpCode::kRecvReduceCopy ||
         k == OpCode::kRecvReduceCopySend || k == OpCode::kCopy || k == OpCode::kReduce;
}

// A message's chunk offset on the sending side: fused receive-and-send ops forward what they wrote to
// dst; every other send sends its src.
JAXCCL_HD int32_t SendOffset(OpCode kind, int32_t src_off, int32_t dst_off) {
  return (kind == OpCode::kRecvCopySend || kind == OpCode::kRecvReduceCopySend) ? dst_off : src_off;
}

// The offset whose chunk class and size an incoming message must match: `rrs` reduces the message with
// src (its sum leaves at once), every other receive lands in dst.
JAXCCL_HD int32_t RecvOffset(OpCode kind, int32_t src_off, int32_t dst_off) {
  return kind == OpCode::kRecvReduceSend ? src_off : dst_off;
}

// Element layout of chunks (docs/schedule-ir.md, "Chunk sizes"): chunk i starts at
// (i / C) * L + (i % C) * L / C; a range of chunks is one contiguous element span.
JAXCCL_HD int64_t ChunkStart(int64_t index, int64_t c, int64_t period_elems) {
  return (index / c) * period_elems + (index % c) * period_elems / c;
}

// Bytes of chunks [off, off + count).
JAXCCL_HD size_t RangeBytes(int64_t c, int64_t period_elems, int64_t esize, int32_t off, int32_t count) {
  return static_cast<size_t>(ChunkStart(static_cast<int64_t>(off) + count, c, period_elems) -
                             ChunkStart(off, c, period_elems)) *
         static_cast<size_t>(esize);
}

inline const char* OpName(OpCode kind) {
  constexpr const char* kNames[] = {"s", "r", "rcs", "rrc", "rrs", "rrcs", "cpy", "re", "nop"};
  const int k = static_cast<int>(kind);
  return k >= 0 && k < kNumOpCodes ? kNames[k] : "?";
}

inline const char* CollectiveName(CollectiveCode c) {
  switch (c) {
    case CollectiveCode::kAllGather: return "all_gather";
    case CollectiveCode::kAllToAll: return "all_to_all";
    case CollectiveCode::kReduceScatter: return "reduce_scatter";
    case CollectiveCode::kAllReduce: return "all_reduce";
  }
  return "?";
}

inline const char* BufferName(BufferId b) {
  switch (b) {
    case BufferId::kInput: return "INPUT";
    case BufferId::kOutput: return "OUTPUT";
    case BufferId::kScratch: return "SCRATCH";
    case BufferId::kNone: break;
  }
  return "none";
}

// A message's buffer on the sending side (with SendOffset: where its bytes are read).
JAXCCL_HD BufferId SendBuffer(OpCode kind, BufferId src_buf, BufferId dst_buf) {
  return (kind == OpCode::kRecvCopySend || kind == OpCode::kRecvReduceCopySend) ? dst_buf : src_buf;
}

// One compiled op: what it does to memory and to its connections. The table (TableOp) and the per-rank
// program (ProgOp, program.h) extend it with how the op is ordered, each in its own encoding.
struct CompiledOp {
  OpCode kind;
  BufferId src_buf;
  int32_t src_off;
  BufferId dst_buf;
  int32_t dst_off;
  int32_t count;
  int32_t flags;
  // The position of this op's message on its send / receive connection (-1 if none).
  int32_t send_msg = -1;
  int32_t recv_msg = -1;
  JAXCCL_HD bool direct() const { return (flags & kOpFlagDirect) != 0; }
  JAXCCL_HD bool sends() const { return OpSends(kind); }
  JAXCCL_HD bool receives() const { return OpReceives(kind); }
  JAXCCL_HD BufferId send_buf() const { return SendBuffer(kind, src_buf, dst_buf); }
  JAXCCL_HD int32_t send_offset() const { return SendOffset(kind, src_off, dst_off); }
  JAXCCL_HD int32_t recv_offset() const { return RecvOffset(kind, src_off, dst_off); }
};

// An op as the table orders it: after op `dep_op` of threadblock `dep_tb` of its rank (-1: none).
struct TableOp : CompiledOp {
  int32_t dep_tb = -1;
  int32_t dep_op = -1;
};

struct TableTb {
  int32_t rank;
  int32_t send_peer;
  int32_t recv_peer;
  int32_t channel;
  int32_t first_op;
  int32_t num_ops;
  int32_t send_conn;
  int32_t recv_conn;
};

struct TableConn {
  int32_t sender = -1, receiver = -1, channel = -1;
  int32_t send_tb = -1, recv_tb = -1;  // global threadblock indices
  int32_t num_msgs = 0;
  int32_t num_staged = 0;  // messages that are not direct (need a staging slot)
};

// A parsed table (host only): the words plus the derived per-connection and per-message indices and the
// per-rank programs every executor runs (program.h). xla_ffi/host/table.h parses and checks it.
struct Table {
  std::vector<int32_t> words;
  CollectiveCode collective;
  int32_t num_ranks;
  int32_t chunks_per_period;
  int32_t input_chunks;
  int32_t output_chunks;
  int32_t scratch_chunks;
  int32_t num_slots;
  int32_t flags;
  uint32_t digest_low32;
  uint32_t checksum;
  std::vector<int32_t> rank_first_tb, rank_num_tbs;
  std::vector<TableTb> tbs;
  std::vector<TableOp> ops;
  std::vector<TableConn> conns;
  bool has_reduction = false;
  std::vector<std::vector<int32_t>> programs;  // per rank (program.h)
  bool in_order = false;  // the dataflow analysis found no in-order run: programs keep program order
  std::vector<int32_t> op_tb;  // per global op: its global threadblock

  int32_t num_tbs() const { return static_cast<int32_t>(tbs.size()); }
  int32_t num_conns() const { return static_cast<int32_t>(conns.size()); }
  int32_t BufferChunks(BufferId b) const {
    switch (b) {
      case BufferId::kInput: return input_chunks;
      case BufferId::kOutput: return output_chunks;
      case BufferId::kScratch: return scratch_chunks;
      case BufferId::kNone: break;
    }
    return 0;
  }
  // Global threadblock index of threadblock `tb` of `rank`.
  int32_t GlobalTb(int32_t rank, int32_t tb) const { return rank_first_tb[rank] + tb; }
  // Global index of the first op of `rank` (a rank's ops are contiguous).
  int32_t RankFirstOp(int32_t rank) const {
    for (int32_t r = rank; r < num_ranks; ++r) {
      if (rank_num_tbs[r] > 0) return tbs[rank_first_tb[r]].first_op;
    }
    return static_cast<int32_t>(ops.size());
  }
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_TABLE_FORMAT_H_
