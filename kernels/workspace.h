// The CUDA executor's per-(schedule slot, device) workspaces: the flag regions and staging of its rank,
// scratch, the rank's program and kernel arguments in device memory, the rank's measurement memory and,
// for launches across processes, its host-mapped flag regions.
// launch.cu sizes a workspace for each launch; measure.cu reads its measurement memory while
// collectives run.
#ifndef JAXCCL_KERNELS_WORKSPACE_H_
#define JAXCCL_KERNELS_WORKSPACE_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "core/measurement_format.h"
#include "core/meter.h"
#include "core/protocol.h"
#include "core/table_format.h"
#include "interpreter.cuh"
#include "mapped_memory.h"

namespace jaxccl {
namespace cuda {

// One rank's measurement memory on its device (see MeasureArgs). Device block: accumulators
// [num_ranks + 1], cursors [num_tbs], counters [num_tbs]; host-mapped block: records
// [num_tbs][slots_per_tb], counters [num_tbs].
struct MeasureBuffers {
  char* dev = nullptr;
  char* host = nullptr;         // host address of the mapped block
  char* host_on_dev = nullptr;  // its device address
  int32_t num_ranks = 0, num_tbs = 0, slots_per_tb = 0;

  static size_t Round(size_t b) { return (b + 255) / 256 * 256; }
  size_t acc_bytes() const { return sizeof(MeterWindow) * static_cast<size_t>(num_ranks + 1); }
  size_t cursor_offset() const { return Round(acc_bytes()); }
  size_t dev_counters_offset() const { return cursor_offset() + Round(sizeof(unsigned int) * num_tbs); }
  size_t dev_bytes() const { return dev_counters_offset() + sizeof(MeasureCounters) * num_tbs; }
  size_t num_slots() const { return static_cast<size_t>(num_tbs) * slots_per_tb; }
  size_t host_counters_offset() const { return Round(sizeof(MeasurementRecord) * num_slots()); }
  size_t host_bytes() const { return host_counters_offset() + sizeof(MeasureCounters) * num_tbs; }
  MeasurementRecord* records() const { return reinterpret_cast<MeasurementRecord*>(host); }
  const MeasureCounters* counters() const {
    return reinterpret_cast<const MeasureCounters*>(host + host_counters_offset());
  }
};

struct Workspace {
  int device = -1;
  char* base = nullptr;  // two regions, then staging (across processes: staging only, the regions are `mapped`)
  size_t bytes = 0;
  const Table* program_of = nullptr;  // the table whose per-rank program is on the device
  int32_t program_rank = -1;
  std::shared_ptr<const Table> keep;  // keeps the host words alive while the copy is in flight
  int32_t* program_dev = nullptr;
  KernelArgs* args_dev = nullptr;
  size_t program_capacity = 0;
  int32_t* error_host = nullptr;  // pinned
  RegionOwner owner{};  // what the two regions' contents belong to (core/protocol.h, RegionNeedsClearing)
  bool owned = false;
  char* scratch = nullptr;
  size_t scratch_bytes = 0;
  MeasureBuffers measure;
  MappedRegions mapped;  // across processes: the rank's two flag regions, host-mapped (mapped_memory.h)
};

using WorkspaceMap = std::map<std::pair<int64_t, int>, std::unique_ptr<Workspace>>;  // by (slot, device)

// The mutex that guards the workspaces (and the launch epochs, launch.cu).
inline std::mutex& WorkspaceMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}
// Every workspace of the process; WorkspaceMutex held.
inline WorkspaceMap& WorkspacesLocked() {
  static auto* workspaces = new WorkspaceMap();
  return *workspaces;
}

// Sizes the workspace's measurement memory for a launch (WorkspaceMutex held, the device current); *what
// names the step that failed (measure.cu).
cudaError_t EnsureMeasureBuffers(Workspace* ws, int32_t num_ranks, int32_t num_tbs, int32_t slots_per_tb,
                                 cudaStream_t stream, const char** what);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_WORKSPACE_H_
