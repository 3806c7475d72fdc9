// The core's dataflow order and measurement windows, exported for the Python code that models them:
// the per-rank programs the builder makes of a table (core/program_builder.h), the next unit a
// threadblock runs (NextReadyUnit, core/protocol.h), and the meter's window state machine
// (core/meter.h). tests/sim/test_ordering_agreement.py compares the simulator's port of the order with
// the first two; jaxccl.distributed.transport.TransportMeter measures cross-process links with the third.
#include "bindings/program_export.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/meter.h"
#include "core/program.h"
#include "core/protocol.h"
#include "host/common.h"
#include "host/table.h"

namespace nb = nanobind;

namespace jaxccl {
namespace {

using Int32Array = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Int64Array = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A parsed table and its programs, kept across calls.
struct ParsedTable {
  std::shared_ptr<const Table> t;
};

ParsedTable Parse(const Int32Array& table) {
  auto t = ParseTable(table.data(), table.shape(0));
  if (!t.has_value()) throw nb::value_error(t.error().message().c_str());
  return ParsedTable{*t};
}

// The backend's view of the flags as arrays: done[tile * num_ops + op], and per connection k the flags of
// its messages at posted[k * stride + m] / consumed[k * stride + m] (stride: the array's size / num_conns).
struct ArrayProbe {
  const int32_t* done;
  const int32_t* posted;
  const int32_t* consumed;
  int64_t num_ops, stride, num_slots;
  bool Done(int32_t tile, int32_t op) const { return done[tile * num_ops + op] != 0; }
  bool Posted(int32_t conn, int32_t msg) const { return posted[conn * stride + msg] != 0; }
  bool SlotFree(int32_t conn, int32_t msg) const { return consumed[conn * stride + msg - num_slots] != 0; }
};

nb::dict ProgramRows(const ParsedTable& parsed) {
  const Table* t = parsed.t.get();
  nb::list ranks;
  for (const std::vector<int32_t>& words : t->programs) {
    const ProgramView p(words.data());
    nb::list tbs, kind, dep, waits, send_msg, recv_msg;
    for (int32_t j = 0; j < p.num_tbs(); ++j) {
      const ProgTb tb = p.tb(j);
      tbs.append(nb::make_tuple(tb.first_op, tb.num_ops, tb.send_conn, tb.recv_conn));
    }
    for (int32_t o = 0; o < p.num_ops(); ++o) {
      const ProgOp op = p.op(o);
      std::vector<int32_t> w(op.num_waits);
      for (int32_t k = 0; k < op.num_waits; ++k) w[k] = p.wait(op.first_wait + k);
      kind.append(static_cast<int32_t>(op.kind));
      dep.append(op.dep);
      waits.append(nb::cast(w));
      send_msg.append(op.send_msg);
      recv_msg.append(op.recv_msg);
    }
    nb::dict r;
    r["tbs"] = tbs;
    r["kind"] = kind;
    r["dep"] = dep;
    r["waits"] = waits;
    r["send_msg"] = send_msg;
    r["recv_msg"] = recv_msg;
    ranks.append(r);
  }
  std::vector<int32_t> conn_msgs(t->num_conns(), 0);
  if (!t->programs.empty()) {
    const ProgramView p(t->programs[0].data());
    for (int32_t k = 0; k < t->num_conns(); ++k) conn_msgs[k] = p.conn_msgs(k);
  }
  nb::dict d;
  d["ranks"] = ranks;
  d["in_order"] = t->in_order;
  d["conn_msgs"] = nb::cast(conn_msgs);
  d["num_slots"] = t->num_slots;
  return d;
}

nb::tuple NextUnit(const ParsedTable& parsed, int32_t rank, int32_t tb, int32_t tiles, int32_t first,
                   const Int32Array& done, const Int32Array& posted, const Int32Array& consumed,
                   int32_t lookahead) {
  const Table* t = parsed.t.get();
  if (rank < 0 || rank >= t->num_ranks) throw nb::value_error(StrCat("no rank ", rank).c_str());
  const ProgramView p(t->programs[rank].data());
  if (tb < 0 || tb >= p.num_tbs()) throw nb::value_error(StrCat("rank ", rank, " has no threadblock ", tb).c_str());
  if (tiles < 1 || lookahead < 1) throw nb::value_error("tiles and lookahead must be >= 1");
  const ProgTb b = p.tb(tb);
  if (first < 0 || first > b.num_ops * tiles) throw nb::value_error(StrCat("first unit ", first, " out of range").c_str());
  const int64_t num_ops = p.num_ops(), conns = p.num_conns();
  if (static_cast<int64_t>(done.shape(0)) != num_ops * tiles) {
    throw nb::value_error(StrCat("done has ", done.shape(0), " flags, want tiles x ops = ", num_ops * tiles).c_str());
  }
  int64_t stride = 0;
  if (conns > 0) {
    stride = static_cast<int64_t>(posted.shape(0)) / conns;
    int64_t most = 0;
    for (int32_t k = 0; k < conns; ++k) most = std::max<int64_t>(most, static_cast<int64_t>(p.conn_msgs(k)) * tiles);
    if (static_cast<int64_t>(posted.shape(0)) != stride * conns || posted.shape(0) != consumed.shape(0) ||
        stride < most) {
      throw nb::value_error(
          StrCat("posted and consumed need connections x stride flags with stride >= ", most).c_str());
    }
  }
  ArrayProbe probe{done.data(), posted.data(), consumed.data(), num_ops, stride, p.num_slots()};
  const int32_t unit = NextReadyUnit(p, b, tiles, &first, probe, lookahead);
  return nb::make_tuple(unit, first);
}

// Replays events through one accumulator's state machine. events: rows of 5 int64, (0, became_busy,
// tx_start, tx_end, 0) for a post (tx_end < 0: untimed) or (1, now_idle, done_ns, 0, bytes) for a
// delivery. Returns, per event, the bandwidth of the window it closed (bytes/s) or -1.
std::vector<double> MeterWindows(const Int64Array& events, int32_t threshold, int64_t min_window_bytes) {
  if (events.shape(0) % 5 != 0) throw nb::value_error("meter events are rows of 5 int64");
  if (threshold < 1) throw nb::value_error(StrCat("meter threshold must be >= 1, got ", threshold).c_str());
  MeterWindow w{};
  const int64_t* e = events.data();
  const size_t n = events.shape(0) / 5;
  std::vector<double> bw(n, -1.0);
  for (size_t i = 0; i < n; ++i, e += 5) {
    if (e[0] == 0) {
      const bool timed = e[3] >= 0;
      MeterOnPost(&w, threshold, e[1] != 0, timed, e[2], timed ? e[3] : e[2]);
    } else if (e[0] == 1) {
      bw[i] = MeterOnDelivered(&w, threshold, min_window_bytes, e[4], e[1] != 0, e[2]);
    } else {
      throw nb::value_error(StrCat("meter event ", i, " is neither a post (0) nor a delivery (1)").c_str());
    }
  }
  return bw;
}

}  // namespace

void RegisterProgramExport(nb::module_& m) {
  m.attr("LOOKAHEAD") = kLookahead;
  m.attr("ALL_DONE") = kAllDone;
  m.attr("NONE_READY") = kNoneReady;
  nb::class_<ParsedTable>(m, "ParsedTable", "A checked table and the per-rank programs built of it.")
      .def("__init__", [](ParsedTable* self, const Int32Array& table) { new (self) ParsedTable(Parse(table)); },
           nb::arg("table"));
  m.def("program_rows", &ProgramRows, nb::arg("table"),
        "The per-rank programs the builder makes of a table: per rank its threadblocks (first op, ops, send and "
        "receive connection) and per op its kind, dependency, waits and messages; whether the table fell back "
        "to program order; messages per connection; slots.");
  m.def("next_ready_unit", &NextUnit, nb::arg("table"), nb::arg("rank"), nb::arg("tb"), nb::arg("tiles"),
        nb::arg("first"), nb::arg("done"), nb::arg("posted"), nb::arg("consumed"), nb::arg("lookahead"),
        "NextReadyUnit of a threadblock over flag arrays; returns (unit or ALL_DONE / NONE_READY, first unfinished).");
  m.def("meter_windows", &MeterWindows, nb::arg("events"), nb::arg("threshold"), nb::arg("min_window_bytes"),
        "Replays post / delivery events through one meter accumulator; per event, the bandwidth of the window it "
        "closed or -1.");
}

}  // namespace jaxccl
