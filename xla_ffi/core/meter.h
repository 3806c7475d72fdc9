// Passive measurement (MCCL Sec. 5.1-5.2): the window state machine of a Measurements Accumulator and
// the per-threadblock Measurements Cache, one definition for every backend (docs/executor.md,
// "Measurement").
//
// A connection is *active* while it has a message in flight: from the post of a message that finds it
// empty until the consumption that empties it. An accumulator (intra-node: a sending GPU; inter-node:
// a GPU pair) counts its active connections. A window opens when that count reaches the threshold
// and starts when the opening message starts transmitting; it closes when the count drops below the
// threshold. Time inside an open window during which none of its messages occupied a link (known
// only with link emulation, which reports each message's transmission interval) is idle and not
// counted. A window that carried fewer than `min_window_bytes` did not saturate anything and is
// dropped. The caller serializes the calls of one accumulator (CPU: a mutex; GPU: a spin lock).
#ifndef JAXCCL_XLA_FFI_CORE_METER_H_
#define JAXCCL_XLA_FFI_CORE_METER_H_

#include <cstdint>

#include "measurement_format.h"
#include "hd.h"

namespace jaxccl {

struct MeterWindow {
  MeasurementAccumulator a;  // the MCCL fields (active, state, bytes_sent, start_ns, start_size)
  int64_t busy_until_ns;     // latest transmission end of the open window's messages
  int64_t idle_ns;           // gaps inside the open window with nothing on the wire
  int32_t lock;              // GPU spin lock (unused on the CPU)
  int32_t pad;
};

// A message was posted. `became_busy`: its connection had nothing in flight. `tx_start`/`tx_end`: its
// transmission interval when links are emulated (`timed`), else tx_start is the post time.
JAXCCL_HD void MeterOnPost(MeterWindow* w, int32_t threshold, bool became_busy, bool timed, int64_t tx_start,
                           int64_t tx_end) {
  MeasurementAccumulator& a = w->a;
  if (became_busy) ++a.active;
  if (a.state == static_cast<int32_t>(WindowState::kMeasuring)) {
    if (timed) {
      if (tx_start > w->busy_until_ns) w->idle_ns += tx_start - w->busy_until_ns;
      if (tx_end > w->busy_until_ns) w->busy_until_ns = tx_end;
    }
  } else if (a.state == static_cast<int32_t>(WindowState::kIdle) && a.active >= threshold) {
    a.state = static_cast<int32_t>(WindowState::kMeasuring);
    a.start_ns = tx_start;
    a.start_size = a.bytes_sent;
    w->busy_until_ns = timed ? tx_end : tx_start;
    w->idle_ns = 0;
  }
}

// A message of `bytes` was done at `done_ns`; `now_idle`: its connection has nothing in flight any more.
// Returns the bandwidth (bytes/s) of the window this closes, or a negative value.
JAXCCL_HD double MeterOnDelivered(MeterWindow* w, int32_t threshold, int64_t min_window_bytes, int64_t bytes,
                                  bool now_idle, int64_t done_ns) {
  MeasurementAccumulator& a = w->a;
  a.bytes_sent += bytes;
  if (now_idle) --a.active;
  if (a.state != static_cast<int32_t>(WindowState::kMeasuring) || a.active >= threshold) return -1;
  a.state = static_cast<int32_t>(WindowState::kFinalizing);
  const int64_t dbytes = a.bytes_sent - a.start_size;
  // The window ends when its last byte was carried: deliveries may complete out of transmission order
  // (timed messages: busy_until_ns is the latest transmission end; untimed: the post time, never later).
  const int64_t end_ns = done_ns > w->busy_until_ns ? done_ns : w->busy_until_ns;
  const int64_t dt = end_ns - a.start_ns - w->idle_ns;
  a.state = static_cast<int32_t>(WindowState::kIdle);
  if (dbytes <= 0 || dbytes < min_window_bytes || dt <= 0) return -1;
  return static_cast<double>(dbytes) / (static_cast<double>(dt) * 1e-9);
}

// Per-threadblock Measurements Cache (MCCL Fig. 5): windows aggregated per (src, dst, kind) until the
// threadblock flushes them into its Measurements Buffer slots.
struct MeterCache {
  static constexpr int32_t kMaxEntries = 32;
  MeasurementCacheEntry entries[kMaxEntries];
  int32_t size;
  int32_t overflow;  // windows that found the cache full (counted as drops at the flush)

  JAXCCL_HD void Clear() { size = overflow = 0; }
  JAXCCL_HD bool empty() const { return size == 0 && overflow == 0; }
  JAXCCL_HD void Add(int32_t src, int32_t dst, LinkKind kind, double bw) {
    const int32_t k = static_cast<int32_t>(kind);
    for (int32_t j = 0; j < size; ++j) {
      MeasurementCacheEntry& e = entries[j];
      if (e.src == src && e.dst == dst && e.kind == k) {
        ++e.count;
        e.sum_bw += bw;
        return;
      }
    }
    if (size == kMaxEntries) {
      ++overflow;
      return;
    }
    entries[size++] = MeasurementCacheEntry{src, dst, k, 1, bw};
  }
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_METER_H_
