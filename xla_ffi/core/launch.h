// Launch agreement (docs/executor.md, "Launch agreement"): what the calls of one launch must agree on
// and what the launch derives from them and its table, the same for every backend and for the CUDA
// test entry. Host only, and no FFI headers: a backend describes each rank's call as a LaunchArrival
// (host/launch.h does it for FFI calls) and turns a refusal into its own error.
//
// The launch runs the table current at its sequence number, the largest any rank issued
// (AgreedSequence; MCCL Sec. 6.2.2). PlanLaunch then checks that the table has a rank per call, that
// every call has one element type and input size, which the table's period divides, and the output
// size the collective produces, and, when the table reduces, one operator that the element type
// supports; and it sizes the launch: period, scratch, largest (staged) message, tiles (ChooseTiles)
// and the flag region's layout.
#ifndef JAXCCL_XLA_FFI_CORE_LAUNCH_H_
#define JAXCCL_XLA_FFI_CORE_LAUNCH_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "program.h"
#include "protocol.h"
#include "reduce.h"
#include "table_format.h"

namespace jaxccl {

// One rank's call of a launch, as its backend saw it.
struct LaunchArrival {
  bool present = true;  // false: the rank runs in another process (its call is checked there)
  int64_t seq = 0;      // the rank's sequence number of the call on its slot
  int64_t in_elems = 0;
  int64_t out_elems = 0;  // < 0: the caller sizes the output from the plan (the CUDA test entry)
  int32_t in_dtype = -1, out_dtype = -1;  // the backend's element type codes (only compared)
  const char* in_dtype_name = "?";
  const char* out_dtype_name = "?";
  int32_t esize = 0;                // bytes per element of in_dtype; 0: it cannot be moved (sub-byte, token)
  ElemType elem = ElemType::kNone;  // in_dtype as a reduction element type (kNone: it reduces nothing)
  ReduceOp reduce_op = ReduceOp::kSum;
};

// The launch's sequence number: the largest any rank issued.
inline int64_t AgreedSequence(const std::vector<LaunchArrival>& arrivals) {
  int64_t seq = 0;
  for (const LaunchArrival& a : arrivals) seq = std::max(seq, a.seq);
  return seq;
}

struct LaunchOptions {
  bool pipelined = true;          // the backend runs tiles (a GPU always, the CPU when it emulates links)
  int32_t max_tiles = kMaxTiles;  // a smaller cap only for comparisons
  int32_t tiles = 0;              // > 0: exactly this many (at most kMaxTiles) if the program is tileable (tests)
  int64_t slot = 0, version = 0;  // the table's slot and version, for messages
};

struct LaunchPlan {
  int32_t first = 0;  // the first present rank, whose call the others are compared with
  int64_t period_elems = 0;
  int64_t out_elems = 0;
  int32_t esize = 0;
  Reduction reduction;            // none() when the table reduces nothing
  size_t largest_message = 0;     // bytes of the table's largest message (untiled)
  size_t largest_staged = 0;      // ... of its largest staged (not direct) message
  size_t scratch_bytes = 0;       // per rank
  int32_t tiles = 1;
  int32_t op_stride = 0;          // op_done entries per tile: the most ops of any rank
  RegionLayout layout{};
};

// Why a launch is refused (empty: it is not); always an invalid argument of the calls.
struct LaunchError {
  std::string message;
  bool ok() const { return message.empty(); }
};

namespace launch_detail {
template <typename... Args>
LaunchError Refuse(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return LaunchError{os.str()};
}
}  // namespace launch_detail

// Elements per period L for a rank input of `input_elems` elements (-1: the input does not split into periods).
inline int64_t PeriodElements(const Table& t, int64_t input_elems) {
  if (t.collective == CollectiveCode::kAllGather || t.collective == CollectiveCode::kAllReduce) return input_elems;
  return input_elems % t.num_ranks == 0 ? input_elems / t.num_ranks : -1;
}

// Output elements the collective produces for period length L.
inline int64_t OutputElements(const Table& t, int64_t period_elems) {
  switch (t.collective) {
    case CollectiveCode::kAllGather:
    case CollectiveCode::kAllToAll: return period_elems * t.num_ranks;
    case CollectiveCode::kReduceScatter:
    case CollectiveCode::kAllReduce: return period_elems;
  }
  return 0;
}

// Bytes of the table's largest message (only staged ones: `staged_only`) for period length L.
inline size_t LargestMessageBytes(const Table& t, int64_t period_elems, size_t esize, bool staged_only) {
  size_t most = 0;
  for (const TableOp& op : t.ops) {
    if (!op.sends() || (staged_only && op.direct())) continue;
    most = std::max(most, RangeBytes(t.chunks_per_period, period_elems, static_cast<int64_t>(esize), op.send_offset(),
                                     op.count));
  }
  return most;
}

// Checks the calls of a launch of `t` against each other and the table and fills `plan`.
inline LaunchError PlanLaunch(const Table& t, const std::vector<LaunchArrival>& arrivals, const LaunchOptions& opt,
                              LaunchPlan* plan) {
  using launch_detail::Refuse;
  const int32_t n = static_cast<int32_t>(arrivals.size());
  if (t.num_ranks != n) {
    return Refuse("jaxccl: schedule for N=", t.num_ranks, " installed on an axis of size ", n, " (slot ", opt.slot,
                  ", version ", opt.version, ")");
  }
  int32_t first = 0;
  while (first < n - 1 && !arrivals[first].present) ++first;
  const LaunchArrival& a0 = arrivals[first];
  for (int32_t r = 0; r < n; ++r) {
    const LaunchArrival& a = arrivals[r];
    if (!a.present) continue;
    if (a.in_dtype != a0.in_dtype || a.out_dtype != a0.in_dtype) {
      return Refuse("jaxccl: rank ", r, " has input dtype ", a.in_dtype_name, " and output dtype ", a.out_dtype_name,
                    "; expected ", a0.in_dtype_name, " for both on every rank");
    }
    if (a.in_elems != a0.in_elems) {
      return Refuse("jaxccl: rank ", r, " has ", a.in_elems, " input elements but rank ", first, " has ", a0.in_elems);
    }
  }
  if (a0.esize <= 0) {
    return Refuse("jaxccl: dtype ", a0.in_dtype_name,
                  " is not supported (sub-byte and token types cannot be moved)");
  }
  const int64_t period = PeriodElements(t, a0.in_elems);
  if (period < 0) {
    return Refuse("jaxccl ", CollectiveName(t.collective), ": input of ", a0.in_elems,
                  " elements does not split evenly over ", t.num_ranks, " ranks");
  }
  const int64_t out_elems = OutputElements(t, period);
  for (int32_t r = 0; r < n; ++r) {
    const LaunchArrival& a = arrivals[r];
    if (a.present && a.out_elems >= 0 && a.out_elems != out_elems) {
      return Refuse("jaxccl: rank ", r, "'s output has ", a.out_elems, " elements; ", CollectiveName(t.collective),
                    " of ", a0.in_elems, " input elements over ", n, " ranks produces ", out_elems);
    }
  }
  Reduction reduction;
  if (t.has_reduction) {
    for (int32_t r = 0; r < n; ++r) {
      const LaunchArrival& a = arrivals[r];
      if (a.present && a.reduce_op != a0.reduce_op) {
        return Refuse("jaxccl: rank ", r, " asks for a ", ReduceOpName(a.reduce_op), " reduction but rank ", first,
                      " for a ", ReduceOpName(a0.reduce_op), " (", CollectiveName(t.collective), ")");
      }
    }
    if (!Reducible(a0.elem, a0.reduce_op)) {
      return Refuse("jaxccl: a ", ReduceOpName(a0.reduce_op), " reduction of dtype ", a0.in_dtype_name,
                    " is not supported (sum: integers, floats and complex; max/min: integers, floats and PRED)");
    }
    reduction = Reduction{a0.elem, a0.reduce_op};
  }
  const size_t esize = static_cast<size_t>(a0.esize);
  LaunchPlan p;
  p.first = first;
  p.period_elems = period;
  p.out_elems = out_elems;
  p.esize = a0.esize;
  p.reduction = reduction;
  p.largest_message = LargestMessageBytes(t, period, esize, false);
  p.largest_staged = LargestMessageBytes(t, period, esize, true);
  p.scratch_bytes = static_cast<size_t>(ChunkStart(t.scratch_chunks, t.chunks_per_period, period)) * esize;
  const bool tileable = !t.programs.empty() && ProgramView(t.programs[0].data()).tileable();
  p.tiles = opt.tiles > 0 && tileable ? std::min(opt.tiles, kMaxTiles)
                                      : ChooseTiles(tileable, opt.pipelined, p.largest_message, opt.max_tiles);
  p.op_stride = t.programs.empty() ? 0 : ProgramView(t.programs[0].data()).max_ops();
  p.layout = RegionLayout{p.op_stride * p.tiles, t.num_conns(), t.num_slots};
  *plan = p;
  return LaunchError{};
}

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_LAUNCH_H_
