// The per-rank program: what one rank's executor reads (host memory on the CPU, device memory on a
// GPU). Built once per table by program_builder.h; every backend interprets it through ProgramView.
//
// int32 words:
//   header  [kProgHeader]  num_tbs, num_ops, num_conns, num_slots, num_staged_conns, num_sends,
//                          num_waits, max_ops (largest num_ops of any rank: the flag region's size),
//                          tileable (1: every op's chunk range lies in one period, so the program
//                          may run in tiles, protocol.h), 0
//   tbs     [num_tbs][kProgTb]  first_op, num_ops, send_conn, recv_conn, send_peer, recv_peer,
//                               num_sends, first_send
//   ops     [num_ops][kProgOp]  kind, src_buf, src_off, dst_buf, dst_off, count, dep, flags,
//                               send_msg, recv_msg, first_wait, num_waits, next_fold (the op that
//                               depends on this one and adds into the range it wrote, -1: none)
//   staged_index [num_conns]  position of the connection among those that stage (-1: stages nothing)
//   conn_msgs    [num_conns]  messages the connection carries (per tile)
//   send_ops     [num_sends]  for threadblock t, send_ops[first_send + m] is the op posting message m
//   waits        [num_waits]  the ops (rank-local indices) an op waits for besides its dependency
// `dep` and `waits` are rank-local op indices; `first_op` is rank-local too.
#ifndef JAXCCL_XLA_FFI_CORE_PROGRAM_H_
#define JAXCCL_XLA_FFI_CORE_PROGRAM_H_

#include <cstdint>

#include "hd.h"
#include "table_format.h"

namespace jaxccl {

inline constexpr int kProgHeader = 10;
inline constexpr int kProgTb = 8;
inline constexpr int kProgOp = 13;

// An op as the program orders it: after rank-local op `dep` (-1: none) and the `num_waits` ops listed
// from `first_wait`; `next_fold` continues its fold (-1: none).
struct ProgOp : CompiledOp {
  int32_t dep;
  int32_t first_wait;
  int32_t num_waits;
  int32_t next_fold;
};

struct ProgTb {
  int32_t first_op, num_ops, send_conn, recv_conn, send_peer, recv_peer, num_sends, first_send;
};

class ProgramView {
 public:
  JAXCCL_HD explicit ProgramView(const int32_t* words) : w_(words) {}
  JAXCCL_HD int32_t num_tbs() const { return w_[0]; }
  JAXCCL_HD int32_t num_ops() const { return w_[1]; }
  JAXCCL_HD int32_t num_conns() const { return w_[2]; }
  JAXCCL_HD int32_t num_slots() const { return w_[3]; }
  JAXCCL_HD int32_t num_staged_conns() const { return w_[4]; }
  JAXCCL_HD int32_t num_sends() const { return w_[5]; }
  JAXCCL_HD int32_t num_waits() const { return w_[6]; }
  JAXCCL_HD int32_t max_ops() const { return w_[7]; }
  JAXCCL_HD bool tileable() const { return w_[8] != 0; }
  JAXCCL_HD ProgTb tb(int32_t t) const {
    const int32_t* r = w_ + kProgHeader + t * kProgTb;
    return ProgTb{r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]};
  }
  JAXCCL_HD ProgOp op(int32_t o) const {
    const int32_t* r = ops_base() + o * kProgOp;
    return ProgOp{{static_cast<OpCode>(r[0]), static_cast<BufferId>(r[1]), r[2], static_cast<BufferId>(r[3]), r[4],
                   r[5], r[7], r[8], r[9]},
                  r[6], r[10], r[11], r[12]};
  }
  JAXCCL_HD int32_t staged_index(int32_t conn) const { return ops_base()[num_ops() * kProgOp + conn]; }
  JAXCCL_HD int32_t conn_msgs(int32_t conn) const { return ops_base()[num_ops() * kProgOp + num_conns() + conn]; }
  // The rank-local op that posts message m (of one tile) of threadblock t.
  JAXCCL_HD int32_t send_op(const ProgTb& t, int32_t m) const {
    return t.first_op + ops_base()[num_ops() * kProgOp + 2 * num_conns() + t.first_send + m];
  }
  JAXCCL_HD int32_t wait(int32_t k) const {
    return ops_base()[num_ops() * kProgOp + 2 * num_conns() + num_sends() + k];
  }

 private:
  JAXCCL_HD const int32_t* ops_base() const { return w_ + kProgHeader + num_tbs() * kProgTb; }
  const int32_t* w_;
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_PROGRAM_H_
