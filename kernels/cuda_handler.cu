// Host side of the CUDA executor: rendezvous of the per-device calls, peer access,
// per-(slot, device) workspaces, the per-rank program upload, and the launch.
//
// Per call: read coords (one small device-to-host copy), meet the other ranks
// (the last one picks the table version and the launch epoch), size this device's
// workspace for the table, publish its address, wait for every rank's address,
// launch the interpreter on the stream and wait for it to report (the kernel's
// own waits are bounded by the deadline, so this returns).
//
// Measurement (MCCL Sec. 5.1-5.2, protocol in interpreter.cuh): configured process-wide
// (MeasureConfigure); each (slot, device) workspace owns its rank's accumulators and per-threadblock
// cursors/counters in device memory and a Measurements Buffer in pinned host-mapped memory, which
// MeasureDrain reads while collectives run. Collectives with a reduction are never measured.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "host/common.h"
#include "host/core_api.h"
#include "cuda_handler.h"
#include "host/dtype.h"
#include "interpreter.cuh"
#include "host/rendezvous.h"
#include "host/table.h"

namespace jaxccl {
namespace cuda {
namespace {

#define JAXCCL_CUDA_CHECK(expr)                                                                            \
  do {                                                                                                     \
    cudaError_t jaxccl_err_ = (expr);                                                                      \
    if (jaxccl_err_ != cudaSuccess) {                                                                      \
      return ffi::Error::Internal(StrCat("jaxccl (cuda): ", #expr, " failed: ", cudaGetErrorString(jaxccl_err_), \
                                         " at ", __FILE__, ":", __LINE__));                                \
    }                                                                                                      \
  } while (0)

std::atomic<const CoreApi*> g_core{nullptr};

struct CudaArrival {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_elems = 0, out_elems = 0;
  ffi::DataType in_dtype = ffi::DataType::INVALID, out_dtype = ffi::DataType::INVALID;
  int device = -1;
  int64_t seq = 0;  // this rank's sequence number of the call on its slot (hot-swap transition point)
  ReduceOp reduce_op = ReduceOp::kSum;  // the call's operator (used when its table reduces)
};

// The measurement settings one launch runs with (taken by the last rank to arrive, for everybody).
struct MeasureSnapshot {
  bool on = false;  // enabled and the table has no reduction
  std::vector<int32_t> host_of_rank;  // [num_ranks]
  int32_t intra_threshold = 1, inter_threshold = 1, slots_per_tb = 64;
  int64_t min_window_bytes = 32 << 10;
};

// What the last rank decided for everybody, plus the second exchange (workspace addresses).
struct CudaLaunch {
  TableSnapshot snap;
  unsigned long long epoch = 0;
  int64_t period_elems = 0;
  size_t esize = 0;
  Reduction reduction;  // none() when the table reduces nothing
  size_t stage_bytes = 0;
  int32_t tiles = 1;
  RegionLayout layout{};
  std::vector<CudaArrival> arrivals;
  Clock::time_point deadline;
  MeasureSnapshot measure;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<char*> regions;  // per rank, this epoch's region
  int32_t published = 0;
  std::string failure;
};

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
  char* base = nullptr;  // two regions, then staging
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
};

// Restores the calling thread's current device (XLA's) when it goes out of scope.
class DeviceGuard {
 public:
  DeviceGuard() { has_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceGuard() {
    if (has_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool has_ = false;
};

std::mutex g_mu;
std::map<std::pair<int64_t, int>, std::unique_ptr<Workspace>> g_workspaces;  // (slot, device)
std::map<std::pair<int64_t, int64_t>, unsigned long long> g_epochs;       // (slot, group)

// Process-wide measurement settings (g_measure_mu) and the host side of the Measurements Buffers (g_mu).
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

// Cumulative counters of every buffer ever allocated (g_mu held). The device writes them; 8-byte loads.
MeasureCounters TotalsLocked() {
  MeasureCounters total = g_totals.retired;
  for (auto& [key, ws] : g_workspaces) {
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

// Moves every valid record of `b` into `out` and frees its slots (g_mu held). The device fills a slot only
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
// undrained records and its counters. g_mu held, b's device current.
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

// Sizes the workspace's measurement memory for a launch (g_mu held, the device current).
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

using CudaRendezvous = Rendezvous<CudaArrival, CudaLaunch>;
CudaRendezvous& TheRendezvous() {
  static auto* r = new CudaRendezvous();
  return *r;
}

// Largest message of the table for period length L (staged slots are sized for it).
size_t LargestMessageBytes(const Table& t, int64_t period_elems, size_t esize, bool staged_only) {
  size_t most = 0;
  for (const TableOp& op : t.ops) {
    if (!OpSends(op.kind) || (staged_only && op.direct())) continue;
    most = std::max(most, RangeBytes(t.chunks_per_period, period_elems, static_cast<int64_t>(esize), op.send_offset(),
                                     op.count));
  }
  return most;
}

ffi::Error EnablePeerAccess(int device, int peer) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, bool> done;
  std::lock_guard<std::mutex> lock(mu);
  if (device == peer || done[{device, peer}]) return ffi::Error::Success();
  int can = 0;
  JAXCCL_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer));
  if (!can) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      StrCat("jaxccl (cuda): GPU ", device, " cannot access GPU ", peer,
                             "'s memory (no peer access); use backend='ppermute'"));
  }
  JAXCCL_CUDA_CHECK(cudaSetDevice(device));
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) JAXCCL_CUDA_CHECK(e);
  (void)cudaGetLastError();  // clear a sticky "already enabled"
  done[{device, peer}] = true;
  return ffi::Error::Success();
}

ffi::ErrorOr<std::shared_ptr<CudaLaunch>> StartLaunch(int64_t slot, int64_t group, int32_t axis_size,
                                                      const std::vector<CudaArrival>& arrivals) {
  using R = std::shared_ptr<CudaLaunch>;
  const CoreApi* core = g_core.load();
  auto launch = std::make_shared<CudaLaunch>();
  std::string error;
  int64_t seq = 0;  // the launch's sequence number: the largest any rank issued (MCCL Sec. 6.2.2)
  for (const CudaArrival& a : arrivals) seq = std::max(seq, a.seq);
  if (!core->acquire(slot, seq, &launch->snap, &error)) return ErrorResult<R>(ffi::Error::InvalidArgument(error));
  const Table& t = *launch->snap.table;
  if (t.num_ranks != axis_size) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: schedule for N=", t.num_ranks, " installed on an axis of size ", axis_size)));
  }
  if (axis_size > kMaxRanks) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl (cuda): at most ", kMaxRanks, " ranks per launch, got ", axis_size)));
  }
  const CudaArrival& a0 = arrivals[0];
  for (int32_t r = 0; r < axis_size; ++r) {
    const CudaArrival& a = arrivals[r];
    if (a.in_dtype != a0.in_dtype || a.out_dtype != a0.in_dtype || a.in_elems != a0.in_elems) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: rank ", r, " has a ", DTypeName(a.in_dtype), "[", a.in_elems, "] -> ",
                 DTypeName(a.out_dtype), " buffer; rank 0 has ", DTypeName(a0.in_dtype), "[", a0.in_elems, "]")));
    }
    for (int32_t q = 0; q < r; ++q) {
      if (arrivals[q].device == a.device) {
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl (cuda): ranks ", q, " and ", r, " are both on GPU ", a.device)));
      }
    }
  }
  launch->esize = CopyableByteWidth(a0.in_dtype);
  if (launch->esize == 0) {
    return ErrorResult<R>(
        ffi::Error::InvalidArgument(StrCat("jaxccl: dtype ", DTypeName(a0.in_dtype), " is not supported")));
  }
  auto period = PeriodElements(t, a0.in_elems);
  if (!period.has_value()) return ErrorResult<R>(std::move(period.error()));
  launch->period_elems = *period;
  const int64_t expected_out = OutputElements(t, *period);
  for (int32_t r = 0; r < axis_size; ++r) {
    if (arrivals[r].out_elems != expected_out) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: rank ", r, "'s output has ", arrivals[r].out_elems, " elements; ",
                 CollectiveName(t.collective), " produces ", expected_out)));
    }
  }
  if (t.has_reduction) {
    for (int32_t r = 1; r < axis_size; ++r) {
      if (arrivals[r].reduce_op != a0.reduce_op) {
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl: rank ", r, " asks for a ", ReduceOpName(arrivals[r].reduce_op), " reduction but rank 0 for a ",
                   ReduceOpName(a0.reduce_op))));
      }
    }
    auto red = ReductionFor(a0.in_dtype, a0.reduce_op);
    if (!red.has_value()) return ErrorResult<R>(std::move(red.error()));
    launch->reduction = *red;
  }
  {
    std::lock_guard<std::mutex> lock(g_measure_mu);
    MeasureSnapshot& m = launch->measure;
    m.on = g_settings.enabled && !t.has_reduction;  // MCCL Sec. 5: collectives without reduction only
    if (m.on) {
      if (!g_settings.host_of_rank.empty() && static_cast<int32_t>(g_settings.host_of_rank.size()) != axis_size) {
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl (cuda): measurement is configured with host ids for ", g_settings.host_of_rank.size(),
                   " ranks but this collective has ", axis_size, "; call measure_configure with ", axis_size,
                   " host ids (or none: all ranks on one host)")));
      }
      m.host_of_rank = g_settings.host_of_rank;
      m.host_of_rank.resize(axis_size, 0);
      m.intra_threshold = g_settings.intra_threshold;
      m.inter_threshold = g_settings.inter_threshold;
      m.slots_per_tb = g_settings.slots_per_tb;
      m.min_window_bytes = g_settings.min_window_bytes;
    }
  }
  launch->stage_bytes = (LargestMessageBytes(t, *period, launch->esize, true) + 255) / 256 * 256;
  const ProgramView p0(t.programs[0].data());
  launch->tiles = ChooseTiles(p0.tileable(), true, LargestMessageBytes(t, *period, launch->esize, false));
  launch->layout = RegionLayout{p0.max_ops() * launch->tiles, t.num_conns(), t.num_slots};
  launch->arrivals = arrivals;
  launch->regions.assign(axis_size, nullptr);
  launch->deadline = DeadlineAfter(core->timeout_s());
  {
    std::lock_guard<std::mutex> lock(g_mu);
    launch->epoch = ++g_epochs[{slot, group}];
  }
  return launch;
}

// Grows the device's workspace for this launch and uploads the rank's program; returns this epoch's region.
ffi::ErrorOr<char*> PrepareWorkspace(int64_t slot, int32_t rank, const CudaLaunch& l, cudaStream_t stream,
                                     Workspace** out, MeasureArgs* measure) {
  const CudaArrival& me = l.arrivals[rank];
  const Table& t = *l.snap.table;
  const RegionLayout layout = l.layout;
  const ProgramView program(t.programs[rank].data());
  const size_t need =
      2 * layout.bytes() + static_cast<size_t>(program.num_staged_conns()) * t.num_slots * l.stage_bytes;
  std::lock_guard<std::mutex> lock(g_mu);
  auto& ws = g_workspaces[{slot, me.device}];
  if (!ws) ws = std::make_unique<Workspace>();
  ws->device = me.device;
  auto fail = [](cudaError_t e, const char* what) {
    return ErrorResult<char*>(
        ffi::Error::Internal(StrCat("jaxccl (cuda): ", what, " failed: ", cudaGetErrorString(e))));
  };
  cudaError_t e = cudaSetDevice(me.device);
  if (e != cudaSuccess) return fail(e, "cudaSetDevice");
  if (ws->error_host == nullptr) {
    if ((e = cudaMallocHost(&ws->error_host, 16)) != cudaSuccess) return fail(e, "cudaMallocHost");
  }
  if (ws->bytes < need) {
    // Fresh memory is zero: every epoch-tagged flag reads as older than any launch.
    if (ws->base != nullptr && (e = cudaFree(ws->base)) != cudaSuccess) return fail(e, "cudaFree");
    ws->base = nullptr;
    ws->bytes = 0;
    if ((e = cudaMalloc(&ws->base, need)) != cudaSuccess) return fail(e, "cudaMalloc(workspace)");
    // Zeroed before any peer is told the address: peers' kernels write into it from other devices' streams.
    if ((e = cudaMemsetAsync(ws->base, 0, need, stream)) != cudaSuccess) return fail(e, "cudaMemsetAsync(workspace)");
    if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return fail(e, "cudaStreamSynchronize(workspace)");
    ws->bytes = need;
    ws->owned = false;  // zeroed above
  }
  const RegionOwner owner{l.snap.version, t.checksum, layout};
  if (ws->owned && RegionNeedsClearing(ws->owner, owner)) {
    // Another table or layout: its descriptors would read as tags of any epoch. This stream's previous kernel
    // is done (stream order), and so are the peers' writes into these regions (that kernel waited for them).
    if ((e = cudaMemsetAsync(ws->base, 0, 2 * layout.bytes(), stream)) != cudaSuccess) {
      return fail(e, "cudaMemsetAsync(regions)");
    }
    if ((e = cudaStreamSynchronize(stream)) != cudaSuccess) return fail(e, "cudaStreamSynchronize(regions)");
  }
  ws->owner = owner;
  ws->owned = true;
  const size_t scratch_bytes =
      static_cast<size_t>(ChunkStart(t.scratch_chunks, t.chunks_per_period, l.period_elems)) * l.esize;
  if (ws->scratch_bytes < scratch_bytes) {
    if (ws->scratch != nullptr && (e = cudaFree(ws->scratch)) != cudaSuccess) return fail(e, "cudaFree");
    ws->scratch = nullptr;
    ws->scratch_bytes = 0;
    if ((e = cudaMalloc(&ws->scratch, scratch_bytes)) != cudaSuccess) return fail(e, "cudaMalloc(scratch)");
    ws->scratch_bytes = scratch_bytes;
  }
  if (ws->args_dev == nullptr && (e = cudaMalloc(&ws->args_dev, sizeof(KernelArgs))) != cudaSuccess) {
    return fail(e, "cudaMalloc(kernel arguments)");
  }
  if (ws->program_of != &t || ws->program_rank != rank) {
    const std::vector<int32_t>& words = t.programs[rank];
    const size_t bytes = words.size() * sizeof(int32_t);
    if (ws->program_capacity < bytes) {
      if (ws->program_dev != nullptr && (e = cudaFree(ws->program_dev)) != cudaSuccess) return fail(e, "cudaFree");
      ws->program_dev = nullptr;
      if ((e = cudaMalloc(&ws->program_dev, bytes)) != cudaSuccess) return fail(e, "cudaMalloc(program)");
      ws->program_capacity = bytes;
    }
    if ((e = cudaMemcpyAsync(ws->program_dev, words.data(), bytes, cudaMemcpyHostToDevice, stream)) !=
        cudaSuccess) {
      return fail(e, "cudaMemcpyAsync(program)");
    }
    ws->program_of = &t;
    ws->program_rank = rank;
    ws->keep = l.snap.table;
  }
  *measure = MeasureArgs{};
  if (l.measure.on) {
    const MeasureSnapshot& m = l.measure;
    const char* what = "";
    if ((e = EnsureMeasureBuffers(ws.get(), t.num_ranks, t.rank_num_tbs[rank], m.slots_per_tb, stream, &what)) !=
        cudaSuccess) {
      return fail(e, what);
    }
    const MeasureBuffers& b = ws->measure;
    // Windows never span launches: each launch starts from idle accumulators (only this rank touches them).
    if ((e = cudaMemsetAsync(b.dev, 0, b.acc_bytes(), stream)) != cudaSuccess) {
      return fail(e, "cudaMemsetAsync(measurement accumulators)");
    }
    measure->acc = reinterpret_cast<MeterWindow*>(b.dev);
    measure->cursor = reinterpret_cast<unsigned int*>(b.dev + b.cursor_offset());
    measure->counters_dev = reinterpret_cast<MeasureCounters*>(b.dev + b.dev_counters_offset());
    measure->records = reinterpret_cast<MeasurementRecord*>(b.host_on_dev);
    measure->counters_host = reinterpret_cast<MeasureCounters*>(b.host_on_dev + b.host_counters_offset());
    measure->slots_per_tb = b.slots_per_tb;
    measure->intra_threshold = m.intra_threshold;
    measure->inter_threshold = m.inter_threshold;
    measure->min_window_bytes = m.min_window_bytes;
    for (int32_t p = 0; p < t.num_ranks; ++p) {
      if (m.host_of_rank[p] == m.host_of_rank[rank]) measure->intra_peers |= 1ull << p;
    }
  }
  *out = ws.get();
  return ws->base + (l.epoch & 1) * layout.bytes();
}

const char* ErrorWhat(int32_t code) {
  switch (code) {
    case kTimeoutDependency: return "waited for a dependency that did not complete";
    case kTimeoutMessage: return "waited for a message that never arrived (deadlock or a failed peer)";
    case kTimeoutSlot: return "waited for a free slot: its connection stayed full";
    case kTimeoutDrain: return "waited for its messages to be consumed";
    case kSizeMismatch: return "received a message of the wrong size";
    case kStaleMessage: return "received a message of another table or launch (stale message, refused)";
    default: return "failed";
  }
}

ffi::Error CudaCollective(cudaStream_t stream, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                          ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size,
                          int64_t reduce_op) {
  const CoreApi* core = g_core.load();
  if (core == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxccl (cuda): the CUDA module is not attached to jaxccl._native (import jaxccl.runtime.native)");
  }
  auto op = ReduceOpOf(reduce_op);
  if (!op.has_value()) return std::move(op.error());
  if (coords.element_type() != ffi::DataType::S32 || coords.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxccl_cuda_collective: coords must be int32[2] (rank, group)");
  }
  if (axis_size < 1 || axis_size > kMaxRanks) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl_cuda_collective: axis_size must be in 1..", kMaxRanks));
  }
  DeviceGuard guard;
  int device = 0;
  JAXCCL_CUDA_CHECK(cudaGetDevice(&device));
  if (out->untyped_data() != nullptr) {  // the buffer's device, should XLA's thread be on another one
    cudaPointerAttributes attr;
    JAXCCL_CUDA_CHECK(cudaPointerGetAttributes(&attr, out->untyped_data()));
    device = attr.device;
  }
  int32_t rc[2];
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(rc, coords.untyped_data(), sizeof(rc), cudaMemcpyDeviceToHost, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t rank = rc[0], group = rc[1];
  if (rank < 0 || rank >= axis_size) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl_cuda_collective: rank ", rank, " outside axis of ", axis_size));
  }
  CudaArrival me;
  me.in = x.untyped_data();
  me.out = out->untyped_data();
  me.in_elems = static_cast<int64_t>(x.element_count());
  me.out_elems = static_cast<int64_t>(out->element_count());
  me.in_dtype = x.element_type();
  me.out_dtype = out->element_type();
  me.reduce_op = *op;
  me.device = device;
  std::string issue_error;
  if (!core->note_issued(slot, rank, &me.seq, &issue_error)) return ffi::Error::InvalidArgument(issue_error);
  const int32_t n = static_cast<int32_t>(axis_size);
  auto started = TheRendezvous().Arrive(run_id.run_id, site, group, rank, n, me, core->timeout_s(),
                                        [&](const std::vector<CudaArrival>& all) {
                                          return StartLaunch(slot, group, n, all);
                                        });
  if (!started.has_value()) return std::move(started.error());
  CudaLaunch& l = **started;
  const Table& t = *l.snap.table;

  // Phase 2: every rank publishes its workspace region; peers need all of them before any kernel runs.
  Workspace* ws = nullptr;
  MeasureArgs measure{};
  auto region = PrepareWorkspace(slot, rank, l, stream, &ws, &measure);
  for (int32_t r = 0; r < n && region.has_value(); ++r) {
    if (ffi::Error e = EnablePeerAccess(me.device, l.arrivals[r].device); e.failure()) {
      region = ErrorResult<char*>(std::move(e));
    }
  }
  int resident = 0;
  if (region.has_value() && MaxResidentBlocks(me.device, &resident) == cudaSuccess &&
      resident < t.rank_num_tbs[rank]) {
    region = ErrorResult<char*>(ffi::Error::InvalidArgument(
        StrCat("jaxccl (cuda): rank ", rank, " has ", t.rank_num_tbs[rank], " threadblocks but only ", resident,
               " interpreter blocks fit on GPU ", me.device, " at once")));
  }
  {
    std::unique_lock<std::mutex> lock(l.mu);
    if (!region.has_value()) {
      if (l.failure.empty()) l.failure = StrCat("rank ", rank, ": ", region.error().message());
    } else {
      l.regions[rank] = *region;
    }
    ++l.published;
    l.cv.notify_all();
    const bool all = l.cv.wait_until(lock, l.deadline, [&] { return l.published == n; });
    if (!all) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        StrCat("jaxccl (cuda): deadline exceeded exchanging workspaces at site ", site));
    }
    if (!l.failure.empty()) return ffi::Error::Internal(StrCat("jaxccl (cuda): launch failed: ", l.failure));
  }

  KernelArgs args{};
  args.prog = ws->program_dev;
  args.rank = rank;
  args.tiles = l.tiles;
  args.reduction = l.reduction;
  args.buffers = RankBuffers{static_cast<const char*>(me.in), static_cast<char*>(me.out), ws->scratch, l.period_elems,
                             t.chunks_per_period, static_cast<int32_t>(l.esize), l.tiles};
  args.epoch = l.epoch;
  args.identity = LaunchIdentity(t.checksum, l.epoch);
  args.timeout_ns = static_cast<unsigned long long>(core->timeout_s() * 1e9);
  args.layout = l.layout;
  args.staging = *region + (2 - (l.epoch & 1)) * args.layout.bytes();
  args.stage_bytes = l.stage_bytes;
  for (int32_t r = 0; r < n; ++r) args.regions[r] = l.regions[r];
  args.measure = measure;
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(ws->args_dev, &args, sizeof(args), cudaMemcpyHostToDevice, stream));
  char* error_dev = *region + args.layout.error();
  JAXCCL_CUDA_CHECK(cudaMemsetAsync(error_dev, 0, 16, stream));
  JAXCCL_CUDA_CHECK(LaunchInterpreter(ws->args_dev, t.rank_num_tbs[rank], 1, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));  // the arguments' host copy lives on this stack
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(ws->error_host, error_dev, 16, cudaMemcpyDeviceToHost, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t code = ws->error_host[0];
  if (code == kSizeMismatch || code == kStaleMessage) {
    return ffi::Error::Internal(StrCat("jaxccl (cuda): rank ", rank, ", threadblock ", ws->error_host[1], ", op ",
                                       ws->error_host[2], " ", ErrorWhat(code)));
  }
  if (code != kProtocolOk) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      StrCat("jaxccl (cuda): deadline exceeded: rank ", rank, ", threadblock ", ws->error_host[1],
                             ", op ", ws->error_host[2], " ", ErrorWhat(code), " within ", Seconds(core->timeout_s())));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcclCudaCollective, CudaCollective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("axis_size")
                                  .Attr<int64_t>("reduce_op"));

bool AttachCore(const CoreApi* api, std::string* error) {
  if (api == nullptr || api->version != kCoreApiVersion || api->struct_size != sizeof(CoreApi)) {
    *error = StrCat("jaxccl._native_cuda expects core API version ", kCoreApiVersion, " (", sizeof(CoreApi),
                    " bytes); rebuild both modules from one tree");
    return false;
  }
  g_core.store(api);
  return true;
}

bool CoreAttached() { return g_core.load() != nullptr; }

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
  std::lock_guard<std::mutex> lock(g_mu);
  *records = std::move(g_totals.pending);
  g_totals.pending.clear();
  for (auto& [key, ws] : g_workspaces) HarvestLocked(ws->measure, records);
  g_totals.drained += records->size();
  const unsigned long long total = TotalsLocked().dropped;
  *dropped = static_cast<int64_t>(total - g_totals.dropped_at_drain);
  g_totals.dropped_at_drain = total;
}

MeasureStatsResult MeasureStats() {
  MeasureStatsResult r;
  {
    std::lock_guard<std::mutex> lock(g_measure_mu);
    r.enabled = g_settings.enabled;
    r.slots_per_tb = g_settings.slots_per_tb;
    r.intra_threshold = g_settings.intra_threshold;
    r.inter_threshold = g_settings.inter_threshold;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const MeasureCounters total = TotalsLocked();
  r.windows = static_cast<int64_t>(total.windows - g_totals.at_reset.windows);
  r.records = static_cast<int64_t>(total.records - g_totals.at_reset.records);
  r.dropped = static_cast<int64_t>(total.dropped - g_totals.at_reset.dropped);
  r.drained = static_cast<int64_t>(g_totals.drained);
  r.pending = static_cast<int64_t>(g_totals.pending.size());
  for (auto& [key, ws] : g_workspaces) {
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
  std::lock_guard<std::mutex> lock(g_mu);
  g_totals.pending.clear();
  std::vector<MeasurementRecord> discarded;
  for (auto& [key, ws] : g_workspaces) HarvestLocked(ws->measure, &discarded);
  g_totals.at_reset = TotalsLocked();
  g_totals.dropped_at_drain = g_totals.at_reset.dropped;
  g_totals.drained = 0;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

namespace {

// Device memory of one test run, freed on every path.
class DeviceAllocations {
 public:
  ~DeviceAllocations() {
    for (void* p : device_) (void)cudaFree(p);
    for (void* p : host_) (void)cudaFreeHost(p);
  }
  template <typename T>
  cudaError_t Device(T** out, size_t bytes) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
    if (e == cudaSuccess) {
      device_.push_back(p);
      *out = static_cast<T*>(p);
      return cudaMemset(p, 0, bytes == 0 ? 1 : bytes);
    }
    return e;
  }
  template <typename T>
  cudaError_t Mapped(T** host, T** dev, size_t bytes) {
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped);
    if (e != cudaSuccess) return e;
    host_.push_back(p);
    std::memset(p, 0, bytes);
    *host = static_cast<T*>(p);
    return cudaHostGetDevicePointer(reinterpret_cast<void**>(dev), p, 0);
  }

 private:
  std::vector<void*> device_, host_;
};

#define JAXCCL_TEST_CHECK(expr)                                                                    \
  do {                                                                                             \
    cudaError_t jaxccl_err_ = (expr);                                                              \
    if (jaxccl_err_ != cudaSuccess) {                                                              \
      r.error = StrCat("jaxccl (cuda test): ", #expr, " failed: ", cudaGetErrorString(jaxccl_err_)); \
      return r;                                                                                    \
    }                                                                                              \
  } while (0)

}  // namespace

TestRunResult TestRunRanks(int64_t slot, const char* inputs, int32_t num_ranks, int64_t in_elems, int32_t esize,
                           Reduction reduction, int32_t tiles, bool measure, const std::vector<int32_t>& host_of_rank) {
  TestRunResult r;
  const CoreApi* core = g_core.load();
  if (core == nullptr) {
    r.error = "jaxccl (cuda test): the CUDA module is not attached to jaxccl._native";
    return r;
  }
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    r.error = StrCat("jaxccl (cuda test): num_ranks must be in 1..", kMaxRanks);
    return r;
  }
  for (int32_t k = 0; k < num_ranks; ++k) {
    int64_t seq = 0;
    if (!core->note_issued(slot, k, &seq, &r.error)) return r;
    r.seq = std::max(r.seq, seq);
  }
  TableSnapshot snap;
  if (!core->acquire(slot, r.seq, &snap, &r.error)) return r;
  r.version = snap.version;
  const Table& t = *snap.table;
  if (t.num_ranks != num_ranks) {
    r.error = StrCat("jaxccl (cuda test): schedule for N=", t.num_ranks, " run with ", num_ranks, " ranks");
    return r;
  }
  auto period = PeriodElements(t, in_elems);
  if (!period.has_value()) {
    r.error = std::string(period.error().message());
    return r;
  }
  if (t.has_reduction && !Reducible(reduction.type, reduction.op)) {
    r.error = "jaxccl (cuda test): the table reduces; pass an element type and an operator it supports";
    return r;
  }
  const int64_t out_elems = OutputElements(t, *period);
  const ProgramView p0(t.programs[0].data());
  r.tiles = tiles > 0 && p0.tileable() ? std::min(tiles, kMaxTiles)
                                       : ChooseTiles(p0.tileable(), true, LargestMessageBytes(t, *period, esize, false));
  const RegionLayout layout{p0.max_ops() * r.tiles, t.num_conns(), t.num_slots};
  const size_t stage_bytes = (LargestMessageBytes(t, *period, esize, true) + 255) / 256 * 256;
  const size_t in_bytes = static_cast<size_t>(in_elems) * esize, out_bytes = static_cast<size_t>(out_elems) * esize;
  const size_t scratch_bytes = static_cast<size_t>(ChunkStart(t.scratch_chunks, t.chunks_per_period, *period)) * esize;
  int32_t max_tbs = 0;
  for (int32_t k = 0; k < num_ranks; ++k) max_tbs = std::max(max_tbs, t.rank_num_tbs[k]);
  int device = 0, resident = 0;
  JAXCCL_TEST_CHECK(cudaGetDevice(&device));
  JAXCCL_TEST_CHECK(MaxResidentBlocks(device, &resident));
  if (resident < max_tbs * num_ranks) {
    r.error = StrCat("jaxccl (cuda test): ", max_tbs * num_ranks, " blocks do not fit on GPU ", device, " at once (",
                     resident, ")");
    return r;
  }
  DeviceAllocations mem;
  std::vector<KernelArgs> args(num_ranks);
  std::vector<char*> outs(num_ranks);
  const int32_t slots_per_tb = 8;
  MeterWindow* acc = nullptr;
  MeasurementRecord *records_host = nullptr, *records_dev = nullptr;
  MeasureCounters *counters_host = nullptr, *counters_host_dev = nullptr, *counters_dev = nullptr;
  unsigned int* cursor = nullptr;
  const size_t tb_regions = static_cast<size_t>(num_ranks) * max_tbs;
  if (measure) {
    JAXCCL_TEST_CHECK(mem.Device(&acc, sizeof(MeterWindow) * num_ranks * (num_ranks + 1)));
    JAXCCL_TEST_CHECK(mem.Mapped(&records_host, &records_dev, sizeof(MeasurementRecord) * tb_regions * slots_per_tb));
    JAXCCL_TEST_CHECK(mem.Mapped(&counters_host, &counters_host_dev, sizeof(MeasureCounters) * tb_regions));
    JAXCCL_TEST_CHECK(mem.Device(&counters_dev, sizeof(MeasureCounters) * tb_regions));
    JAXCCL_TEST_CHECK(mem.Device(&cursor, sizeof(unsigned int) * tb_regions));
  }
  for (int32_t k = 0; k < num_ranks; ++k) {
    KernelArgs& a = args[k];
    char *in = nullptr, *scratch = nullptr, *region = nullptr, *staging = nullptr;
    int32_t* prog = nullptr;
    const ProgramView program(t.programs[k].data());
    JAXCCL_TEST_CHECK(mem.Device(&in, in_bytes));
    JAXCCL_TEST_CHECK(mem.Device(&outs[k], out_bytes));
    JAXCCL_TEST_CHECK(mem.Device(&scratch, scratch_bytes));
    JAXCCL_TEST_CHECK(mem.Device(&region, layout.bytes()));
    JAXCCL_TEST_CHECK(mem.Device(&staging, program.num_staged_conns() * t.num_slots * stage_bytes));
    JAXCCL_TEST_CHECK(mem.Device(&prog, t.programs[k].size() * sizeof(int32_t)));
    JAXCCL_TEST_CHECK(cudaMemcpy(in, inputs + k * in_bytes, in_bytes, cudaMemcpyHostToDevice));
    JAXCCL_TEST_CHECK(
        cudaMemcpy(prog, t.programs[k].data(), t.programs[k].size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    a.prog = prog;
    a.rank = k;
    a.tiles = r.tiles;
    a.reduction = t.has_reduction ? reduction : Reduction{};
    a.buffers = RankBuffers{in, outs[k], scratch, *period, t.chunks_per_period, esize, r.tiles};
    a.epoch = 1;
    a.identity = LaunchIdentity(t.checksum, 1);
    a.timeout_ns = static_cast<unsigned long long>(core->timeout_s() * 1e9);
    a.layout = layout;
    a.staging = staging;
    a.stage_bytes = stage_bytes;
    a.regions[k] = region;
    if (measure && !t.has_reduction) {
      MeasureArgs& m = a.measure;
      const size_t first = static_cast<size_t>(k) * max_tbs;
      m.acc = acc + static_cast<size_t>(k) * (num_ranks + 1);
      m.records = records_dev + first * slots_per_tb;
      m.counters_host = counters_host_dev + first;
      m.counters_dev = counters_dev + first;
      m.cursor = cursor + first;
      m.slots_per_tb = slots_per_tb;
      m.intra_threshold = 1;
      m.inter_threshold = 1;
      m.min_window_bytes = 0;
      for (int32_t q = 0; q < num_ranks; ++q) {
        const int32_t hk = host_of_rank.empty() ? 0 : host_of_rank[k], hq = host_of_rank.empty() ? 0 : host_of_rank[q];
        if (hk == hq) m.intra_peers |= 1ull << q;
      }
    }
  }
  for (int32_t k = 0; k < num_ranks; ++k) {
    for (int32_t q = 0; q < num_ranks; ++q) args[k].regions[q] = args[q].regions[q];
  }
  KernelArgs* args_dev = nullptr;
  JAXCCL_TEST_CHECK(mem.Device(&args_dev, sizeof(KernelArgs) * num_ranks));
  JAXCCL_TEST_CHECK(cudaMemcpy(args_dev, args.data(), sizeof(KernelArgs) * num_ranks, cudaMemcpyHostToDevice));
  cudaEvent_t start, stop;
  JAXCCL_TEST_CHECK(cudaEventCreate(&start));
  JAXCCL_TEST_CHECK(cudaEventCreate(&stop));
  JAXCCL_TEST_CHECK(cudaEventRecord(start));
  JAXCCL_TEST_CHECK(LaunchInterpreter(args_dev, max_tbs, num_ranks, 0));
  JAXCCL_TEST_CHECK(cudaEventRecord(stop));
  JAXCCL_TEST_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  JAXCCL_TEST_CHECK(cudaEventElapsedTime(&ms, start, stop));
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  r.kernel_ms = ms;
  for (int32_t k = 0; k < num_ranks; ++k) {
    int32_t err[4];
    JAXCCL_TEST_CHECK(cudaMemcpy(err, args[k].regions[k] + layout.error(), sizeof(err), cudaMemcpyDeviceToHost));
    if (err[0] != kProtocolOk) {
      r.error = StrCat("jaxccl (cuda test): rank ", k, ", threadblock ", err[1], ", op ", err[2], " ", ErrorWhat(err[0]));
      return r;
    }
  }
  r.outputs.resize(out_bytes * num_ranks);
  for (int32_t k = 0; k < num_ranks; ++k) {
    JAXCCL_TEST_CHECK(cudaMemcpy(r.outputs.data() + k * out_bytes, outs[k], out_bytes, cudaMemcpyDeviceToHost));
  }
  if (measure) {
    for (size_t k = 0; k < tb_regions * slots_per_tb; ++k) {
      if (records_host[k].flag == 1) r.records.push_back(records_host[k]);
    }
  }
  return r;
}

}  // namespace cuda
}  // namespace jaxccl
