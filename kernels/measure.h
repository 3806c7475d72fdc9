// Passive measurement of the CUDA executor (MCCL Sec. 5.1-5.2; protocol in interpreter.cuh, layouts in
// core/measurement_format.h): its process-wide settings, and the Measurements Buffers of every
// workspace (workspace.h) drained, counted and reset while collectives run (measure.cu).
#ifndef JAXCCL_KERNELS_MEASURE_H_
#define JAXCCL_KERNELS_MEASURE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/measurement_format.h"

namespace jaxccl {
namespace cuda {

inline constexpr int32_t kMaxSlotsPerTb = 1 << 16;

// Process-wide; launches that start after MeasureConfigure use it.
struct MeasureSettings {
  bool enabled = false;
  std::vector<int32_t> host_of_rank;  // host id of each rank of the axis; empty: all ranks on one host
  int32_t intra_threshold = 1;        // active connections that open an intra-node window
  int32_t inter_threshold = 1;        // ... an inter-node window
  int32_t slots_per_tb = 64;          // Measurements Buffer slots per threadblock
  int64_t min_window_bytes = 32 << 10;  // windows that carried fewer bytes are dropped (core/meter.h)
};

// Counters since the last MeasureReset and the memory footprint (MCCL Table 2) of every buffer.
struct MeasureStatsResult {
  MeasureSettings settings;  // in force
  int64_t windows = 0;   // windows closed with a bandwidth (also those whose record was dropped)
  int64_t records = 0;   // records written into the buffers
  int64_t dropped = 0;   // records dropped (no free slot, or the threadblock's cache was full)
  int64_t drained = 0;   // records returned by MeasureDrain
  int64_t pending = 0;   // records kept on the host from reallocated buffers, not drained yet
  int64_t buffers = 0;   // (schedule slot, device) workspaces with measurement memory
  int64_t regions = 0;   // threadblock regions of the buffers
  int64_t slots = 0;     // buffer slots in all regions
  int64_t used = 0;      // slots holding a record not drained yet
  int64_t accumulator_bytes = 0;  // device memory: (num_ranks + 1) accumulators of 32 B per workspace
  int64_t cache_entry_bytes = 0;  // 24
  int64_t cache_entries_per_tb = 0;
  int64_t cache_bytes = 0;        // shared memory: regions * entries * 24
  int64_t buffer_bytes = 0;       // pinned host-mapped memory: slots * 32
  int64_t counter_bytes = 0;      // per-threadblock cursors and counters (device and host-mapped)
};

// Checks and installs the settings; returns "" or what is wrong.
std::string MeasureConfigure(const MeasureSettings& settings);
MeasureSettings MeasureSettingsNow();
// Every valid record (slots freed) and the records dropped since the previous drain (or reset).
void MeasureDrain(std::vector<MeasurementRecord>* records, int64_t* dropped);
MeasureStatsResult MeasureStats();
// Discards undrained records and restarts the counters (call it between collectives).
void MeasureReset();

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_MEASURE_H_
