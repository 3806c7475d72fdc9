// jaxccl._native: FFI capsules of the CPU executor and the schedule registry.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "bindings/program_export.h"
#include "core/stable_source.h"
#include "host/core_api.h"
#include "host/dtype.h"
#include "cpu/executor.h"
#include "cpu/handler.h"
#include "cpu/output_memory.h"
#include "cpu/link_emulation.h"
#include "host/registry.h"
#include "host/rendezvous.h"
#include "host/table.h"
#include "transport/handler.h"
#include "transport/handshake_harness.h"
#include "transport/mapped_launch.h"
#include "transport/proxy.h"

namespace nb = nanobind;

namespace jaxccl {
namespace {

using TableArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using IntArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DoubleArray = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

[[noreturn]] void Raise(const ffi::Error& e) { throw nb::value_error(e.message().c_str()); }

template <typename T>
T Unwrap(ffi::ErrorOr<T> v) {
  if (!v.has_value()) Raise(v.error());
  return std::move(*v);
}

bool CoreNoteIssued(int64_t slot, int32_t rank, int64_t* seq, std::string* error) {
  auto s = Registry::Get().NoteIssued(slot, rank);
  if (!s.has_value()) {
    *error = s.error().message();
    return false;
  }
  *seq = *s;
  return true;
}

bool CoreAcquire(int64_t slot, int64_t seq, TableSnapshot* out, std::string* error) {
  auto s = Registry::Get().Acquire(slot, seq);
  if (!s.has_value()) {
    *error = s.error().message();
    return false;
  }
  *out = std::move(*s);
  return true;
}

double CoreTimeout() { return Registry::Get().timeout_s(); }

bool CoreProcessGroup(int32_t index, std::shared_ptr<const ProcessGroup>* out, std::string* error) {
  auto g = ProcessGroupOf(index);
  if (!g.has_value()) {
    *error = g.error().message();
    return false;
  }
  *out = std::move(*g);
  return true;
}

bool CoreStartMappedProxy(const MappedLaunchSpec& spec, std::shared_ptr<const ProcessGroup> group,
                          std::unique_ptr<ProxyHandle>* out, std::string* error) {
  auto proxy = StartMappedProxy(spec, std::move(group));
  if (!proxy.has_value()) {
    *error = proxy.error().message();
    return false;
  }
  *out = std::move(*proxy);
  return true;
}

template <typename T, typename A>
std::vector<T> ToVector(const A& a) {
  return std::vector<T>(a.data(), a.data() + a.shape(0));
}

NetworkConfig MakeNetworkConfig(int32_t num_ranks, IntArray host_of_rank, DoubleArray capacity, DoubleArray latency_ns,
                                IntArray route_offsets, IntArray route_links, bool pace, bool measure,
                                bool link_timestamps, bool trace, int32_t intra_threshold, int32_t inter_threshold,
                                int64_t min_window_bytes, int32_t slots_per_tb) {
  NetworkConfig c;
  c.num_ranks = num_ranks;
  c.host_of_rank = ToVector<int32_t>(host_of_rank);
  c.capacity = ToVector<double>(capacity);
  c.latency_ns = ToVector<double>(latency_ns);
  c.route_offsets = ToVector<int32_t>(route_offsets);
  c.route_links = ToVector<int32_t>(route_links);
  c.pace = pace;
  c.measure = measure;
  c.link_timestamps = link_timestamps;
  c.trace = trace;
  c.intra_threshold = intra_threshold;
  c.inter_threshold = inter_threshold;
  c.min_window_bytes = min_window_bytes;
  c.slots_per_tb = slots_per_tb;
  return c;
}

std::shared_ptr<Network> NetworkOrRaise(int64_t id) { return Unwrap(FindNetwork(id)); }

using AnyArray = nb::ndarray<nb::device::cpu, nb::c_contig>;

// The FFI element type of a numpy array (the types the harness's tests use).
ffi::DataType DataTypeOf(const AnyArray& a) {
  const nb::dlpack::dtype d = a.dtype();
  using D = ffi::DataType;
  if (d.lanes != 1) return D::INVALID;
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Float:
      return d.bits == 16 ? D::F16 : d.bits == 32 ? D::F32 : d.bits == 64 ? D::F64 : D::INVALID;
    case nb::dlpack::dtype_code::Bfloat:
      return d.bits == 16 ? D::BF16 : D::INVALID;
    case nb::dlpack::dtype_code::Int:
      return d.bits == 8 ? D::S8 : d.bits == 16 ? D::S16 : d.bits == 32 ? D::S32 : d.bits == 64 ? D::S64 : D::INVALID;
    case nb::dlpack::dtype_code::UInt:
      return d.bits == 8 ? D::U8 : d.bits == 16 ? D::U16 : d.bits == 32 ? D::U32 : d.bits == 64 ? D::U64 : D::INVALID;
    default:
      return D::INVALID;
  }
}

// A rendezvous of its own (arrival = rank, result = number of ranks) that tests drive from Python threads.
Rendezvous<int32_t, int32_t>& ProbeRendezvous() {
  static auto* r = new Rendezvous<int32_t, int32_t>();
  return *r;
}

}  // namespace

const CoreApi* GetCoreApi() {
  static const CoreApi api{kCoreApiVersion, sizeof(CoreApi), &CoreNoteIssued, &CoreAcquire,
                           &CoreTimeout,     &CoreProcessGroup, &CoreStartMappedProxy};
  return &api;
}

}  // namespace jaxccl

NB_MODULE(_native, m) {
  using namespace jaxccl;
  m.doc() = "jaxccl's native CPU executor (XLA FFI) and schedule registry.";

  m.def("registrations", [] {
    nb::dict d;
    d["jaxccl_cpu_collective"] = nb::capsule(reinterpret_cast<void*>(JaxcclCpuCollective));
    d["jaxccl_cpu_mp_collective"] = nb::capsule(reinterpret_cast<void*>(JaxcclCpuMpCollective));
    return d;
  }, "FFI handler capsules by target name (platform cpu).");

  m.def(
      "set_process_group",
      [](nb::capsule transport, int32_t process_id, std::vector<std::vector<int32_t>> process_of_rank) {
        auto* h = static_cast<const TransportHandle*>(transport.data());
        if (h == nullptr || h->version != kTransportVersion || h->transport == nullptr) {
          throw nb::value_error("jaxccl: not a transport capsule of this version (rebuild jaxccl)");
        }
        int32_t first = 0, layout = 0;
        if (ffi::Error e = AttachProcessGroups(h->transport, process_id, process_of_rank, &first, &layout);
            e.failure()) {
          Raise(e);
        }
        return nb::make_tuple(first, layout);
      },
      nb::arg("transport"), nb::arg("process_id"), nb::arg("process_of_rank"),
      "Attaches the transport (a capsule of jaxccl._transport) and the process of every rank of every group of "
      "one layout (process_of_rank[group][rank]) after the layouts already attached; returns (the index of its "
      "group 0, its layout number).");
  m.def("clear_process_group", [] { DetachProcessGroups(); }, "Detaches the process groups.");
  m.def("process_groups_attached", [] { return ProcessGroupOf(0).has_value(); },
        "Whether set_process_group attached process groups (native collectives may then span processes).");
  m.def(
      "transport_drain",
      [] {
        int64_t dropped = 0;
        std::vector<TransportRecord> records = DrainTransportRecords(&dropped);
        std::vector<int64_t> flat;
        flat.reserve(records.size() * 6);
        for (const TransportRecord& r : records) {
          flat.insert(flat.end(), {r.src_rank, r.dst_rank, r.bytes, r.post_ns, r.done_ns, r.layout});
        }
        return nb::make_tuple(flat, dropped);
      },
      "The sends to other processes since the last drain: a flat list of (src rank, dst rank, bytes, post ns, "
      "done ns, layout) and the number dropped.");

  m.def("new_slot", [] { return Registry::Get().NewSlot(); }, "Creates an empty schedule slot; returns its id.");
  m.def(
      "install",
      [](int64_t slot, TableArray table) {
        return Unwrap(Registry::Get().Install(slot, table.data(), table.shape(0)));
      },
      nb::arg("slot"), nb::arg("table"),
      "Validates a compiled int32 table and makes it the slot's current version; returns the version.");
  m.def(
      "stage",
      [](int64_t slot, TableArray table, int64_t transition_seq) {
        return Unwrap(Registry::Get().Stage(slot, table.data(), table.shape(0), transition_seq));
      },
      nb::arg("slot"), nb::arg("table"), nb::arg("transition_seq") = -1,
      "Validates a compiled table and stages it: active from the first launch after the transition point "
      "(the largest sequence number issued so far, or transition_seq when >= 0); returns its version.");
  m.def(
      "swap_state",
      [](int64_t slot) {
        const auto st = Unwrap(Registry::Get().Swap(slot));
        nb::dict d;
        d["current_version"] = st.current_version;
        d["staged_version"] = st.staged_version;
        d["transition_seq"] = st.transition_seq;
        d["issued"] = st.issued;
        d["last_swap_seq"] = st.last_swap_seq;
        d["last_swap_ns"] = st.last_swap_ns;
        d["current_checksum"] = st.current_checksum;
        d["staged_checksum"] = st.staged_checksum;
        return d;
      },
      nb::arg("slot"), "Hot-swap bookkeeping of a slot: versions, transition point, sequence numbers.");
  m.def(
      "validate",
      [](TableArray table) {
        auto t = ParseTable(table.data(), table.shape(0));
        if (!t.has_value()) Raise(t.error());
      },
      nb::arg("table"), "Checks a compiled table word by word; raises ValueError naming the first bad word.");
  m.def(
      "_stable_sources",
      [](TableArray table) {
        const auto t = Unwrap(ParseTable(table.data(), table.shape(0)));
        nb::list out;
        for (int32_t r = 0; r < t->num_ranks; ++r) {
          const ProgramView p(t->programs[r].data());
          ProgramAncestry ancestry(p);
          const int32_t first = t->RankFirstOp(r);
          for (int32_t o = 0; o < p.num_ops(); ++o) {
            if (!SendsARange(p.op(o))) continue;
            out.append(nb::make_tuple(first + o, SourceFinalAtDependency(ancestry, o),
                                      SourceStableInFlight(ancestry, o)));
          }
        }
        return out;
      },
      nb::arg("table"),
      "Tests: (op, final at its dependency, stable in flight) for every op of a table that sends a range of its "
      "buffers (core/stable_source.h), ops numbered in table order.");
  m.def(
      "network_configure",
      [](int64_t id, int32_t n, IntArray hosts, DoubleArray cap, DoubleArray lat, IntArray offs, IntArray links,
         bool pace, bool measure, bool stamps, bool trace, int32_t intra, int32_t inter, int64_t min_bytes,
         int32_t slots) {
        NetworkConfig c = MakeNetworkConfig(n, hosts, cap, lat, offs, links, pace, measure, stamps, trace, intra,
                                            inter, min_bytes, slots);
        if (id == 0) return Unwrap(CreateNetwork(std::move(c)));
        if (ffi::Error e = UpdateNetwork(id, std::move(c)); e.failure()) Raise(e);
        return id;
      },
      nb::arg("network"), nb::arg("num_ranks"), nb::arg("host_of_rank"), nb::arg("capacity"), nb::arg("latency_ns"),
      nb::arg("route_offsets"), nb::arg("route_links"), nb::arg("pace"), nb::arg("measure"),
      nb::arg("link_timestamps"), nb::arg("trace"), nb::arg("intra_threshold"), nb::arg("inter_threshold"),
      nb::arg("min_window_bytes"), nb::arg("slots_per_tb"),
      "Creates an emulated network (network=0; capacities in bytes per real ns, CSR routes per ordered GPU pair) or "
      "replaces an existing one's links, routes and flags live (running collectives see it at their next message); "
      "returns its id.");
  m.def(
      "network_remove",
      [](int64_t id) {
        if (ffi::Error e = RemoveNetwork(id); e.failure()) Raise(e);
      },
      nb::arg("network"));
  m.def(
      "network_attach",
      [](int64_t slot, int64_t id) {
        if (ffi::Error e = AttachNetwork(slot, id); e.failure()) Raise(e);
      },
      nb::arg("slot"), nb::arg("network"), "Runs schedule slot `slot` on network `network` (0 detaches).");
  m.def(
      "measure_drain",
      [](int64_t id) {
        auto net = NetworkOrRaise(id);
        std::vector<MeasurementRecord> recs;
        {
          nb::gil_scoped_release release;
          recs = net->Drain();
        }
        return nb::bytes(reinterpret_cast<const char*>(recs.data()), recs.size() * sizeof(MeasurementRecord));
      },
      nb::arg("network"), "Valid Measurements Buffer records (32 bytes each, measurement_format.h), slots freed.");
  m.def(
      "measure_stats",
      [](int64_t id) {
        const MeasurementStats st = NetworkOrRaise(id)->Stats();
        nb::dict d;
        d["windows"] = st.windows;
        d["records"] = st.records;
        d["dropped"] = st.dropped;
        d["regions"] = st.regions;
        d["slots"] = st.slots;
        d["used"] = st.used;
        d["accumulator_bytes"] = st.accumulator_bytes;
        d["cache_entry_bytes"] = static_cast<int64_t>(sizeof(MeasurementCacheEntry));
        d["cache_entries_per_tb"] = static_cast<int64_t>(MeasurementCache::kMaxEntries);
        d["buffer_bytes"] = st.buffer_bytes;
        return d;
      },
      nb::arg("network"), "Measurement counters and memory footprint of a network.");
  m.def(
      "trace_take",
      [](int64_t id) {
        auto net = NetworkOrRaise(id);
        int64_t dropped = 0;
        std::vector<TraceRecord> recs = net->TakeTrace(&dropped);
        return nb::make_tuple(
            nb::bytes(reinterpret_cast<const char*>(recs.data()), recs.size() * sizeof(TraceRecord)), dropped);
      },
      nb::arg("network"), "(records, dropped): every message delivered since the last call (56-byte TraceRecord).");
  m.def(
      "_bench_measurement_hooks",
      [](int64_t iterations) {
        // The per-message work measurement adds to the executor (MCCL Fig. 9a's cost, isolated): one
        // OnPost + one OnDelivered on a busy accumulator, a window per 8 messages, and one Flush per 64.
        NetworkConfig c;
        c.num_ranks = 2;
        c.host_of_rank = {0, 1};
        c.capacity = {1.0, 1.0};
        c.latency_ns = {0.0, 0.0};
        c.route_offsets = {0, 0, 1, 2, 2};
        c.route_links = {0, 1};
        c.pace = false;
        c.min_window_bytes = 0;
        auto net = Unwrap(Network::Create(c));
        MeasurementCache cache{};
        const auto t0 = Clock::now();
        for (int64_t k = 0; k < iterations; ++k) {
          const int64_t now = NowNs();
          net->OnPost(0, 1, now, k % 8 == 0, nullptr);
          net->OnDelivered(0, 1, 1 << 17, NowNs(), k % 8 == 7, &cache);
          if (k % 64 == 63) {
            net->Flush(1, 1, 0, cache);
            cache.Clear();
            (void)net->Drain();
          }
        }
        const double ns = std::chrono::duration<double, std::nano>(Clock::now() - t0).count();
        return ns / static_cast<double>(iterations);
      },
      nb::arg("iterations") = 1000000, "Benchmark hook: nanoseconds of measurement work per message.");
  m.def(
      "measure_reset", [](int64_t id) { NetworkOrRaise(id)->ResetMeasurements(); }, nb::arg("network"));
  m.attr("MEASUREMENT_VERSION") = kMeasurementVersion;
  m.def("current_version", [](int64_t slot) { return Unwrap(Registry::Get().CurrentVersion(slot)); }, nb::arg("slot"));
  m.def(
      "remove",
      [](int64_t slot) {
        if (ffi::Error e = Registry::Get().Remove(slot); e.failure()) Raise(e);
        DropContextPool(slot);
      },
      nb::arg("slot"));
  m.def("launch_count", [](int64_t slot) { return Unwrap(Registry::Get().LaunchCount(slot)); }, nb::arg("slot"),
        "Launches that picked a table from this slot.");
  m.def("last_launch_seconds", [](int64_t slot) { return Unwrap(Registry::Get().LastLaunchNs(slot)) * 1e-9; },
        nb::arg("slot"), "Executor time of the slot's most recently finished launch, in seconds (0 if none).");
  m.def("last_launch_version", [](int64_t slot) { return Unwrap(Registry::Get().LastLaunchVersion(slot)); },
        nb::arg("slot"), "Table version the slot's most recent launch ran (0 if none).");
  m.def(
      "set_timeout",
      [](double seconds) {
        if (ffi::Error e = Registry::Get().SetTimeout(seconds); e.failure()) Raise(e);
      },
      nb::arg("seconds"), "Deadline of every rendezvous and executor wait.");
  m.def("get_timeout", [] { return Registry::Get().timeout_s(); });
  m.def("set_program_order", &SetProgramOrder, nb::arg("on"),
        "Comparisons only: the CPU executor runs every threadblock in program order, untiled (default off: "
        "dataflow order, tiles under link emulation).");
  m.def("program_order", &ProgramOrder);
  m.def("set_identity_checks", &SetIdentityChecks, nb::arg("on"),
        "Comparisons only: receivers check that every message is of their own table and launch (default on).");
  m.def("identity_checks", &IdentityChecks);
  m.def("_inject_stale_message", &InjectStaleMessage, nb::arg("slot"), nb::arg("across_processes") = false,
        "Tests only: the next message posted on `slot` (to another process: across_processes) carries the "
        "identity of the slot's previous launch.");
  m.def(
      "set_tile_cap",
      [](int32_t max_tiles) {
        if (!SetTileCap(max_tiles)) {
          throw nb::value_error(StrCat("jaxccl: the tile cap must be in 1..", kMaxTiles, ", got ", max_tiles).c_str());
        }
      },
      nb::arg("max_tiles"),
      "Comparisons only: the CPU executor runs at most this many tiles per launch (default MAX_TILES).");
  m.def("tile_cap", &TileCap);
  m.def("set_huge_pages", &SetHugePages, nb::arg("on"),
        "Output buffers of HUGE_PAGES_MIN_BYTES or more in transparent huge pages (default on; off for comparisons).");
  m.def("huge_pages", &HugePages);
  m.def("huge_pages_usable", &HugePagesUsable);
  m.attr("HUGE_PAGES_MIN_BYTES") = kHugePagesMinBytes;
  m.def("set_prefault", &SetPrefault, nb::arg("on"),
        "Fresh output buffers of PREFAULT_MIN_BYTES or more faulted in by one call (default on; off for comparisons).");
  m.def("prefault", &Prefault);
  m.attr("PREFAULT_MIN_BYTES") = kPrefaultMinBytes;
  m.def("_resident_after_prepare", &ResidentAfterPrepare, nb::arg("bytes"),
        "Tests: the fraction of a fresh mapping of `bytes` that is resident after PrepareOutput.");
  m.def("stats", [] {
    nb::dict d;
    d["pending_rendezvous"] = CpuPendingRendezvous();
    d["occurrence_entries"] = CpuOccurrenceEntries();
    d["slots"] = Registry::Get().NumSlots();
    d["context_pools"] = NumContextPools();
    d["in_place_receives"] = InPlaceReceives();
    d["in_place_disconnects"] = InPlaceDisconnects();
    return d;
  }, "Executor bookkeeping (for tests): rendezvous entries, slots, messages from other processes received in "
     "place and connections closed after a failed launch left one in flight.");
  m.def(
      "_test_arrive",
      [](int64_t run_id, int64_t site, int64_t group, int32_t rank, int32_t axis_size, double timeout_s) {
        auto build = [](const std::vector<int32_t>& all) -> ffi::ErrorOr<std::shared_ptr<int32_t>> {
          return std::make_shared<int32_t>(static_cast<int32_t>(all.size()));
        };
        auto result = [&] {
          nb::gil_scoped_release release;
          return ProbeRendezvous().Arrive(run_id, site, group, rank, axis_size, rank, timeout_s, build);
        }();
        return result.has_value() ? std::string("ok") : result.error().message();
      },
      "Test hook: one rank's arrival at a probe rendezvous (same code as the executors'); 'ok' or the error.");
  m.def(
      "_test_abandon",
      [](int64_t run_id, int64_t site, int64_t group, int32_t rank, int32_t axis_size, double timeout_s,
         const std::string& why) { ProbeRendezvous().Abandon(run_id, site, group, rank, axis_size, timeout_s, why); },
      "Test hook: one rank of a probe rendezvous says it cannot take part (Rendezvous::Abandon).");
  m.def("_test_rendezvous_stats", [] {
    nb::dict d;
    d["pending"] = ProbeRendezvous().NumPending();
    d["occurrence_entries"] = ProbeRendezvous().NumOccurrenceEntries();
    return d;
  });
  m.def(
      "_mapped_launch_run",
      [](int64_t slot, int32_t group, std::vector<int32_t> ranks, std::vector<AnyArray> inputs,
         std::vector<AnyArray> outputs, int64_t reduce_op, const std::string& wire, int32_t tiles) {
        if (ranks.size() != inputs.size() || ranks.size() != outputs.size()) {
          throw nb::value_error("jaxccl harness: one input and one output per rank");
        }
        if (wire != "host" && wire != "cuda") throw nb::value_error("jaxccl harness: wire must be 'host' or 'cuda'");
        HarnessOptions options;
        options.slot = slot;
        options.group = group;
        options.reduce_op = Unwrap(ReduceOpOf(reduce_op));
        options.wire = wire == "cuda" ? MemoryKind::kCuda : MemoryKind::kHost;
        options.tiles = tiles;
        std::vector<HarnessCall> calls;
        for (size_t k = 0; k < ranks.size(); ++k) {
          if (DataTypeOf(inputs[k]) != DataTypeOf(outputs[k])) {
            throw nb::value_error("jaxccl harness: a rank's input and output have different dtypes");
          }
          calls.push_back(HarnessCall{ranks[k], inputs[k].data(), outputs[k].data(),
                                      static_cast<int64_t>(inputs[k].size()), static_cast<int64_t>(outputs[k].size()),
                                      DataTypeOf(inputs[k])});
        }
        HarnessResult r;
        {
          nb::gil_scoped_release release;
          r = RunMappedLaunch(options, calls);
        }
        nb::list words;
        for (const HarnessRankError& e : r.ranks) words.append(nb::make_tuple(e.code, e.tb, e.op));
        nb::dict d;
        d["error"] = r.error.failure() ? r.error.message() : std::string();
        d["code"] = static_cast<int32_t>(r.error.errc().value_or(ffi::ErrorCode::kOk));
        d["rank_errors"] = words;
        return d;
      },
      nb::arg("slot"), nb::arg("group"), nb::arg("ranks"), nb::arg("inputs"), nb::arg("outputs"),
      nb::arg("reduce_op") = 0, nb::arg("wire") = "host", nb::arg("tiles") = 0,
      "Tests: one launch of the slot's table for this process's ranks of an attached process group, each local "
      "rank's threadblocks on host threads that run the CUDA interpreter's protocol over a mapped launch "
      "(xla_ffi/transport/handshake_harness.h); wire 'cuda' sends every trailer apart, as from device memory. "
      "Returns {'error': message or '', 'code': ffi error code, 'rank_errors': [(code, threadblock, op)] per rank}.");
  m.attr("PROTOCOL_PEER_FAILED") = static_cast<int32_t>(kPeerFailed);
  m.def("_core_api", [] {
    return nb::capsule(static_cast<const void*>(GetCoreApi()), kCoreApiCapsuleName);
  }, "Capsule of the versioned registry interface the CUDA module attaches to.");
  m.attr("TABLE_VERSION") = kTableVersion;
  m.attr("TABLE_MAGIC") = kTableMagic;
  m.attr("CORE_API_VERSION") = kCoreApiVersion;
  m.attr("MAX_TILES") = kMaxTiles;  // the tiling rule (core/protocol.h), which the simulator models
  m.attr("MIN_TILE_BYTES") = kMinTileBytes;
  RegisterProgramExport(m);  // the dataflow order and the meter, for the Python models of them
}
