// The compiled schedule table (docs/schedule-ir.md, "Compiled table (version 1)").
//
// ParseTable checks every word of the flat int32 array and returns either a
// Table (the words plus derived per-connection and per-message indices the
// executors need) or an ffi::Error naming the first bad word. Both executors
// (CPU and CUDA) interpret exactly this structure.
#ifndef JAXCCL_XLA_FFI_TABLE_H_
#define JAXCCL_XLA_FFI_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxccl {

namespace ffi = xla::ffi;

inline constexpr int32_t kTableMagic = 0x4C43434A;  // "JCCL" little-endian
inline constexpr int32_t kTableVersion = 1;
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

inline constexpr int32_t kOpFlagDirect = 1;
inline constexpr int32_t kTableFlagOrderedReduction = 1;

const char* OpName(OpCode kind);
const char* CollectiveName(CollectiveCode c);
const char* BufferName(BufferId b);
bool OpSends(OpCode kind);
bool OpReceives(OpCode kind);
bool OpReduces(OpCode kind);

struct TableOp {
  OpCode kind;
  BufferId src_buf;
  int32_t src_off;
  BufferId dst_buf;
  int32_t dst_off;
  int32_t count;
  int32_t dep_tb;  // index within the rank, -1 = none
  int32_t dep_op;  // index within that threadblock
  int32_t flags;
  // Derived: the position of this op's message on its send / receive connection (-1 if none).
  int32_t send_msg = -1;
  int32_t recv_msg = -1;
  bool direct() const { return (flags & kOpFlagDirect) != 0; }
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
  std::vector<int32_t> rank_first_tb, rank_num_tbs;
  std::vector<TableTb> tbs;
  std::vector<TableOp> ops;
  std::vector<TableConn> conns;
  bool has_reduction = false;

  int32_t num_tbs() const { return static_cast<int32_t>(tbs.size()); }
  int32_t num_conns() const { return static_cast<int32_t>(conns.size()); }
  int32_t BufferChunks(BufferId b) const;
  // Global threadblock index of threadblock `tb` of `rank`.
  int32_t GlobalTb(int32_t rank, int32_t tb) const { return rank_first_tb[rank] + tb; }
};

// Element layout of chunks (docs/schedule-ir.md, "Chunk sizes"): chunk i starts at
// (i / C) * L + (i % C) * L / C; a range of chunks is one contiguous element span.
inline int64_t ChunkStart(int64_t index, int64_t c, int64_t period_elems) {
  return (index / c) * period_elems + (index % c) * period_elems / c;
}

// Parses and checks a table; the error names the first bad word.
ffi::ErrorOr<std::shared_ptr<const Table>> ParseTable(const int32_t* words, size_t num_words);

// Elements per period L for a rank input of `input_elems` elements, or an error.
ffi::ErrorOr<int64_t> PeriodElements(const Table& t, int64_t input_elems);
// Output elements the collective produces for period length L.
int64_t OutputElements(const Table& t, int64_t period_elems);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TABLE_H_
