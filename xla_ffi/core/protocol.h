// The executor protocol every backend runs (docs/executor.md): the flag region of a rank, the tags in
// it, when an op is ready, what each op does to memory, and how a threadblock picks its next op.
//
// Flags are 64-bit tags (launch epoch << 32 | value), so flags of earlier launches compare smaller
// and nothing is reset between launches. Each rank owns one region (RegionLayout):
//   op_done[o]          Tag(e, 1) once rank-local op o completed
//   posted[k][s]        Tag(e, m + 1): message m of connection k is in slot s = m % num_slots
//                       (in the receiver's region), described by msgs[k][s] (pointer, bytes)
//   consumed[k][s]      Tag(e, m + 1): the receiver consumed message m of slot s (sender's region)
//   error[4]            first failure of the rank: code, threadblock, op
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
#include "sum.h"
#include "table_format.h"

namespace jaxccl {

// Ops of a threadblock a backend considers at once, from its first unfinished op (the in-order next op
// is always among them, so dataflow order can never make less progress than program order).
inline constexpr int32_t kLookahead = 256;

enum ProtocolError : int32_t {
  kProtocolOk = 0,
  kTimeoutDependency = 1,
  kTimeoutMessage = 2,
  kTimeoutSlot = 3,
  kTimeoutDrain = 4,
  kSizeMismatch = 5,
};

struct MsgDesc {
  unsigned long long ptr;
  unsigned long long bytes;
};

JAXCCL_HD unsigned long long Tag(unsigned long long epoch, long long value) {
  return (epoch << 32) | static_cast<unsigned long long>(value);
}

// Byte layout of one rank's flag region (identical on every rank of a launch).
struct RegionLayout {
  int32_t max_ops, num_conns, num_slots;
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

// One rank's three buffers and the chunk geometry of the launch.
struct RankBuffers {
  const char* in;
  char* out;
  char* scratch;
  int64_t period_elems;
  int32_t chunks_per_period;
  int32_t esize;

  JAXCCL_HD char* Addr(BufferId buf, int32_t chunk) const {
    const int64_t elem = ChunkStart(chunk, chunks_per_period, period_elems);
    char* base = buf == BufferId::kInput ? const_cast<char*>(in) : buf == BufferId::kOutput ? out : scratch;
    return base == nullptr ? nullptr : base + elem * esize;
  }
  JAXCCL_HD size_t Bytes(int32_t off, int32_t count) const {
    return RangeBytes(chunks_per_period, period_elems, esize, off, count);
  }
  // Size of the message an op sends / must receive.
  JAXCCL_HD size_t SendBytes(const ProgOp& op) const { return Bytes(op.send_offset(), op.count); }
  JAXCCL_HD size_t RecvBytes(const ProgOp& op) const { return Bytes(op.recv_offset(), op.count); }
};

// An op is ready when its dependency and the ops it must follow are done, its message is there and, if
// it sends, its slot is free (fused ops need both at once, as MSCCL's primitives and the reference
// interpreter do). Probe is the backend's view of the flags:
//   bool Done(int32_t op); bool Posted(int32_t conn, int32_t msg); bool SlotFree(int32_t conn, int32_t msg).
template <class Probe>
JAXCCL_HD bool OpReady(const ProgramView& p, const ProgTb& tb, const ProgOp& op, Probe& probe) {
  if (op.dep >= 0 && !probe.Done(op.dep)) return false;
  for (int32_t k = 0; k < op.num_waits; ++k) {
    if (!probe.Done(p.wait(op.first_wait + k))) return false;
  }
  if (op.receives() && !probe.Posted(tb.recv_conn, op.recv_msg)) return false;
  if (op.sends() && op.send_msg >= p.num_slots() && !probe.SlotFree(tb.send_conn, op.send_msg)) return false;
  return true;
}

// The threadblock's next op in dataflow order: the first ready op among kLookahead from its first
// unfinished one (`*first`, advanced past finished ops). Returns the rank-local op, kAllDone, or
// kNoneReady (the backend waits for a flag to change and asks again).
inline constexpr int32_t kAllDone = -1;
inline constexpr int32_t kNoneReady = -2;
template <class Probe>
JAXCCL_HD int32_t NextReadyOp(const ProgramView& p, const ProgTb& tb, int32_t* first, Probe& probe) {
  const int32_t end = tb.first_op + tb.num_ops;
  while (*first < end && probe.Done(*first)) ++*first;
  if (*first == end) return kAllDone;
  const int32_t last = *first + kLookahead < end ? *first + kLookahead : end;
  for (int32_t o = *first; o < last; ++o) {
    if (o != *first && probe.Done(o)) continue;
    if (OpReady(p, tb, p.op(o), probe)) return o;
  }
  return kNoneReady;
}

// What an op does to memory once it is ready. `msg`/`msg_bytes`: the received message (receives);
// `stage`: the outgoing slot's staging memory (staged sends). Returns where the outgoing message is
// (sends). Mover is the backend's: Copy(dst, src, bytes), Sum(type, dst, a, b, n), Barrier().
struct Outgoing {
  const char* ptr;
  size_t bytes;
};
template <class Mover>
JAXCCL_HD Outgoing RunOpData(const ProgOp& op, const RankBuffers& rb, SumType sum, const char* msg, size_t msg_bytes,
                             char* stage, Mover& m) {
  Outgoing out{nullptr, 0};
  const size_t esize = static_cast<size_t>(rb.esize);
  switch (op.kind) {
    case OpCode::kNop:
      return out;
    case OpCode::kCopy: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off);
      const char* src = rb.Addr(op.src_buf, op.src_off);
      if (dst != src) m.Copy(dst, src, rb.Bytes(op.src_off, op.count));
      return out;
    }
    case OpCode::kReduce: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off);
      m.Sum(sum, dst, dst, rb.Addr(op.src_buf, op.src_off), rb.Bytes(op.src_off, op.count) / esize);
      return out;
    }
    case OpCode::kSend:
      out = Outgoing{rb.Addr(op.src_buf, op.src_off), rb.Bytes(op.src_off, op.count)};
      break;
    case OpCode::kRecv:
    case OpCode::kRecvCopySend: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off);
      m.Copy(dst, msg, msg_bytes);
      out = Outgoing{dst, msg_bytes};
      break;
    }
    case OpCode::kRecvReduceCopy:
    case OpCode::kRecvReduceCopySend: {
      char* dst = rb.Addr(op.dst_buf, op.dst_off);
      m.Sum(sum, dst, rb.Addr(op.src_buf, op.src_off), msg, msg_bytes / esize);
      out = Outgoing{dst, msg_bytes};
      break;
    }
    case OpCode::kRecvReduceSend:
      // The sum exists only in the outgoing staging slot.
      m.Sum(sum, stage, rb.Addr(op.src_buf, op.src_off), msg, msg_bytes / esize);
      return Outgoing{stage, msg_bytes};
  }
  if (op.sends() && !op.direct()) {
    m.Barrier();  // the local write (rcs/rrcs) is complete before it is staged
    m.Copy(stage, out.ptr, out.bytes);
    out.ptr = stage;
  }
  return out;
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_PROTOCOL_H_
