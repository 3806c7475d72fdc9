// Builds the per-rank programs of a parsed table (host only; program.h has the layout).
//
// Dataflow order (docs/executor.md, "No head-of-line blocking"): executors run any op of a threadblock
// whose inputs are ready, not only the next one. The IR orders ops by program order and dependencies;
// what that order protects is data: two ops of one rank that touch the same chunk, one writing it. So
// the builder runs the table once in program order (every threadblock in turn, as far as it can go)
// and, for every op, records the ops of its rank that touched its chunks before it in that run (the
// last writer of a chunk it reads or writes, and the readers since that write of a chunk it writes).
// The schedule is race-free (the reference interpreter checks it), so every legal in-order run orders
// those pairs the same way, and an op that waits for exactly them, its dependency, its message and its
// slot computes what in-order execution computes. Messages keep their FIFO index on their connection
// (a message owns slot index % num_slots), so a later message may overtake an earlier one without
// ever being matched to the wrong receive. If the table cannot run to completion in order (a
// deadlock), every op waits for its predecessor: the executor then reports the stuck op by deadline.
#ifndef JAXCCL_XLA_FFI_CORE_PROGRAM_BUILDER_H_
#define JAXCCL_XLA_FFI_CORE_PROGRAM_BUILDER_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "program.h"
#include "table_format.h"

namespace jaxccl {

namespace program_detail {

// Per rank: for each chunk of the writable buffers, its last writer and its readers since.
class HazardTracker {
 public:
  HazardTracker(int32_t output_chunks, int32_t scratch_chunks)
      : writer_{std::vector<int32_t>(output_chunks, -1), std::vector<int32_t>(scratch_chunks, -1)},
        readers_{std::vector<std::vector<int32_t>>(output_chunks), std::vector<std::vector<int32_t>>(scratch_chunks)} {}

  // Records op `x` (rank-local index) and appends the ops it must follow to `waits`.
  void Visit(int32_t x, const TableOp& op, std::vector<int32_t>* waits) {
    const bool reads_src = OpReadsSrc(op.kind), writes_dst = OpWritesDst(op.kind);
    const bool reads_dst = op.kind == OpCode::kReduce;
    if (reads_src) Read(op.src_buf, op.src_off, op.count, waits);
    if (reads_dst) Read(op.dst_buf, op.dst_off, op.count, waits);
    if (writes_dst) Write(x, op.dst_buf, op.dst_off, op.count, waits);
    if (reads_src) Note(x, op.src_buf, op.src_off, op.count);
    if (reads_dst) Note(x, op.dst_buf, op.dst_off, op.count);
  }

 private:
  int Index(BufferId b) const { return b == BufferId::kOutput ? 0 : b == BufferId::kScratch ? 1 : -1; }
  void Read(BufferId b, int32_t off, int32_t count, std::vector<int32_t>* waits) {
    const int k = Index(b);
    if (k < 0) return;  // the input is never written
    for (int32_t c = off; c < off + count; ++c) {
      if (writer_[k][c] >= 0) waits->push_back(writer_[k][c]);
    }
  }
  void Write(int32_t x, BufferId b, int32_t off, int32_t count, std::vector<int32_t>* waits) {
    const int k = Index(b);
    if (k < 0) return;
    for (int32_t c = off; c < off + count; ++c) {
      if (writer_[k][c] >= 0) waits->push_back(writer_[k][c]);
      waits->insert(waits->end(), readers_[k][c].begin(), readers_[k][c].end());
      writer_[k][c] = x;
      readers_[k][c].clear();
    }
  }
  void Note(int32_t x, BufferId b, int32_t off, int32_t count) {
    const int k = Index(b);
    if (k < 0) return;
    for (int32_t c = off; c < off + count; ++c) readers_[k][c].push_back(x);
  }
  std::vector<int32_t> writer_[2];
  std::vector<std::vector<int32_t>> readers_[2];
};

// Runs the table in program order; fills waits[global op] and returns false on a deadlock.
inline bool InOrderHazards(const Table& t, std::vector<std::vector<int32_t>>* waits) {
  const int32_t num_ops = static_cast<int32_t>(t.ops.size());
  waits->assign(num_ops, {});
  std::vector<int32_t> next(t.tbs.size(), 0), rank_first(t.num_ranks);
  std::vector<int64_t> posted(t.conns.size(), 0), consumed(t.conns.size(), 0);
  std::vector<char> done(num_ops, 0);
  std::vector<HazardTracker> trackers;
  trackers.reserve(t.num_ranks);
  for (int32_t r = 0; r < t.num_ranks; ++r) {
    rank_first[r] = t.RankFirstOp(r);
    trackers.emplace_back(t.output_chunks, t.scratch_chunks);
  }
  int32_t executed = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t g = 0; g < t.tbs.size(); ++g) {
      const TableTb& tb = t.tbs[g];
      for (; next[g] < tb.num_ops; ++next[g]) {
        const int32_t o = tb.first_op + next[g];
        const TableOp& op = t.ops[o];
        if (op.dep_tb >= 0 && !done[t.tbs[t.GlobalTb(tb.rank, op.dep_tb)].first_op + op.dep_op]) break;
        if (OpReceives(op.kind) && posted[tb.recv_conn] <= op.recv_msg) break;
        if (OpSends(op.kind) && op.send_msg - consumed[tb.send_conn] >= t.num_slots) break;
        if (OpReceives(op.kind)) ++consumed[tb.recv_conn];
        if (OpSends(op.kind)) posted[tb.send_conn] = op.send_msg + 1;
        const int32_t local = o - rank_first[tb.rank];
        std::vector<int32_t>& w = (*waits)[o];
        trackers[tb.rank].Visit(local, op, &w);
        std::sort(w.begin(), w.end());
        w.erase(std::unique(w.begin(), w.end()), w.end());
        w.erase(std::remove(w.begin(), w.end(), local), w.end());
        done[o] = 1;
        ++executed;
        progress = true;
      }
    }
  }
  return executed == num_ops;
}

}  // namespace program_detail

// The per-rank programs of `t` (program.h); sets t->programs and t->in_order.
inline void BuildPrograms(Table* t) {
  std::vector<std::vector<int32_t>> waits;
  t->in_order = !program_detail::InOrderHazards(*t, &waits);
  int32_t max_ops = 0, staged = 0;
  // Tiles split every chunk; an op's range must then be one contiguous span per tile: one period.
  int32_t tileable = t->in_order ? 0 : 1;
  const int32_t c = t->chunks_per_period;
  for (const TableOp& op : t->ops) {
    if (op.src_buf != BufferId::kNone && op.src_off % c + op.count > c) tileable = 0;
    if (op.dst_buf != BufferId::kNone && op.dst_off % c + op.count > c) tileable = 0;
  }
  std::vector<int32_t> staged_index(t->conns.size(), -1);
  for (size_t k = 0; k < t->conns.size(); ++k) staged_index[k] = t->conns[k].num_staged > 0 ? staged++ : -1;
  for (int32_t r = 0; r < t->num_ranks; ++r) {
    int32_t n = 0;
    for (int32_t j = 0; j < t->rank_num_tbs[r]; ++j) n += t->tbs[t->rank_first_tb[r] + j].num_ops;
    max_ops = std::max(max_ops, n);
  }
  t->programs.assign(t->num_ranks, {});
  t->op_tb.assign(t->ops.size(), 0);
  for (int32_t g = 0; g < t->num_tbs(); ++g) {
    for (int32_t i = 0; i < t->tbs[g].num_ops; ++i) t->op_tb[t->tbs[g].first_op + i] = g;
  }
  for (int32_t r = 0; r < t->num_ranks; ++r) {
    const int32_t first_tb = t->rank_first_tb[r], ntb = t->rank_num_tbs[r];
    const int32_t first_op = t->RankFirstOp(r);
    int32_t nops = 0, nsends = 0, nwaits = 0;
    for (int32_t j = 0; j < ntb; ++j) {
      const TableTb& tb = t->tbs[first_tb + j];
      nops += tb.num_ops;
      for (int32_t i = 0; i < tb.num_ops; ++i) {
        const int32_t o = tb.first_op + i;
        nsends += OpSends(t->ops[o].kind) ? 1 : 0;
        nwaits += t->in_order ? (i > 0 ? 1 : 0) : static_cast<int32_t>(waits[o].size());
      }
    }
    std::vector<int32_t>& p = t->programs[r];
    p.assign(kProgHeader + ntb * kProgTb + nops * kProgOp + 2 * t->num_conns() + nsends + nwaits, 0);
    const int32_t header[kProgHeader] = {ntb,    nops,    t->num_conns(), t->num_slots, staged,
                                         nsends, nwaits,  max_ops,        tileable,     0};
    std::copy(header, header + kProgHeader, p.begin());
    int32_t* ops = p.data() + kProgHeader + ntb * kProgTb;
    int32_t* staged_out = ops + nops * kProgOp;
    int32_t* conn_msgs = staged_out + t->num_conns();
    for (int32_t k = 0; k < t->num_conns(); ++k) conn_msgs[k] = t->conns[k].num_msgs;
    int32_t* send_ops = conn_msgs + t->num_conns();
    int32_t* wait_out = send_ops + nsends;
    std::copy(staged_index.begin(), staged_index.end(), staged_out);
    int32_t first_send = 0, next_wait = 0;
    for (int32_t j = 0; j < ntb; ++j) {
      const TableTb& tb = t->tbs[first_tb + j];
      int32_t sends = 0;
      for (int32_t i = 0; i < tb.num_ops; ++i) {
        const int32_t o = tb.first_op + i;
        const TableOp& op = t->ops[o];
        // A threadblock is its connection's only sender, so its m-th sending op posts message m.
        if (OpSends(op.kind)) send_ops[first_send + sends++] = i;
        const int32_t dep = op.dep_tb < 0 ? -1 : t->tbs[t->GlobalTb(r, op.dep_tb)].first_op + op.dep_op - first_op;
        const int32_t fw = next_wait;
        if (t->in_order) {
          if (i > 0) wait_out[next_wait++] = o - 1 - first_op;
        } else {
          for (int32_t w : waits[o]) wait_out[next_wait++] = w;
        }
        const int32_t row[kProgOp] = {static_cast<int32_t>(op.kind), static_cast<int32_t>(op.src_buf), op.src_off,
                                      static_cast<int32_t>(op.dst_buf), op.dst_off, op.count, dep, op.flags,
                                      op.send_msg, op.recv_msg, fw, next_wait - fw, -1};
        std::copy(row, row + kProgOp, ops + (o - first_op) * kProgOp);
      }
      const int32_t tbrow[kProgTb] = {tb.first_op - first_op, tb.num_ops, tb.send_conn, tb.recv_conn,
                                      tb.send_peer,           tb.recv_peer, sends,      first_send};
      std::copy(tbrow, tbrow + kProgTb, p.begin() + kProgHeader + j * kProgTb);
      first_send += sends;
    }
    // Folds: an op that depends on the op that last wrote its range and adds into it in place
    // (`rrc` with src = dst, or `re`) continues that op's fold; a backend may run a ready chain of
    // them as one pass (the same sums in the same order).
    if (!t->in_order) {
      for (int32_t y = 0; y < nops; ++y) {
        int32_t* row = ops + y * kProgOp;
        const OpCode kind = static_cast<OpCode>(row[0]);
        const int32_t x = row[6];
        const bool in_place = kind == OpCode::kReduce ||
                              (kind == OpCode::kRecvReduceCopy && row[1] == row[3] && row[2] == row[4]);
        if (x < 0 || !in_place) continue;
        int32_t* prev = ops + x * kProgOp;
        const OpCode pk = static_cast<OpCode>(prev[0]);
        const bool writes = pk == OpCode::kRecv || pk == OpCode::kCopy || pk == OpCode::kRecvReduceCopy ||
                            pk == OpCode::kReduce;
        if (writes && prev[3] == row[3] && prev[4] == row[4] && prev[5] == row[5] && prev[12] < 0) prev[12] = y;
      }
    }
  }
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_PROGRAM_BUILDER_H_
