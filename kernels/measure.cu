// Passive measurement of the CUDA executor (MCCL Sec. 5.1-5.2, protocol in interpreter.cuh): configured
// process-wide (MeasureConfigure); each (slot, device) workspace (workspace.h) owns its rank's
// accumulators and per-threadblock cursors/counters in device memory and a Measurements Buffer in
// pinned host-mapped memory, which MeasureDrain reads while collectives run. Collectives with a
// reduction are never measured.
#include "measure.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "host/common.h"
#include "interpreter.cuh"
#include "workspace.h"

namespace jaxccl {
namespace cuda {
namespace {

// Process-wide measurement settings (g_measure_mu) and the host side of the Measurements Buffers (WorkspaceMutex).
std::mutex g_measure_mu;
MeasureSettings g_settings;

struct MeasureTotals {
  std::vector<MeasurementRecord> pending;  // valid records of buffers that were reallocated, not drained yet
  MeasureCounters retired{};               // counters of freed buffers
  MeasureCounters at_reset{};              // totals when MeasureReset ran
  unsigned long long dropped_at_drain = 0; // dropped total at the last drain (or reset)
  unsigned long long drained = 0;          // records returned by drains since the reset
};
MeasureTotals g_totals;

void AddCounters(MeasureCounters* into, const MeasureCounters& c) {
  into->records += c.records;
  into->dropped += c.dropped;
  into->windows += c.windows;
}

// Cumulative counters of every buffer ever allocated (WorkspaceMutex held). The device writes them; 8-byte loads.
MeasureCounters TotalsLocked() {
  MeasureCounters total = g_totals.retired;
  for (auto& [key, ws] : WorkspacesLocked()) {
    const MeasureBuffers& b = ws->measure;
    if (b.host == nullptr) continue;
    for (int32_t tb = 0; tb < b.num_tbs; ++tb) {
      const MeasureCounters* c = b.counters() + tb;
      MeasureCounters v{};
      v.records = __atomic_load_n(&c->records, __ATOMIC_RELAXED);
      v.dropped = __atomic_load_n(&c->dropped, __ATOMIC_RELAXED);
      v.windows = __atomic_load_n(&c->windows, __ATOMIC_RELAXED);
      AddCounters(&total, v);
    }
  }
  return total;
}

// Moves every valid record of `b` into `out` and frees its slots (WorkspaceMutex held). The device fills a slot only
// while its flag is 0 and sets the flag last (after __threadfence_system), so a flag read as 1 with acquire
// order covers the fields.
void HarvestLocked(const MeasureBuffers& b, std::vector<MeasurementRecord>* out) {
  if (b.host == nullptr) return;
  MeasurementRecord* recs = b.records();
  for (size_t k = 0; k < b.num_slots(); ++k) {
    if (__atomic_load_n(&recs[k].flag, __ATOMIC_ACQUIRE) != 1) continue;
    MeasurementRecord r = recs[k];
    r.flag = 1;
    out->push_back(r);
    __atomic_store_n(&recs[k].flag, 0, __ATOMIC_RELEASE);
  }
}

// Frees `b` (its kernels have finished: every call synchronizes its stream before returning), keeping its
// undrained records and its counters. WorkspaceMutex held, b's device current.
cudaError_t RetireLocked(MeasureBuffers* b) {
  HarvestLocked(*b, &g_totals.pending);
  if (b->host != nullptr) {
    for (int32_t tb = 0; tb < b->num_tbs; ++tb) AddCounters(&g_totals.retired, b->counters()[tb]);
  }
  cudaError_t e = cudaSuccess;
  if (b->dev != nullptr) e = cudaFree(b->dev);
  if (b->host != nullptr) {
    const cudaError_t h = cudaFreeHost(b->host);
    if (e == cudaSuccess) e = h;
  }
  *b = MeasureBuffers{};
  return e;
}

}  // namespace

cudaError_t EnsureMeasureBuffers(Workspace* ws, int32_t num_ranks, int32_t num_tbs, int32_t slots_per_tb,
                                 cudaStream_t stream, const char** what) {
  MeasureBuffers& b = ws->measure;
  if (b.dev != nullptr && num_ranks <= b.num_ranks && num_tbs <= b.num_tbs && slots_per_tb == b.slots_per_tb) {
    return cudaSuccess;
  }
  MeasureBuffers grown;
  grown.num_ranks = std::max(num_ranks, b.num_ranks);
  grown.num_tbs = std::max({num_tbs, b.num_tbs, 1});  // never a zero-byte host allocation
  grown.slots_per_tb = slots_per_tb;
  *what = "freeing the old measurement buffers";
  cudaError_t e = RetireLocked(&b);
  if (e != cudaSuccess) return e;
  *what = "cudaMalloc(measurement accumulators)";
  if ((e = cudaMalloc(&grown.dev, grown.dev_bytes())) != cudaSuccess) return e;
  *what = "cudaMemsetAsync(measurement accumulators)";
  if ((e = cudaMemsetAsync(grown.dev, 0, grown.dev_bytes(), stream)) != cudaSuccess ||
      (e = cudaStreamSynchronize(stream)) != cudaSuccess) {
    (void)cudaFree(grown.dev);
    return e;
  }
  *what = "cudaHostAlloc(Measurements Buffer)";
  if ((e = cudaHostAlloc(&grown.host, grown.host_bytes(), cudaHostAllocMapped | cudaHostAllocPortable)) !=
      cudaSuccess) {
    (void)cudaFree(grown.dev);
    return e;
  }
  std::memset(grown.host, 0, grown.host_bytes());
  *what = "cudaHostGetDevicePointer(Measurements Buffer)";
  if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&grown.host_on_dev), grown.host, 0)) != cudaSuccess) {
    (void)cudaFree(grown.dev);
    (void)cudaFreeHost(grown.host);
    return e;
  }
  b = grown;
  return cudaSuccess;
}

std::string MeasureConfigure(const MeasureSettings& settings) {
  if (settings.host_of_rank.size() > static_cast<size_t>(kMaxRanks)) {
    return StrCat("measure_configure: host_of_rank has ", settings.host_of_rank.size(), " entries; at most ",
                  kMaxRanks, " ranks");
  }
  for (size_t r = 0; r < settings.host_of_rank.size(); ++r) {
    if (settings.host_of_rank[r] < 0) {
      return StrCat("measure_configure: host_of_rank[", r, "] = ", settings.host_of_rank[r], "; host ids are >= 0");
    }
  }
  if (settings.intra_threshold < 1 || settings.inter_threshold < 1) {
    return StrCat("measure_configure: channel thresholds must be >= 1, got intra ", settings.intra_threshold,
                  ", inter ", settings.inter_threshold);
  }
  if (settings.min_window_bytes < 0) {
    return StrCat("measure_configure: min_window_bytes must be >= 0, got ", settings.min_window_bytes);
  }
  if (settings.slots_per_tb < 1 || settings.slots_per_tb > kMaxSlotsPerTb) {
    return StrCat("measure_configure: slots_per_tb must be in 1..", kMaxSlotsPerTb, ", got ", settings.slots_per_tb);
  }
  std::lock_guard<std::mutex> lock(g_measure_mu);
  g_settings = settings;
  return "";
}

MeasureSettings MeasureSettingsNow() {
  std::lock_guard<std::mutex> lock(g_measure_mu);
  return g_settings;
}

void MeasureDrain(std::vector<MeasurementRecord>* records, int64_t* dropped) {
  std::lock_guard<std::mutex> lock(WorkspaceMutex());
  *records = std::move(g_totals.pending);
  g_totals.pending.clear();
  for (auto& [key, ws] : WorkspacesLocked()) HarvestLocked(ws->measure, records);
  g_totals.drained += records->size();
  const unsigned long long total = TotalsLocked().dropped;
  *dropped = static_cast<int64_t>(total - g_totals.dropped_at_drain);
  g_totals.dropped_at_drain = total;
}

MeasureStatsResult MeasureStats() {
  MeasureStatsResult r;
  {
    std::lock_guard<std::mutex> lock(g_measure_mu);
    r.settings = g_settings;
  }
  std::lock_guard<std::mutex> lock(WorkspaceMutex());
  const MeasureCounters total = TotalsLocked();
  r.windows = static_cast<int64_t>(total.windows - g_totals.at_reset.windows);
  r.records = static_cast<int64_t>(total.records - g_totals.at_reset.records);
  r.dropped = static_cast<int64_t>(total.dropped - g_totals.at_reset.dropped);
  r.drained = static_cast<int64_t>(g_totals.drained);
  r.pending = static_cast<int64_t>(g_totals.pending.size());
  for (auto& [key, ws] : WorkspacesLocked()) {
    const MeasureBuffers& b = ws->measure;
    if (b.host == nullptr) continue;
    ++r.buffers;
    r.regions += b.num_tbs;
    r.slots += static_cast<int64_t>(b.num_slots());
    for (size_t k = 0; k < b.num_slots(); ++k) r.used += __atomic_load_n(&b.records()[k].flag, __ATOMIC_ACQUIRE);
    r.accumulator_bytes += static_cast<int64_t>(b.acc_bytes());
    r.buffer_bytes += static_cast<int64_t>(sizeof(MeasurementRecord) * b.num_slots());
    r.counter_bytes += static_cast<int64_t>(2 * sizeof(MeasureCounters) * b.num_tbs + sizeof(unsigned int) * b.num_tbs);
  }
  r.cache_entry_bytes = static_cast<int64_t>(sizeof(MeasurementCacheEntry));
  r.cache_entries_per_tb = MeterCache::kMaxEntries;
  r.cache_bytes = r.regions * r.cache_entries_per_tb * r.cache_entry_bytes;
  return r;
}

void MeasureReset() {
  std::lock_guard<std::mutex> lock(WorkspaceMutex());
  g_totals.pending.clear();
  std::vector<MeasurementRecord> discarded;
  for (auto& [key, ws] : WorkspacesLocked()) HarvestLocked(ws->measure, &discarded);
  g_totals.at_reset = TotalsLocked();
  g_totals.dropped_at_drain = g_totals.at_reset.dropped;
  g_totals.drained = 0;
}

}  // namespace cuda
}  // namespace jaxccl
