// Link emulation and passive measurement for the CPU executor.
//
// A Network mirrors one Topology (jaxccl/runtime/emulated.py builds it): the
// physical links with capacities (bytes per real nanosecond, i.e. the topology's
// capacity times the time scale) and latencies, and for every ordered GPU pair the
// links of its route. When pacing is on, every message a rank posts reserves its
// bytes on each link of its route: a link serves reservations first come, first
// served (each link is an independent FIFO server, so concurrent transfers with
// equal windows and chunk sizes share a link equally), and the message becomes
// visible to the receiver when its last link has carried it plus the route's
// latency. The receiving threadblock sleeps until then, so a degraded link is
// really slower. Capacities and routes can be replaced while collectives run.
//
// Measurement (MCCL Sec. 5.1-5.2): Measurements Accumulators per destination key
// (intra-node: per sending GPU, the cumulative injection throughput over its
// transfers to same-host GPUs; inter-node: per GPU pair), a per-threadblock
// Measurements Cache, and a Measurements Buffer of slots with valid flags that
// the host drains (layouts in measurement_format.h). Collectives with a
// reduction are not measured.
#ifndef JAXCCL_XLA_FFI_NETWORK_H_
#define JAXCCL_XLA_FFI_NETWORK_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "host/common.h"
#include "core/meter.h"
#include "core/measurement_format.h"

namespace jaxccl {

struct NetworkConfig {
  int32_t num_ranks = 0;
  std::vector<int32_t> host_of_rank;    // [num_ranks]
  std::vector<double> capacity;         // [num_links], bytes per real ns (> 0)
  std::vector<double> latency_ns;       // [num_links], real ns (>= 0)
  std::vector<int32_t> route_offsets;   // [num_ranks^2 + 1], CSR over ordered pairs (src * N + dst)
  std::vector<int32_t> route_links;     // link ids
  bool pace = true;
  bool measure = true;
  // Completion timestamps: true = when the emulated links delivered the message (a NIC/DMA completion
  // timestamp); false = when the receiving worker thread observed it (adds the host's wake-up latency).
  bool link_timestamps = true;
  bool trace = false;  // record every delivered message (TraceRecord)
  int32_t intra_threshold = 1;          // channels that must be active for a window to open
  int32_t inter_threshold = 1;
  int64_t min_window_bytes = 32 << 10;  // windows that carried fewer bytes are discarded (not saturating)
  int32_t slots_per_tb = 8;             // Measurements Buffer slots owned by each threadblock (MCCL: SRV)

  // Bounds that keep every emulated time representable in int64 nanoseconds.
  static constexpr double kMinCapacity = 1e-12;    // real bytes/ns: one byte per 1000 s
  static constexpr double kMaxLatencyNs = 1e15;    // real ns per link: about 11.6 days
  static constexpr int32_t kMaxSlotsPerTb = 1 << 16;
  // Checks sizes and values; the error names the first bad field.
  ffi::Error Validate() const;
};

// One message's passage through the emulated links (steady-clock ns): it occupies its bottleneck link
// from tx_start to tx_end and is visible to the receiver at ready (tx_end + the route's latency).
// meter_start/meter_end is the interval the passive measurement sees: the bottleneck's for an
// inter-node pair; for an intra-node transfer the sender's first link (its injection link), since
// the intra-node accumulator measures a GPU's injection: every link is an independent FIFO server,
// so transfers to different receivers of one host overlap on their downlinks, and their bottleneck
// intervals would read up to (GPUs per host - 1) x the injection link's capacity.
struct Transfer {
  int64_t tx_start_ns = 0;
  int64_t tx_end_ns = 0;
  int64_t ready_ns = 0;
  int64_t meter_start_ns = 0;
  int64_t meter_end_ns = 0;
};

// One delivered message, for offline analysis (REACT's per-flow completion times): who sent it from
// which threadblock/op, who received it in which threadblock/op, and its times (steady clock ns).
struct TraceRecord {
  int32_t src, dst, src_tb, src_op, dst_tb, dst_op;
  int64_t bytes;
  int64_t post_ns;       // the sender posted it
  int64_t tx_end_ns;     // its last byte left the bottleneck link (0 without pacing)
  int64_t observed_ns;   // the receiving thread had it
};
static_assert(sizeof(TraceRecord) == 56, "trace record layout (jaxccl/runtime/emulated.py)");

// Per-threadblock Measurements Cache (core/meter.h; lives for one threadblock run, flushed at its end).
using MeasurementCache = MeterCache;

struct MeasurementStats {
  int64_t windows = 0;   // windows closed with a bandwidth
  int64_t records = 0;   // records written into the buffer
  int64_t dropped = 0;   // records dropped (buffer region or cache full)
  int64_t regions = 0;   // threadblock regions of the buffer
  int64_t slots = 0;     // buffer slots in all regions
  int64_t used = 0;      // slots holding a record the host has not drained
  int64_t accumulator_bytes = 0;
  int64_t buffer_bytes = 0;
};

class Network {
 public:
  static ffi::ErrorOr<std::shared_ptr<Network>> Create(NetworkConfig config);
  // Replaces capacities, latencies, routes and flags (same rank count); running launches see it at
  // their next message. Reservations already made keep their times.
  ffi::Error Update(NetworkConfig config);

  int32_t num_ranks() const { return num_ranks_; }
  bool pacing() const { return pace_.load(std::memory_order_relaxed); }
  bool measuring() const { return measure_.load(std::memory_order_relaxed); }
  bool link_timestamps() const { return link_timestamps_.load(std::memory_order_relaxed); }
  bool tracing() const { return trace_.load(std::memory_order_relaxed); }
  // Appends a trace record (at most kMaxTrace are kept; the rest are counted as dropped).
  void Trace(const TraceRecord& r);
  std::vector<TraceRecord> TakeTrace(int64_t* dropped);
  static constexpr size_t kMaxTrace = 1 << 20;

  // Reserves `bytes` from `src` to `dst` at `now_ns` on every link of the route (see Transfer).
  Transfer Reserve(int32_t src, int32_t dst, size_t bytes, int64_t now_ns);

  // Measurement hooks of one connection src -> dst (MCCL Fig. 4). OnPost: a message was posted at
  // `post_ns` (`t`: its passage through the links; null without pacing); `became_busy` if it is the
  // connection's only one in flight (the channel turns active). A window opens when the active
  // channels reach the threshold and starts when that message starts transmitting. While it is open,
  // time in which none of its messages occupied the link (a later message posted after the earlier
  // ones left the wire, e.g. during their propagation) is idle and not counted, so a window measures
  // transmission only. OnDelivered: a message of `bytes` was done at `done_ns`; `now_idle` says
  // whether the connection has nothing in flight any more. A window the delivery closes goes into
  // `cache`.
  void OnPost(int32_t src, int32_t dst, int64_t post_ns, bool became_busy, const Transfer* t);
  void OnDelivered(int32_t src, int32_t dst, size_t bytes, int64_t done_ns, bool now_idle, MeasurementCache* cache);
  // Moves a threadblock's cache into its buffer region (key: slot, rank, threadblock); never blocks.
  void Flush(int64_t slot, int32_t rank, int32_t tb, const MeasurementCache& cache);

  // Copies every valid record out (and frees its slot); returns the records drained.
  std::vector<MeasurementRecord> Drain();
  MeasurementStats Stats();
  // Clears accumulators, buffer and counters.
  void ResetMeasurements();

 private:
  Network() = default;
  struct Accumulator {
    std::mutex mu;
    MeterWindow w{};  // the window state machine of core/meter.h
  };
  struct Region {
    std::mutex writer;  // two launches of one slot never share a (rank, threadblock), but be safe
    std::vector<MeasurementRecord> slots;
    std::unique_ptr<std::atomic<int32_t>[]> flags;
    size_t write = 0;
    size_t read = 0;
  };
  bool Intra(int32_t src, int32_t dst) const { return host_of_rank_[src] == host_of_rank_[dst]; }
  Accumulator& AccumulatorFor(int32_t src, int32_t dst);
  Region& RegionFor(int64_t slot, int32_t rank, int32_t tb);

  int32_t num_ranks_ = 0;
  std::vector<int32_t> host_of_rank_;
  std::atomic<bool> pace_{true};
  std::atomic<bool> measure_{true};
  std::atomic<bool> link_timestamps_{true};
  std::atomic<bool> trace_{false};
  std::mutex trace_mu_;
  std::vector<TraceRecord> trace_records_;
  int64_t trace_dropped_ = 0;
  std::atomic<int32_t> intra_threshold_{1};
  std::atomic<int32_t> inter_threshold_{1};
  std::atomic<int64_t> min_window_bytes_{32 << 10};

  std::mutex links_mu_;  // guards everything below it up to the accumulators
  std::vector<double> capacity_;
  std::vector<double> latency_ns_;
  std::vector<double> free_at_ns_;
  std::vector<int32_t> route_offsets_;
  std::vector<int32_t> route_links_;
  std::vector<int64_t> route_latency_ns_;  // [N * N]

  std::vector<std::unique_ptr<Accumulator>> intra_acc_;  // [src]
  std::vector<std::unique_ptr<Accumulator>> inter_acc_;  // [src * N + dst]

  std::mutex regions_mu_;
  int32_t slots_per_tb_ = 8;
  std::map<std::tuple<int64_t, int32_t, int32_t>, std::unique_ptr<Region>> regions_;
  std::atomic<int64_t> windows_{0};
  std::atomic<int64_t> records_{0};
  std::atomic<int64_t> dropped_{0};
};

// Networks by id, and which network each schedule slot runs on.
ffi::ErrorOr<int64_t> CreateNetwork(NetworkConfig config);
ffi::Error UpdateNetwork(int64_t id, NetworkConfig config);
ffi::ErrorOr<std::shared_ptr<Network>> FindNetwork(int64_t id);
ffi::Error RemoveNetwork(int64_t id);
// Attaches schedule slot `slot` to network `id` (0 detaches); launches pick it up at their start.
ffi::Error AttachNetwork(int64_t slot, int64_t id);
std::shared_ptr<Network> NetworkOfSlot(int64_t slot);  // nullptr if none

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_NETWORK_H_
