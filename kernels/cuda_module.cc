// jaxccl._native_cuda: the CUDA FFI capsule; attaches to the registry of jaxccl._native.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "core/measurement_format.h"
#include "handler.h"
#include "host/core_api.h"
#include "measure.h"
#include "test_harness.h"

namespace nb = nanobind;

namespace {

// The measurement settings as measure_configure takes them.
void PutSettings(nb::dict& d, const jaxccl::cuda::MeasureSettings& s) {
  d["enabled"] = s.enabled;
  d["host_of_rank"] = s.host_of_rank;
  d["intra_threshold"] = s.intra_threshold;
  d["inter_threshold"] = s.inter_threshold;
  d["slots_per_tb"] = s.slots_per_tb;
  d["min_window_bytes"] = s.min_window_bytes;
}

}  // namespace

NB_MODULE(_native_cuda, m) {
  using namespace jaxccl;
  m.doc() = "jaxccl's CUDA executor (XLA FFI); tables come from jaxccl._native's registry.";
  m.def("registrations", [] {
    nb::dict d;
    d["jaxccl_cuda_collective"] = nb::capsule(reinterpret_cast<void*>(cuda::JaxcclCudaCollective));
    d["jaxccl_cuda_mp_collective"] = nb::capsule(reinterpret_cast<void*>(cuda::JaxcclCudaMpCollective));
    return d;
  }, "FFI handler capsules by target name (platform CUDA).");
  m.def(
      "attach",
      [](nb::capsule core) {
        if (core.name() == nullptr || std::string(core.name()) != kCoreApiCapsuleName) {
          throw nb::value_error("attach() expects jaxccl._native._core_api()");
        }
        std::string error;
        if (!cuda::AttachCore(static_cast<const CoreApi*>(core.data()), &error)) throw nb::value_error(error.c_str());
      },
      nb::arg("core"), "Connects the CUDA executor to jaxccl._native's schedule registry.");
  m.def("attached", &cuda::CoreAttached);
  m.def("device_count", &cuda::DeviceCount, "Visible CUDA devices (0 without a driver or GPU).");

  m.def(
      "measure_configure",
      [](bool enabled, std::vector<int32_t> host_of_rank, int32_t intra_threshold, int32_t inter_threshold,
         int32_t slots_per_tb, int64_t min_window_bytes) {
        cuda::MeasureSettings s;
        s.enabled = enabled;
        s.host_of_rank = std::move(host_of_rank);
        s.intra_threshold = intra_threshold;
        s.inter_threshold = inter_threshold;
        s.slots_per_tb = slots_per_tb;
        s.min_window_bytes = min_window_bytes;
        const std::string error = cuda::MeasureConfigure(s);
        if (!error.empty()) throw nb::value_error(error.c_str());
      },
      nb::arg("enabled"), nb::arg("host_of_rank") = std::vector<int32_t>{}, nb::arg("intra_threshold") = 1,
      nb::arg("inter_threshold") = 1, nb::arg("slots_per_tb") = 64, nb::arg("min_window_bytes") = 32 << 10,
      "Turns passive measurement on or off for the launches that start from now on. host_of_rank: host id of "
      "each rank of the axis (empty: one host); a window opens when at least `*_threshold` connections of an "
      "accumulator are active; each threadblock owns `slots_per_tb` Measurements Buffer slots; windows that "
      "carried fewer than `min_window_bytes` are dropped.");
  m.def("measure_settings", [] {
    nb::dict d;
    PutSettings(d, cuda::MeasureSettingsNow());
    return d;
  }, "The settings measure_configure installed.");
  m.def(
      "measure_drain",
      [] {
        std::vector<MeasurementRecord> recs;
        int64_t dropped = 0;
        {
          nb::gil_scoped_release release;
          cuda::MeasureDrain(&recs, &dropped);
        }
        nb::bytes raw(reinterpret_cast<const char*>(recs.data()), recs.size() * sizeof(MeasurementRecord));
        return nb::make_tuple(raw, dropped);
      },
      "(records, dropped): every valid Measurements Buffer record, 32 bytes each (measurement_format.h), their "
      "slots freed; and the records dropped since the previous drain.");
  m.def("measure_stats", [] {
    const cuda::MeasureStatsResult st = cuda::MeasureStats();
    nb::dict d;
    PutSettings(d, st.settings);
    d["windows"] = st.windows;
    d["records"] = st.records;
    d["dropped"] = st.dropped;
    d["drained"] = st.drained;
    d["pending"] = st.pending;
    d["buffers"] = st.buffers;
    d["regions"] = st.regions;
    d["slots"] = st.slots;
    d["used"] = st.used;
    d["accumulator_bytes"] = st.accumulator_bytes;
    d["cache_entry_bytes"] = st.cache_entry_bytes;
    d["cache_entries_per_tb"] = st.cache_entries_per_tb;
    d["cache_bytes"] = st.cache_bytes;
    d["buffer_bytes"] = st.buffer_bytes;
    d["counter_bytes"] = st.counter_bytes;
    return d;
  }, "The settings in force, the measurement counters since the last reset and the memory footprint (MCCL Table "
     "2) in bytes.");
  m.def("measure_reset", [] {
    nb::gil_scoped_release release;
    cuda::MeasureReset();
  }, "Discards undrained records and restarts the counters (call it between collectives).");
  m.def(
      "test_run",
      [](int64_t slot, nb::bytes inputs, int32_t num_ranks, int32_t esize, int32_t sum, int32_t tiles, bool measure,
         std::vector<int32_t> host_of_rank, int32_t reduce_op) {
        if (num_ranks < 1 || esize < 1 || inputs.size() % (static_cast<size_t>(num_ranks) * esize) != 0) {
          throw nb::value_error("test_run: inputs must hold num_ranks equal buffers of whole elements");
        }
        if (sum < -1 || sum > static_cast<int32_t>(ElemType::kPred)) {
          throw nb::value_error("test_run: sum must be -1 (none) or an ElemType code of core/reduce.h (0 f32, 1 bf16, ...)");
        }
        if (reduce_op < 0 || reduce_op >= kNumReduceOps) throw nb::value_error("test_run: reduce_op must be 0, 1 or 2");
        const int64_t in_elems = static_cast<int64_t>(inputs.size() / num_ranks / esize);
        cuda::TestRunResult r;
        {
          nb::gil_scoped_release release;
          r = cuda::TestRunRanks(slot, static_cast<const char*>(inputs.data()), num_ranks, in_elems, esize,
                                 Reduction{static_cast<ElemType>(sum), static_cast<ReduceOp>(reduce_op)}, tiles, measure,
                                 host_of_rank);
        }
        if (!r.error.empty()) throw std::runtime_error(r.error);
        nb::dict d;
        d["outputs"] = nb::bytes(r.outputs.data(), r.outputs.size());
        d["records"] = nb::bytes(reinterpret_cast<const char*>(r.records.data()),
                                 r.records.size() * sizeof(MeasurementRecord));
        d["version"] = r.version;
        d["seq"] = r.seq;
        d["tiles"] = r.tiles;
        d["kernel_ms"] = r.kernel_ms;
        return d;
      },
      nb::arg("slot"), nb::arg("inputs"), nb::arg("num_ranks"), nb::arg("esize"), nb::arg("sum") = -1,
      nb::arg("tiles") = 0, nb::arg("measure") = false, nb::arg("host_of_rank") = std::vector<int32_t>{},
      nb::arg("reduce_op") = 0,
      "Test entry: one call of the slot's table with every rank on the current GPU (one kernel, grid y = rank). "
      "inputs: num_ranks equal raw buffers; returns outputs (raw, rank-major), the version and sequence number "
      "the launch ran, its tiles, the kernel time and the Measurements Buffer records.");
  m.attr("MEASUREMENT_VERSION") = kMeasurementVersion;
}
