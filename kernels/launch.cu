// One launch of the CUDA executor, host side: the rendezvous of the per-device calls, the launch
// agreement (core/launch.h), peer access, the per-(slot, device) workspace (workspace.h) with the rank's
// program, and the kernel.
//
// Per call: meet the other ranks (the last one acquires the table at the agreed sequence number, checks
// the calls and picks the launch epoch), size this device's workspace for the table, publish its address,
// wait for every rank's address, launch the interpreter on the stream and wait for it to report (the
// kernel's own waits are bounded by the deadline, so this returns).
//
// A launch whose group spans processes (jaxccl_cuda_mp_collective) runs the same way for this process's
// ranks, which meet by their index among the local ranks (as the CPU executor's, transport/handler.cc).
// The last to arrive also prepares the handshake memory (mapped_memory.h: every rank's flag regions in
// host-mapped memory, shadows for the ranks of other processes, device staging) and starts the launch's
// proxy in jaxccl._native (host/core_api.h, start_mapped_proxy), which carries the connections to other
// processes. After its kernel each rank waits for the proxy; the proxy's failure (it names the process)
// comes before the kernel's own code, and a kernel's failure aborts the proxy. The last local rank to
// finish destroys the proxy, so no launch of the slot starts while an earlier one's proxy runs.
#include "launch.h"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/launch.h"
#include "handler.h"
#include "host/core_api.h"
#include "host/launch.h"
#include "host/rendezvous.h"
#include "interpreter.cuh"
#include "mapped_memory.h"
#include "measure.h"
#include "transport/mapped_launch.h"
#include "transport/proxy.h"
#include "workspace.h"

namespace jaxccl {
namespace cuda {
namespace {

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
  std::vector<CudaArrival> arrivals;  // per rank; a rank of another process has none
  Clock::time_point deadline;
  double timeout_s = 0;
  MeasureSnapshot measure;
  // Across processes: the group, every rank's flag region of this epoch (host addresses: a local rank's
  // mapped region, another process's rank's shadow), the staging the proxy receives into, and the proxy.
  std::shared_ptr<const ProcessGroup> group;  // null: every rank runs in this process
  std::vector<char*> mapped;
  DeviceStaging* staging = nullptr;
  std::unique_ptr<ProxyHandle> proxy;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<char*> regions;  // per rank, this epoch's region (in this process: its device address)
  int32_t published = 0;
  int32_t finished = 0;  // local ranks past their kernel (across processes)
  std::string failure;

  bool Local(int32_t rank) const { return !group || group->Local(rank); }
  int32_t num_local() const { return group ? group->num_local : static_cast<int32_t>(arrivals.size()); }
};

// The last launch epoch of every (slot, group); WorkspaceMutex held.
std::map<std::pair<int64_t, int64_t>, unsigned long long>& Epochs() {
  static auto* epochs = new std::map<std::pair<int64_t, int64_t>, unsigned long long>();
  return *epochs;
}

using CudaRendezvous = Rendezvous<CudaArrival, CudaLaunch>;
CudaRendezvous& TheRendezvous() {
  static auto* r = new CudaRendezvous();
  return *r;
}
// Launches across processes meet by local index, apart from the others (as the CPU executor's).
CudaRendezvous& ProcessRendezvous() {
  static auto* r = new CudaRendezvous();
  return *r;
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

// Across processes: the handshake memory of every rank (mapped_memory.h), and the proxy, started.
ffi::Error StartProxy(int64_t slot, int64_t group, CudaLaunch& l) {
  const CoreApi* core = AttachedCore();
  const Table& t = *l.snap.table;
  const int32_t n = t.num_ranks;
  const RegionOwner owner{l.snap.version, t.checksum, l.layout};
  l.mapped.assign(n, nullptr);
  int staging_device = -1;  // the first local rank's GPU: the others reach it through peer access
  {
    std::lock_guard<std::mutex> lock(WorkspaceMutex());
    for (int32_t r = 0; r < n; ++r) {
      MappedRegions* m = nullptr;
      if (l.Local(r)) {
        const int device = l.arrivals[r].device;
        std::unique_ptr<Workspace>& ws = WorkspacesLocked()[{slot, device}];
        if (!ws) ws = std::make_unique<Workspace>();
        ws->device = device;
        m = &ws->mapped;
        if (staging_device < 0) staging_device = device;
      } else {
        m = &ShadowRegionsLocked(slot, group, r);
      }
      auto region = PrepareMappedRegion(m, owner, l.epoch);
      if (!region.has_value()) return std::move(region.error());
      l.mapped[r] = *region;
    }
  }
  l.staging = &StagingOf(staging_device);
  MappedLaunchSpec spec;
  ProxyLaunchView& v = spec.view;
  v.table = l.snap.table;
  v.slot = slot;
  v.version = l.snap.version;
  v.tiles = l.tiles;
  v.layout = l.layout;
  v.epoch = l.epoch;
  v.identity = LaunchIdentity(t.checksum, l.epoch);
  v.deadline = l.deadline;
  v.timeout_s = l.timeout_s;
  v.buffers.assign(n, RankBuffers{nullptr, nullptr, nullptr, l.period_elems, t.chunks_per_period,
                                  static_cast<int32_t>(l.esize), l.tiles});
  v.memory = MemoryKind::kCuda;  // staging and direct sends are device memory
  spec.regions = l.mapped;
  spec.staging = l.staging;
  std::string error;
  if (!core->start_mapped_proxy(spec, l.group, &l.proxy, &error)) return ffi::Error::Internal(error);
  return ffi::Error::Success();
}

ffi::ErrorOr<std::shared_ptr<CudaLaunch>> StartLaunch(int64_t slot, int64_t group, int32_t axis_size,
                                                      const std::vector<CudaArrival>& arrivals,
                                                      std::shared_ptr<const ProcessGroup> processes) {
  using R = std::shared_ptr<CudaLaunch>;
  const CoreApi* core = AttachedCore();
  auto launch = std::make_shared<CudaLaunch>();
  launch->group = std::move(processes);
  launch->arrivals = arrivals;
  std::vector<LaunchArrival> calls(axis_size);
  for (int32_t r = 0; r < axis_size; ++r) {
    const CudaArrival& a = arrivals[r];
    calls[r] = ArrivalOf(a.in_dtype, a.out_dtype, a.in_elems, a.out_elems, a.reduce_op, a.seq);
    calls[r].present = launch->Local(r);
  }
  std::string error;
  if (!core->acquire(slot, AgreedSequence(calls), &launch->snap, &error)) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(error));
  }
  const Table& t = *launch->snap.table;
  LaunchOptions options;  // a GPU always pipelines
  options.slot = slot;
  options.version = launch->snap.version;
  LaunchPlan plan;
  if (LaunchError e = PlanLaunch(t, calls, options, &plan); !e.ok()) return ErrorResult<R>(LaunchRefusal(e));
  for (int32_t r = 0; r < axis_size; ++r) {
    for (int32_t q = 0; q < r; ++q) {
      if (calls[q].present && calls[r].present && arrivals[q].device == arrivals[r].device) {
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl (cuda): ranks ", q, " and ", r, " are both on GPU ", arrivals[r].device)));
      }
    }
  }
  launch->period_elems = plan.period_elems;
  launch->esize = static_cast<size_t>(plan.esize);
  launch->reduction = plan.reduction;
  {
    const MeasureSettings settings = MeasureSettingsNow();
    MeasureSnapshot& m = launch->measure;
    m.on = settings.enabled && !t.has_reduction;  // MCCL Sec. 5: collectives without reduction only
    if (m.on) {
      if (!settings.host_of_rank.empty() && static_cast<int32_t>(settings.host_of_rank.size()) != axis_size) {
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl (cuda): measurement is configured with host ids for ", settings.host_of_rank.size(),
                   " ranks but this collective has ", axis_size, "; call measure_configure with ", axis_size,
                   " host ids (or none: all ranks on one host)")));
      }
      m.host_of_rank = settings.host_of_rank;
      m.host_of_rank.resize(axis_size, 0);
      m.intra_threshold = settings.intra_threshold;
      m.inter_threshold = settings.inter_threshold;
      m.slots_per_tb = settings.slots_per_tb;
      m.min_window_bytes = settings.min_window_bytes;
    }
  }
  launch->stage_bytes = (plan.largest_staged + 255) / 256 * 256;
  launch->tiles = plan.tiles;
  launch->layout = plan.layout;
  launch->regions.assign(axis_size, nullptr);
  launch->timeout_s = core->timeout_s();
  launch->deadline = DeadlineAfter(launch->timeout_s);
  {
    std::lock_guard<std::mutex> lock(WorkspaceMutex());
    launch->epoch = ++Epochs()[{slot, group}];
  }
  if (launch->group) {
    if (ffi::Error e = StartProxy(slot, group, *launch); e.failure()) return ErrorResult<R>(std::move(e));
  }
  return launch;
}

// Where a rank's kernel runs: its flag region (what peers write into; across processes its host-mapped
// region's host address) and its staging (device memory).
struct RankMemory {
  char* region = nullptr;
  char* staging = nullptr;
};

// Grows the device's workspace for this launch and uploads the rank's program.
ffi::ErrorOr<RankMemory> PrepareWorkspace(int64_t slot, int32_t rank, const CudaLaunch& l, cudaStream_t stream,
                                          Workspace** out, MeasureArgs* measure) {
  using R = RankMemory;
  const CudaArrival& me = l.arrivals[rank];
  const Table& t = *l.snap.table;
  const RegionLayout layout = l.layout;
  const ProgramView program(t.programs[rank].data());
  // Across processes the regions are host-mapped (StartProxy): the device workspace holds staging only.
  const size_t region_bytes = l.group ? 0 : 2 * layout.bytes();
  const size_t need = region_bytes + static_cast<size_t>(program.num_staged_conns()) * t.num_slots * l.stage_bytes;
  std::lock_guard<std::mutex> lock(WorkspaceMutex());
  auto& ws = WorkspacesLocked()[{slot, me.device}];
  if (!ws) ws = std::make_unique<Workspace>();
  ws->device = me.device;
  auto fail = [](cudaError_t e, const char* what) {
    return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl (cuda): ", what, " failed: ", cudaGetErrorString(e))));
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
  if (l.group) {
    ws->owner = RegionOwner{};  // staging data where a launch in one process would read regions: it clears them
    ws->owned = true;
  } else {
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
  }
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
      if (!l.Local(p)) measure->remote_peers |= 1ull << p;
    }
  }
  *out = ws.get();
  if (l.group) return RankMemory{l.mapped[rank], ws->base};
  return RankMemory{ws->base + (l.epoch & 1) * layout.bytes(), ws->base + region_bytes};
}

// The kernel's error words (code, threadblock, op) as an error of rank `rank` (Success: none).
ffi::Error KernelError(int32_t rank, const int32_t* error, double timeout_s) {
  const int32_t code = error[0];
  if (code == kProtocolOk) return ffi::Error::Success();
  const std::string what =
      StrCat("rank ", rank, ", threadblock ", error[1], ", op ", error[2], " ", ErrorWhat(code));
  if (code >= kTimeoutDependency && code <= kTimeoutDrain) {
    return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                      StrCat("jaxccl (cuda): deadline exceeded: ", what, " within ", Seconds(timeout_s)));
  }
  return ffi::Error::Internal(StrCat("jaxccl (cuda): ", what));
}

// Runs rank `rank`'s kernel of launch `l` once every local rank published its region; `error` gets the
// kernel's error words. A failure before the kernel ran is returned.
ffi::Error RunKernel(cudaStream_t stream, int64_t slot, int64_t site, int32_t rank, CudaLaunch& l, int32_t* error) {
  const Table& t = *l.snap.table;
  const int32_t n = t.num_ranks;
  const CudaArrival& me = l.arrivals[rank];

  // Phase 2: every rank publishes its workspace region; peers need all of them before any kernel runs.
  Workspace* ws = nullptr;
  MeasureArgs measure{};
  auto memory = PrepareWorkspace(slot, rank, l, stream, &ws, &measure);
  for (int32_t r = 0; r < n && memory.has_value(); ++r) {
    if (!l.Local(r)) continue;
    if (ffi::Error e = EnablePeerAccess(me.device, l.arrivals[r].device); e.failure()) {
      memory = ErrorResult<RankMemory>(std::move(e));
    }
  }
  int resident = 0;
  if (memory.has_value() && MaxResidentBlocks(me.device, &resident) == cudaSuccess &&
      resident < t.rank_num_tbs[rank]) {
    memory = ErrorResult<RankMemory>(ffi::Error::InvalidArgument(
        StrCat("jaxccl (cuda): rank ", rank, " has ", t.rank_num_tbs[rank], " threadblocks but only ", resident,
               " interpreter blocks fit on GPU ", me.device, " at once")));
  }
  {
    std::unique_lock<std::mutex> lock(l.mu);
    if (!memory.has_value()) {
      if (l.failure.empty()) l.failure = StrCat("rank ", rank, ": ", memory.error().message());
    } else {
      l.regions[rank] = memory->region;
    }
    ++l.published;
    l.cv.notify_all();
    const bool all = l.cv.wait_until(lock, l.deadline, [&] { return l.published == l.num_local(); });
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
  // Across processes the kernel's own deadline comes kMappedRankGraceS after the proxy's, so that a stuck launch
  // fails with the proxy's error, which names the process (transport/mapped_launch.h).
  args.timeout_ns = static_cast<unsigned long long>((l.timeout_s + (l.group ? kMappedRankGraceS : 0.0)) * 1e9);
  args.layout = l.layout;
  args.staging = memory->staging;
  args.stage_bytes = l.stage_bytes;
  for (int32_t r = 0; r < n; ++r) {
    if (!l.group) {
      args.regions[r] = l.regions[r];
      continue;
    }
    auto dev = DeviceAddress(l.mapped[r]);  // this device's address of a host-mapped region
    if (!dev.has_value()) return std::move(dev.error());
    args.regions[r] = *dev;
  }
  args.measure = measure;
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(ws->args_dev, &args, sizeof(args), cudaMemcpyHostToDevice, stream));
  char* error_word = args.regions[rank] + args.layout.error();
  // Across processes the error word was zeroed before the proxy started (it may store kPeerFailed any time).
  if (!l.group) JAXCCL_CUDA_CHECK(cudaMemsetAsync(error_word, 0, 16, stream));
  JAXCCL_CUDA_CHECK(LaunchInterpreter(ws->args_dev, t.rank_num_tbs[rank], 1, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));  // the arguments' host copy lives on this stack
  if (l.group) {
    const volatile int32_t* words = reinterpret_cast<const volatile int32_t*>(l.mapped[rank] + args.layout.error());
    for (int i = 0; i < 3; ++i) error[i] = words[i];
  } else {
    JAXCCL_CUDA_CHECK(cudaMemcpyAsync(ws->error_host, error_word, 16, cudaMemcpyDeviceToHost, stream));
    JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < 3; ++i) error[i] = ws->error_host[i];
  }
  return ffi::Error::Success();
}

// Across processes, after rank `rank`'s kernel (or its failure `result`): a failure of this process aborts
// the proxy, the proxy's failure comes first, and the last local rank destroys the proxy.
ffi::Error FinishAcrossProcesses(int32_t rank, CudaLaunch& l, const int32_t* error, ffi::Error result) {
  ProxyHandle& proxy = *l.proxy;
  const bool peer_failed = error[0] == kPeerFailed;  // the kernel ran and stopped for the proxy's failure
  if (result.failure() && !peer_failed) {
    proxy.Abort(result.message(), result.errc().value_or(ffi::ErrorCode::kInternal));
  }
  proxy.WaitDone();
  if (ffi::Error failure = proxy.Failure(); failure.failure()) {
    // The kernel stopped for the proxy's failure (or it won over the kernel's own): the proxy's error says it.
    // kPeerFailed comes from the proxy, which names no threadblock.
    result = peer_failed ? ffi::Error(failure.errc().value_or(ffi::ErrorCode::kInternal),
                                      StrCat("jaxccl (cuda): rank ", rank, " stopped: ", ErrorWhat(kPeerFailed), ": ",
                                             failure.message()))
                         : std::move(failure);
  }
  std::unique_ptr<ProxyHandle> last;
  {
    std::lock_guard<std::mutex> lock(l.mu);
    if (++l.finished == l.num_local()) last = std::move(l.proxy);
  }
  if (last) {
    last.reset();  // joins the proxy's thread: it no longer touches the regions or the staging
    l.staging->Trim();
  }
  return result;
}

}  // namespace

const char* ErrorWhat(int32_t code) {
  switch (code) {
    case kTimeoutDependency: return "waited for a dependency that did not complete";
    case kTimeoutMessage: return "waited for a message that never arrived (deadlock or a failed peer)";
    case kTimeoutSlot: return "waited for a free slot: its connection stayed full";
    case kTimeoutDrain: return "waited for its messages to be consumed";
    case kSizeMismatch: return "received a message of the wrong size";
    case kStaleMessage: return "received a message of another table or launch (stale message, refused)";
    case kPeerFailed: return "a process it exchanges messages with failed (the proxy's error follows)";
    default: return "failed";
  }
}

ffi::Error RunLaunch(cudaStream_t stream, int64_t run_id, int64_t slot, int64_t site, int32_t group, int32_t rank,
                     int32_t axis_size, const CudaArrival& me, std::shared_ptr<const ProcessGroup> processes) {
  const CoreApi* core = AttachedCore();
  const int32_t n = axis_size;
  CudaArrival arrival = me;
  std::string not_issued;  // the call's number on its slot: the hot-swap transition point (host/core_api.h)
  if (!core->note_issued(slot, rank, &arrival.seq, &not_issued)) {
    // The ranks already waiting for this one learn it now instead of at the deadline.
    if (processes) {
      ProcessRendezvous().Abandon(run_id, site, group, processes->local_index[rank], processes->num_local,
                                  core->timeout_s(), not_issued);
    } else {
      TheRendezvous().Abandon(run_id, site, group, rank, n, core->timeout_s(), not_issued);
    }
    return ffi::Error::InvalidArgument(not_issued);
  }
  auto started =
      processes ? ProcessRendezvous().Arrive(run_id, site, group, processes->local_index[rank], processes->num_local,
                                             arrival, core->timeout_s(),
                                             [&](const std::vector<CudaArrival>& local) {
                                               std::vector<CudaArrival> all(n);
                                               for (int32_t r = 0; r < n; ++r) {
                                                 if (processes->Local(r)) all[r] = local[processes->local_index[r]];
                                               }
                                               return StartLaunch(slot, group, n, all, processes);
                                             })
                : TheRendezvous().Arrive(run_id, site, group, rank, n, arrival, core->timeout_s(),
                                         [&](const std::vector<CudaArrival>& all) {
                                           return StartLaunch(slot, group, n, all, nullptr);
                                         });
  if (!started.has_value()) return std::move(started.error());
  CudaLaunch& l = **started;
  int32_t error[3] = {kProtocolOk, 0, 0};
  ffi::Error result = RunKernel(stream, slot, site, rank, l, error);
  if (result.success()) result = KernelError(rank, error, l.timeout_s);
  if (!l.group) return result;
  return FinishAcrossProcesses(rank, l, error, std::move(result));
}

}  // namespace cuda
}  // namespace jaxccl
