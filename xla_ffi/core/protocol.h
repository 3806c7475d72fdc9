// The executor protocol every backend runs (docs/executor.md): the flag region of a rank, the tags in
// it, when an op is ready, what each op does to memory, and how a threadblock picks its next op.
//
// Tiles (MSCCL's loop iterations): a tileable program (program.h) may run `tiles` times, tile t on
// the t-th slice of every chunk (TileSpan), so the hops of a tree overlap like a pipeline. Tile t of
// op o is the *unit* t * n + i of its threadblock (i: the op's index in it, n: its op count); units
// run in dataflow order, and message m of a connection carrying M messages per tile is, in tile t,
// message t * M + m. With one tile the layout is the table's chunk layout (ChunkStart).
//
// Flags are 64-bit tags (launch epoch << 32 | value), so flags of earlier launches compare smaller
// and nothing is reset between launches. Each rank owns one region (RegionLayout):
//   op_done[t][o]       Tag(e, 1) once tile t of rank-local op o completed
//   posted[k][s]        Tag(e, m + 1): message m of connection k is in slot s = m % num_slots
//                       (in the receiver's region), described by msgs[k][s] (pointer, bytes)
//   consumed[k][s]      Tag(e, m + 1): the receiver consumed message m of slot s (sender's region)
//   error[4]            first failure of the rank: code, threadblock, op
// Region memory is reused from launch to launch, and its words are tags only under the layout that
// wrote them: under another layout a descriptor's pointer sits where a tag is read, and its high bits
// compare newer than any epoch. RegionOwner names what a region's contents belong to; a backend clears
// the memory whenever a launch's owner differs from the last one's (RegionNeedsClearing). Every message
// descriptor carries the identity of the launch that posted it (LaunchIdentity: table checksum, epoch),
// and a receiver refuses any other (kStaleMessage): nothing of one launch is consumed by another.
// A message owns slot m % num_slots, so message m may be posted once message m - num_slots was
// consumed, in any order with the other messages of its connection (dataflow order, program.h).
// Backends provide the memory (host atomics or device memory), the waiting, the byte moves and,
// on the CPU, link pacing; the rules below are theirs in common.
#ifndef JAXCCL_XLA_FFI_CORE_PROTOCOL_H_
#define JAXCCL_XLA_FFI_CORE_PROTOCOL_H_

#include <cstddef>
#include <cstdint>

#include "hd.h"
#include "program.h"
#include "reduce.h"
#include "table_format.h"

namespace jaxccl {

// Ops of a threadblock a backend considers at once, from its first unfinished op (the in-order next op
// is always among them, so dataflow order can never make less progress than program order).
inline constexpr int32_t kLookahead = 256;
// Most tiles a launch runs, and the smallest message a tile should still carry: a 128 MiB message moves
// in 512 KiB tiles (NCCL's protocol step), so a relay idles for 1/256 of it while its first tile arrives.
// The simulator models the same rule with the values the native module exports as MAX_TILES and
// MIN_TILE_BYTES (jaxccl/sim/model.py; tests/executor/test_executor_core.py checks that they agree).
inline constexpr int32_t kMaxTiles = 256;
inline constexpr size_t kMinTileBytes = 64 << 10;

// Tiles of a launch: one unless the program is tileable and the executor pipelines (a GPU always, the
// CPU when it emulates links); then as many as keep its largest message >= kMinTileBytes per tile, at
// most `max_tiles` (kMaxTiles; a smaller cap only for comparisons).
JAXCCL_HD int32_t ChooseTiles(bool tileable, bool pipelined, size_t largest_message_bytes,
                              int32_t max_tiles = kMaxTiles) {
  if (!tileable || !pipelined) return 1;
  const size_t t = largest_message_bytes / kMinTileBytes;
  return t < 1 ? 1 : t > static_cast<size_t>(max_tiles) ? max_tiles : static_cast<int32_t>(t);
}

enum ProtocolError : int32_t {
  kProtocolOk = 0,
  kTimeoutDependency = 1,
  kTimeoutMessage = 2,
  kTimeoutSlot = 3,
  kTimeoutDrain = 4,
  kSizeMismatch = 5,
  kStaleMessage = 6,
  kPeerFailed = 7,  // a mapped launch's proxy failed (transport/mapped_launch.h): a process it exchanges with
};

// Who posted a message: the table it runs (its checksum) and the launch (the low 32 bits of its epoch).
JAXCCL_HD unsigned long long LaunchIdentity(unsigned int table_checksum, unsigned long long epoch) {
  return (static_cast<unsigned long long>(table_checksum) << 32) | (epoch & 0xffffffffull);
}
JAXCCL_HD unsigned int IdentityTable(unsigned long long identity) { return static_cast<unsigned int>(identity >> 32); }
JAXCCL_HD unsigned int IdentityLaunch(unsigned long long identity) {
  return static_cast<unsigned int>(identity & 0xffffffffull);
}

struct MsgDesc {
  unsigned long long ptr;
  unsigned long long bytes;
  unsigned long long identity;  // LaunchIdentity of the posting launch
  unsigned long long reserved;
};

JAXCCL_HD unsigned long long Tag(unsigned long long epoch, long long value) {
  return (epoch << 32) | static_cast<unsigned long long>(value);
}

// Byte layout of one rank's flag region (identical on every rank of a launch).
struct RegionLayout {
  int32_t max_ops, num_conns, num_slots;  // max_ops: of any rank, times the launch's tiles
  JAXCCL_HD size_t cells() const { return static_cast<size_t>(num_conns) * static_cast<size_t>(num_slots); }
  JAXCCL_HD size_t op_done() const { return 0; }
  JAXCCL_HD size_t posted() const { return op_done() + 8 * static_cast<size_t>(max_ops); }
  JAXCCL_HD size_t consumed() const { return posted() + 8 * cells(); }
  JAXCCL_HD size_t msgs() const { return consumed() + 8 * cells(); }
  JAXCCL_HD size_t error() const { return msgs() + sizeof(MsgDesc) * cells(); }
  JAXCCL_HD size_t bytes() const { return (error() + 16 + 255) / 256 * 256; }
  JAXCCL_HD size_t cell(int32_t conn, int32_t msg) const {
    return static_cast<size_t>(conn) * static_cast<size_t>(num_slots) + static_cast<size_t>(msg % num_slots);
  }
};

// What a region's contents belong to: the table version and checksum that ran in it, under its layout.
struct RegionOwner {
  long long version;  // the registry version of the table (unique per slot)
  unsigned int checksum;
  RegionLayout layout;
};
// Whether region memory last used by `last` must be cleared before `next` uses it.
JAXCCL_HD bool RegionNeedsClearing(const RegionOwner& last, const RegionOwner& next) {
  return last.version != next.version || last.checksum != next.checksum ||
         last.layout.max_ops != next.layout.max_ops || last.layout.num_conns != next.layout.num_conns ||
         last.layout.num_slots != next.layout.num_slots;
}

// One rank's three buffers and the chunk geometry of the launch.
struct RankBuffers {
  const char* in;
  char* out;
  char* scratch;
  int64_t period_elems;
  int32_t chunks_per_period;
  int32_t esize;
  int32_t tiles;

  // Elements [*begin, *end) of chunks [off, off + count) in tile `tile` (one tile: the table's layout).
  JAXCCL_HD void TileSpan(int32_t off, int32_t count, int32_t tile, int64_t* begin, int64_t* end) const {
    const int64_t c = chunks_per_period, l = period_elems;
    if (tiles == 1) {
      *begin = ChunkStart(off, c, l);
      *end = ChunkStart(static_cast<int64_t>(off) + count, c, l);
      return;
    }
    const int64_t ts = tile * l / tiles, lt = (tile + 1) * l / tiles - ts;
    const int64_t base = (off / c) * l + ts, j = off % c;
    *begin = base + j * lt / c;
    *end = base + (j + count) * lt / c;
  }
  JAXCCL_HD char* Addr(BufferId buf, int32_t off, int32_t tile) const {
    int64_t b, e;
    TileSpan(off, 0, tile, &b, &e);
    char* base = buf == BufferId::kInput ? const_cast<char*>(in) : buf == BufferId::kOutput ? out : scratch;
    return base == nullptr ? nullptr : base + b * esize;
  }
  JAXCCL_HD size_t Bytes(int32_t off, int32_t count, int32_t tile) const {
    int64_t b, e;
    TileSpan(off, count, tile, &b, &e);
    return static_cast<size_t>(e - b) * static_cast<size_t>(esize);
  }
  // Size of the message an op sends / must receive in tile `tile`.
  JAXCCL_HD size_t SendBytes(const ProgOp& op, int32_t tile) const { return Bytes(op.send_offset(), op.count, tile); }
  JAXCCL_HD size_t RecvBytes(const ProgOp& op, int32_t tile) const { return Bytes(op.recv_offset(), op.count, tile); }
};

// One unit of a threadblock's work: tile `tile` of rank-local op `op`, whose messages are `send_msg` and
// `recv_msg` on their connections (-1: none).
struct Unit {
  int32_t tile, op, send_msg, recv_msg;
};

JAXCCL_HD Unit UnitOf(const ProgramView& p, const ProgTb& tb, int32_t v) {
  const int32_t tile = v / tb.num_ops, o = tb.first_op + v % tb.num_ops;
  const ProgOp op = p.op(o);
  const int32_t s = op.sends() ? tile * p.conn_msgs(tb.send_conn) + op.send_msg : -1;
  const int32_t r = op.receives() ? tile * p.conn_msgs(tb.recv_conn) + op.recv_msg : -1;
  return Unit{tile, o, s, r};
}

// A unit is ready when its op's dependency and the ops it must follow are done (same tile), its message
// is there and, if it sends, its slot is free (fused ops need both at once, as MSCCL's primitives and
// the reference interpreter do). Probe is the backend's view of the flags:
//   bool Done(int32_t tile, int32_t op); bool Posted(int32_t conn, int32_t msg);
//   bool SlotFree(int32_t conn, int32_t msg)   (msg >= num_slots: message msg - num_slots was consumed).
template <class Probe>
JAXCCL_HD bool UnitReady(const ProgramView& p, const ProgTb& tb, const Unit& u, const ProgOp& op, Probe& probe) {
  if (op.dep >= 0 && !probe.Done(u.tile, op.dep)) return false;
  for (int32_t k = 0; k < op.num_waits; ++k) {
    if (!probe.Done(u.tile, p.wait(op.first_wait + k))) return false;
  }
  if (u.recv_msg >= 0 && !probe.Posted(tb.recv_conn, u.recv_msg)) return false;
  if (u.send_msg >= p.num_slots() && !probe.SlotFree(tb.send_conn, u.send_msg)) return false;
  return true;
}

// The threadblock's next unit in dataflow order: the first ready one among `lookahead` (kLookahead;
// 1 is program order) from its first unfinished one (`*first`, advanced past finished units). Returns
// the unit index, kAllDone, or kNoneReady (the backend waits for a flag to change and asks again).
inline constexpr int32_t kAllDone = -1;
inline constexpr int32_t kNoneReady = -2;
template <class Probe>
JAXCCL_HD int32_t NextReadyUnit(const ProgramView& p, const ProgTb& tb, int32_t tiles, int32_t* first, Probe& probe,
                                int32_t lookahead = kLookahead) {
  const int32_t n = tb.num_ops, end = n * tiles;
  while (*first < end && probe.Done(*first / n, tb.first_op + *first % n)) ++*first;
  if (*first == end) return kAllDone;
  const int32_t last = *first + lookahead < end ? *first + lookahead : end;
  for (int32_t v = *first; v < last; ++v) {
    const int32_t tile = v / n, o = tb.first_op + v % n;
    if (v != *first && probe.Done(tile, o)) continue;
    const Unit u = UnitOf(p, tb, v);
    if (UnitReady(p, tb, u, p.op(o), probe)) return v;
  }
  return kNoneReady;
}

// Why a unit that stays unready waits (for error reports): the first unmet condition of UnitReady.
template <class Probe>
JAXCCL_HD int32_t StuckReason(const ProgramView& p, const ProgTb& tb, const Unit& u, const ProgOp& op, Probe& probe) {
  if (op.dep >= 0 && !probe.Done(u.tile, op.dep)) return kTimeoutDependency;
  for (int32_t k = 0; k < op.num_waits; ++k) {
    if (!probe.Done(u.tile, p.wait(op.first_wait + k))) return kTimeoutDependency;
  }
  if (u.recv_msg >= 0 && !probe.Posted(tb.recv_conn, u.recv_msg)) return kTimeoutMessage;
  return kTimeoutSlot;
}

// The last message of a threadblock's connection that uses slot `slot`, of `total` (-1: none); a sender
// drains by waiting until each of them was consumed.
JAXCCL_HD int32_t LastMessageOfSlot(int32_t slot, int32_t total, int32_t num_slots) {
  return slot >= total ? -1 : slot + ((total - 1 - slot) / num_slots) * num_slots;
}

// Why a receiver refuses the message `d` it found posted (kProtocolOk: it takes it): another launch's identity
// (kStaleMessage), or not the size its op receives (kSizeMismatch).
JAXCCL_HD int32_t MessageError(const MsgDesc& d, unsigned long long identity, size_t expected_bytes) {
  if (d.identity != identity) return kStaleMessage;
  if (d.bytes != expected_bytes) return kSizeMismatch;
  return kProtocolOk;
}

// Where a staged send of connection `send_conn` stages message `send_msg` in its rank's staging memory: slot
// send_msg % num_slots of the connection's place among the rank's staging connections (ProgramView::staged_index),
// `stage_bytes` per slot.
JAXCCL_HD size_t StageOffset(const ProgramView& p, int32_t send_conn, int32_t send_msg, size_t stage_bytes) {
  return (static_cast<size_t>(p.staged_index(send_conn)) * static_cast<size_t>(p.num_slots()) +
          static_cast<size_t>(send_msg % p.num_slots())) *
         stage_bytes;
}

// Where a sending op's message is.
struct Outgoing {
  const char* ptr;
  size_t bytes;
};
// What an op does to memory once it is ready, as operands: `out` = `a` (a copy of `bytes`), or
// `out` = `a` (+) `b` (a reduction of `bytes` / esize elements), or nothing (`out` null); and where its
// message is before it is staged (sends).
struct DataStep {
  char* out;
  const char* a;
  const char* b;  // null: a copy
  size_t bytes;
  Outgoing send;
};
// The one switch over op kinds of the data step: RunOpData runs it, and a backend that fuses a fold's
// ops (program.h, next_fold) reads the fold's terms from it. `msg`/`msg_bytes`: the received message
// (receives); `stage`: the outgoing slot's staging memory (`rrs` reduces into it).
JAXCCL_HD DataStep OpDataStep(const ProgOp& op, int32_t tile, const RankBuffers& rb, const char* msg,
                              size_t msg_bytes, char* stage) {
  DataStep d{nullptr, nullptr, nullptr, 0, Outgoing{nullptr, 0}};
  switch (op.kind) {
    case OpCode::kNop:
      break;
    case OpCode::kCopy:
      d = DataStep{rb.Addr(op.dst_buf, op.dst_off, tile), rb.Addr(op.src_buf, op.src_off, tile), nullptr,
                   rb.Bytes(op.src_off, op.count, tile), Outgoing{nullptr, 0}};
      break;
    case OpCode::kReduce: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off, tile);
      d = DataStep{dst, dst, rb.Addr(op.src_buf, op.src_off, tile), rb.Bytes(op.src_off, op.count, tile),
                   Outgoing{nullptr, 0}};
      break;
    }
    case OpCode::kSend:
      d.send = Outgoing{rb.Addr(op.src_buf, op.src_off, tile), rb.Bytes(op.src_off, op.count, tile)};
      break;
    case OpCode::kRecv:
    case OpCode::kRecvCopySend: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off, tile);
      d = DataStep{dst, msg, nullptr, msg_bytes, Outgoing{dst, msg_bytes}};
      break;
    }
    case OpCode::kRecvReduceCopy:
    case OpCode::kRecvReduceCopySend: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off, tile);
      d = DataStep{dst, rb.Addr(op.src_buf, op.src_off, tile), msg, msg_bytes, Outgoing{dst, msg_bytes}};
      break;
    }
    case OpCode::kRecvReduceSend:
      // The sum exists only in the outgoing staging slot.
      d = DataStep{stage, rb.Addr(op.src_buf, op.src_off, tile), msg, msg_bytes, Outgoing{stage, msg_bytes}};
      break;
  }
  return d;
}

// Runs an op's data step (OpDataStep) and stages its outgoing message; returns where the message is
// (sends). Mover is the backend's: Copy(dst, src, bytes), Reduce(reduction, dst, acc, term, n), Barrier().
template <class Mover>
JAXCCL_HD Outgoing RunOpData(const ProgOp& op, int32_t tile, const RankBuffers& rb, Reduction red, const char* msg,
                             size_t msg_bytes, char* stage, Mover& m) {
  const DataStep d = OpDataStep(op, tile, rb, msg, msg_bytes, stage);
  if (d.b != nullptr) {
    m.Reduce(red, d.out, d.a, d.b, d.bytes / static_cast<size_t>(rb.esize));
  } else if (d.out != nullptr && d.out != d.a) {
    m.Copy(d.out, d.a, d.bytes);
  }
  Outgoing out = d.send;
  if (op.sends() && !op.direct() && out.ptr != stage) {
    m.Barrier();  // the local write (rcs/rrcs) is complete before it is staged
    m.Copy(stage, out.ptr, out.bytes);
    out.ptr = stage;
  }
  return out;
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_PROTOCOL_H_
