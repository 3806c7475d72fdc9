// Binary layout of jaxccl's passive measurement structures (MCCL Sec. 5.1, Fig. 5), shared by the
// CPU executor and the CUDA kernel. Host code decodes the Measurements Buffer with exactly these
// layouts (jaxccl/telemetry/records.py mirrors them as numpy dtypes); bump kMeasurementVersion on any
// change. Sizes match MCCL Table 2: accumulator 32 B, cache entry 24 B, buffer slot 32 B.
#ifndef JAXCCL_XLA_FFI_MEASUREMENT_FORMAT_H_
#define JAXCCL_XLA_FFI_MEASUREMENT_FORMAT_H_

#include <cstdint>

namespace jaxccl {

inline constexpr int32_t kMeasurementVersion = 1;

// What a record measures. kIntra: the cumulative intra-node injection throughput of GPU `src` (all its
// concurrent transfers to GPUs of its own host; `dst` is -1). kInter: the point-to-point throughput from
// GPU `src` to GPU `dst` of another host.
enum class LinkKind : int32_t { kIntra = 0, kInter = 1 };

// Accumulator window state: a new window may open only from kIdle, so windows never overlap.
enum class WindowState : int32_t { kIdle = 0, kMeasuring = 1, kFinalizing = 2 };

// Measurements Accumulator: one per destination key (intra: per sending GPU; inter: per GPU pair),
// shared by every threadblock that sends to it.
struct MeasurementAccumulator {
  int32_t active;       // channels (connections) with a transfer in flight
  int32_t state;        // WindowState
  int64_t bytes_sent;   // cumulative bytes delivered
  int64_t start_ns;     // window start (timestamp of the delivery that opened it)
  int64_t start_size;   // bytes_sent when the window opened
};
static_assert(sizeof(MeasurementAccumulator) == 32, "MCCL Table 2: S_acc = 32 B");

// Measurements Cache entry: per threadblock, aggregates the windows it closed before one flush.
struct MeasurementCacheEntry {
  int32_t src;
  int32_t dst;  // -1 for kIntra
  int32_t kind;   // LinkKind
  int32_t count;  // windows aggregated
  double sum_bw;  // sum of the windows' bandwidths, bytes/s
};
static_assert(sizeof(MeasurementCacheEntry) == 24, "MCCL Table 2: S_cache = 24 B");

// Measurements Buffer slot (host-visible). The writer fills the fields, then sets `flag` to 1 with
// release order; the host reads a slot only when its flag is 1 and frees it by storing 0.
struct MeasurementRecord {
  int32_t flag;
  int32_t src;
  int32_t dst;
  int32_t kind;
  int32_t count;
  int32_t tb;      // writing threadblock (global index within its launch's rank)
  double sum_bw;   // bytes/s, summed over `count` windows
};
static_assert(sizeof(MeasurementRecord) == 32, "MCCL Table 2: S_buf = 32 B");

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_MEASUREMENT_FORMAT_H_
