// When the bytes a send reads from its source are known (docs/executor.md, "Stable sources"). Host only.
//
// Both rules are one relation over a rank's program (program.h) with two anchors: every op of the rank
// that writes a chunk of the send's source range is the anchor or precedes it through dependencies and
// waits (input chunks are never written).
//
// - Final at its dependency (SourceFinalAtDependency), anchor = the send's dependency: once the
//   dependency is done the bytes are fixed, whenever the send runs. Sends of one range with one
//   dependency therefore carry the same bytes (transport/shared_sends.cc lets them share a transfer),
//   and a fold whose last op is the dependency computes them (CpuLaunch::FindPushes writes the fold's
//   result into the receiver's buffer in place of the message).
// - Stable in flight (SourceStableInFlight), anchor = the send itself: nothing rewrites the source
//   after the send, so its receiver may read it in place while the message is in flight. This is the
//   table's direct flag, which the table compiler computes by the same rule over the schedule
//   (jaxccl/schedule/table.py, _direct_sends) and the executors trust; the definition here is its C++
//   twin for the test that compares the two (tests/executor/test_core_rules.py).
//
// They are different rules: the first implies the second (the dependency precedes the send), not the
// converse. A send whose source was written by an earlier op of its own threadblock, or by an op it
// waits for besides its dependency, is stable in flight but not final at its dependency: its bytes are
// known only when the send itself may run, which is all a direct message needs and too late for a
// shared transfer or a fold that writes them.
#ifndef JAXCCL_XLA_FFI_CORE_STABLE_SOURCE_H_
#define JAXCCL_XLA_FFI_CORE_STABLE_SOURCE_H_

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "program.h"
#include "table_format.h"

namespace jaxccl {

// The ancestors of a program's ops through dependencies and waits, computed once per anchor asked for.
class ProgramAncestry {
 public:
  explicit ProgramAncestry(const ProgramView& p) : p_(p) {}

  // Whether op `o` is `anchor` or precedes it.
  bool Precedes(int32_t o, int32_t anchor) {
    if (anchor < 0 || anchor >= p_.num_ops() || o < 0 || o >= p_.num_ops()) return false;
    std::vector<int8_t>& memo = memo_[anchor];
    if (memo.empty()) {
      memo.assign(p_.num_ops(), 0);
      std::vector<int32_t> todo{anchor};
      while (!todo.empty()) {
        const int32_t x = todo.back();
        todo.pop_back();
        if (x < 0 || x >= p_.num_ops() || memo[x]) continue;
        memo[x] = 1;
        const ProgOp op = p_.op(x);
        todo.push_back(op.dep);
        for (int32_t k = 0; k < op.num_waits; ++k) todo.push_back(p_.wait(op.first_wait + k));
      }
    }
    return memo[o] == 1;
  }

  const ProgramView& program() const { return p_; }

 private:
  ProgramView p_;
  std::unordered_map<int32_t, std::vector<int8_t>> memo_;  // per anchor: 1 for the anchor and its ancestors
};

// Whether every op that writes a chunk of [off, off + count) of `buf` is `anchor` or precedes it.
inline bool WritersPrecede(ProgramAncestry& a, BufferId buf, int32_t off, int32_t count, int32_t anchor) {
  if (buf == BufferId::kInput) return true;
  const ProgramView& p = a.program();
  for (int32_t o = 0; o < p.num_ops(); ++o) {
    const ProgOp w = p.op(o);
    if (!OpWritesDst(w.kind) || w.dst_buf != buf || w.dst_off >= off + count || w.dst_off + w.count <= off) continue;
    if (!a.Precedes(o, anchor)) return false;
  }
  return true;
}

// A sending op whose message is a range of its buffers (every one but `rrs`, whose message is a sum
// made in its staging slot).
inline bool SendsARange(const ProgOp& op) { return op.sends() && op.kind != OpCode::kRecvReduceSend; }

// Final at its dependency: the bytes send `s` (a rank-local op) reads are fixed once its dependency is done.
inline bool SourceFinalAtDependency(ProgramAncestry& a, int32_t s) {
  const ProgOp op = a.program().op(s);
  if (!SendsARange(op)) return false;
  if (op.send_buf() == BufferId::kInput) return true;
  return op.dep >= 0 && WritersPrecede(a, op.send_buf(), op.send_offset(), op.count, op.dep);
}

// Stable in flight: nothing rewrites the bytes send `s` reads after it (the direct flag's rule).
inline bool SourceStableInFlight(ProgramAncestry& a, int32_t s) {
  const ProgOp op = a.program().op(s);
  return SendsARange(op) && WritersPrecede(a, op.send_buf(), op.send_offset(), op.count, s);
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_STABLE_SOURCE_H_
