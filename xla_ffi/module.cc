// jaxccl._native: FFI capsules of the CPU executor and the schedule registry.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "core_api.h"
#include "cpu_executor.h"
#include "cpu_handler.h"
#include "registry.h"
#include "rendezvous.h"
#include "table.h"
#include "worker_pool.h"

namespace nb = nanobind;

namespace jaxccl {
namespace {

using TableArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

[[noreturn]] void Raise(const ffi::Error& e) { throw nb::value_error(e.message().c_str()); }

template <typename T>
T Unwrap(ffi::ErrorOr<T> v) {
  if (!v.has_value()) Raise(v.error());
  return std::move(*v);
}

bool CoreAcquire(int64_t slot, TableSnapshot* out, std::string* error) {
  auto s = Registry::Get().Acquire(slot);
  if (!s.has_value()) {
    *error = s.error().message();
    return false;
  }
  *out = std::move(*s);
  return true;
}

double CoreTimeout() { return Registry::Get().timeout_s(); }

// A rendezvous of its own (arrival = rank, result = number of ranks) that tests drive from Python threads.
Rendezvous<int32_t, int32_t>& ProbeRendezvous() {
  static auto* r = new Rendezvous<int32_t, int32_t>();
  return *r;
}

}  // namespace

const CoreApi* GetCoreApi() {
  static const CoreApi api{kCoreApiVersion, sizeof(CoreApi), &CoreAcquire, &CoreTimeout};
  return &api;
}

}  // namespace jaxccl

NB_MODULE(_native, m) {
  using namespace jaxccl;
  m.doc() = "jaxccl's native CPU executor (XLA FFI) and schedule registry.";

  m.def("registrations", [] {
    nb::dict d;
    d["jaxccl_cpu_collective"] = nb::capsule(reinterpret_cast<void*>(JaxcclCpuCollective));
    return d;
  }, "FFI handler capsules by target name (platform cpu).");

  m.def("new_slot", [] { return Registry::Get().NewSlot(); }, "Creates an empty schedule slot; returns its id.");
  m.def(
      "install",
      [](int64_t slot, TableArray table) {
        return Unwrap(Registry::Get().Install(slot, table.data(), table.shape(0)));
      },
      nb::arg("slot"), nb::arg("table"),
      "Validates a compiled int32 table and makes it the slot's current version; returns the version.");
  m.def(
      "validate",
      [](TableArray table) {
        auto t = ParseTable(table.data(), table.shape(0));
        if (!t.has_value()) Raise(t.error());
      },
      nb::arg("table"), "Checks a compiled table word by word; raises ValueError naming the first bad word.");
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
  m.def("last_launch_version", [](int64_t slot) { return Unwrap(Registry::Get().LastLaunchVersion(slot)); },
        nb::arg("slot"), "Table version the slot's most recent launch ran (0 if none).");
  m.def(
      "set_timeout",
      [](double seconds) {
        if (ffi::Error e = Registry::Get().SetTimeout(seconds); e.failure()) Raise(e);
      },
      nb::arg("seconds"), "Deadline of every rendezvous and executor wait.");
  m.def("get_timeout", [] { return Registry::Get().timeout_s(); });
  m.def("stats", [] {
    nb::dict d;
    d["pending_rendezvous"] = CpuPendingRendezvous();
    d["occurrence_entries"] = CpuOccurrenceEntries();
    d["worker_threads"] = WorkerPool::Get().NumThreads();
    d["idle_workers"] = WorkerPool::Get().NumIdle();
    d["slots"] = Registry::Get().NumSlots();
    d["context_pools"] = NumContextPools();
    return d;
  }, "Executor bookkeeping (for tests): rendezvous entries, worker threads, slots.");
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
  m.def("_test_rendezvous_stats", [] {
    nb::dict d;
    d["pending"] = ProbeRendezvous().NumPending();
    d["occurrence_entries"] = ProbeRendezvous().NumOccurrenceEntries();
    return d;
  });
  m.def("_core_api", [] {
    return nb::capsule(static_cast<const void*>(GetCoreApi()), kCoreApiCapsuleName);
  }, "Capsule of the versioned registry interface the CUDA module attaches to.");
  m.attr("TABLE_VERSION") = kTableVersion;
  m.attr("TABLE_MAGIC") = kTableMagic;
  m.attr("CORE_API_VERSION") = kCoreApiVersion;
}
