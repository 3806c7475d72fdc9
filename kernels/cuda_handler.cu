// Host side of the CUDA executor: rendezvous of the per-device calls, peer access,
// per-(slot, device) workspaces, the per-rank program upload, and the launch.
//
// Per call: read coords (one small device-to-host copy), meet the other ranks
// (the last one picks the table version and the launch epoch), size this device's
// workspace for the table, publish its address, wait for every rank's address,
// launch the interpreter on the stream and wait for it to report (the kernel's
// own waits are bounded by the deadline, so this returns).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "common.h"
#include "core_api.h"
#include "cuda_handler.h"
#include "dtype.h"
#include "interpreter.cuh"
#include "rendezvous.h"
#include "table.h"

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
};

// What the last rank decided for everybody, plus the second exchange (workspace addresses).
struct CudaLaunch {
  TableSnapshot snap;
  unsigned long long epoch = 0;
  int64_t period_elems = 0;
  size_t esize = 0;
  SumType sum = SumType::kNone;
  size_t stage_bytes = 0;
  std::vector<CudaArrival> arrivals;
  Clock::time_point deadline;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<char*> regions;  // per rank, this epoch's region
  int32_t published = 0;
  std::string failure;
};

struct Workspace {
  int device = -1;
  char* base = nullptr;  // two regions, then staging
  size_t bytes = 0;
  const Table* program_of = nullptr;  // the table whose per-rank program is on the device
  int32_t program_rank = -1;
  std::shared_ptr<const Table> keep;  // keeps the host words alive while the copy is in flight
  std::vector<int32_t> program;
  int32_t* program_dev = nullptr;
  size_t program_capacity = 0;
  int32_t* error_host = nullptr;  // pinned
  char* scratch = nullptr;
  size_t scratch_bytes = 0;
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

using CudaRendezvous = Rendezvous<CudaArrival, CudaLaunch>;
CudaRendezvous& TheRendezvous() {
  static auto* r = new CudaRendezvous();
  return *r;
}

std::vector<int32_t> BuildProgram(const Table& t, int32_t rank) {
  const int32_t first_tb = t.rank_first_tb[rank], ntb = t.rank_num_tbs[rank];
  const int32_t first_op = ntb > 0 ? t.tbs[first_tb].first_op : 0;
  int32_t nops = 0, max_tbs = 0, staged = 0;
  for (int32_t r = 0; r < t.num_ranks; ++r) max_tbs = std::max(max_tbs, t.rank_num_tbs[r]);
  for (int32_t j = 0; j < ntb; ++j) nops += t.tbs[first_tb + j].num_ops;
  std::vector<int32_t> p(kProgHeader + ntb * kProgTb + nops * kProgOp + t.num_conns(), 0);
  int32_t* staged_index = p.data() + kProgHeader + ntb * kProgTb + nops * kProgOp;
  for (int32_t k = 0; k < t.num_conns(); ++k) staged_index[k] = t.conns[k].num_staged > 0 ? staged++ : -1;
  p[0] = ntb;
  p[1] = nops;
  p[2] = t.num_conns();
  p[3] = max_tbs;
  p[4] = staged;
  for (int32_t j = 0; j < ntb; ++j) {
    const TableTb& tb = t.tbs[first_tb + j];
    int32_t* row = p.data() + kProgHeader + j * kProgTb;
    int32_t sends = 0;
    for (int32_t i = 0; i < tb.num_ops; ++i) sends += OpSends(t.ops[tb.first_op + i].kind) ? 1 : 0;
    const int32_t vals[kProgTb] = {tb.first_op - first_op, tb.num_ops, tb.send_conn, tb.recv_conn,
                                   tb.send_peer,           tb.recv_peer, sends,      0};
    std::memcpy(row, vals, sizeof(vals));
    for (int32_t i = 0; i < tb.num_ops; ++i) {
      const TableOp& op = t.ops[tb.first_op + i];
      int32_t* o = p.data() + kProgHeader + ntb * kProgTb + (tb.first_op - first_op + i) * kProgOp;
      const int32_t ov[kProgOp] = {static_cast<int32_t>(op.kind), static_cast<int32_t>(op.src_buf), op.src_off,
                                   static_cast<int32_t>(op.dst_buf), op.dst_off, op.count, op.dep_tb, op.dep_op,
                                   op.flags, op.send_msg, op.recv_msg, 0};
      std::memcpy(o, ov, sizeof(ov));
    }
  }
  return p;
}

int32_t NumStagedConns(const Table& t) {
  int32_t k = 0;
  for (const TableConn& c : t.conns) k += c.num_staged > 0 ? 1 : 0;
  return k;
}

// Largest staged message of the table for period length L.
size_t MaxStagedBytes(const Table& t, int64_t period_elems, size_t esize) {
  int64_t most = 0;
  for (const TableOp& op : t.ops) {
    if (!OpSends(op.kind) || op.direct()) continue;
    const int32_t off = (op.kind == OpCode::kRecvCopySend || op.kind == OpCode::kRecvReduceCopySend) ? op.dst_off
                                                                                                     : op.src_off;
    most = std::max(most, ChunkStart(off + op.count, t.chunks_per_period, period_elems) -
                              ChunkStart(off, t.chunks_per_period, period_elems));
  }
  return static_cast<size_t>(most) * esize;
}

RegionLayout LayoutOf(const Table& t) {
  int32_t max_tbs = 0;
  for (int32_t r = 0; r < t.num_ranks; ++r) max_tbs = std::max(max_tbs, t.rank_num_tbs[r]);
  return RegionLayout{max_tbs, t.num_conns(), t.num_slots};
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
  if (!core->acquire(slot, &launch->snap, &error)) return ErrorResult<R>(ffi::Error::InvalidArgument(error));
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
    switch (a0.in_dtype) {
      case ffi::DataType::F32: launch->sum = SumType::kF32; break;
      case ffi::DataType::BF16: launch->sum = SumType::kBF16; break;
      case ffi::DataType::F16: launch->sum = SumType::kF16; break;
      case ffi::DataType::S32: launch->sum = SumType::kS32; break;
      default:
        return ErrorResult<R>(ffi::Error::InvalidArgument(
            StrCat("jaxccl: reductions support F32, BF16, F16 and S32; got ", DTypeName(a0.in_dtype))));
    }
  }
  launch->stage_bytes = (MaxStagedBytes(t, *period, launch->esize) + 255) / 256 * 256;
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
                                     Workspace** out) {
  const CudaArrival& me = l.arrivals[rank];
  const Table& t = *l.snap.table;
  const RegionLayout layout = LayoutOf(t);
  const size_t need = 2 * layout.bytes() + static_cast<size_t>(NumStagedConns(t)) * t.num_slots * l.stage_bytes;
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
    if ((e = cudaMemset(ws->base, 0, need)) != cudaSuccess) return fail(e, "cudaMemset(workspace)");
    ws->bytes = need;
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
  if (ws->program_of != &t || ws->program_rank != rank) {
    ws->program = BuildProgram(t, rank);
    const size_t bytes = ws->program.size() * sizeof(int32_t);
    if (ws->program_capacity < bytes) {
      if (ws->program_dev != nullptr && (e = cudaFree(ws->program_dev)) != cudaSuccess) return fail(e, "cudaFree");
      ws->program_dev = nullptr;
      if ((e = cudaMalloc(&ws->program_dev, bytes)) != cudaSuccess) return fail(e, "cudaMalloc(program)");
      ws->program_capacity = bytes;
    }
    if ((e = cudaMemcpyAsync(ws->program_dev, ws->program.data(), bytes, cudaMemcpyHostToDevice, stream)) !=
        cudaSuccess) {
      return fail(e, "cudaMemcpyAsync(program)");
    }
    ws->program_of = &t;
    ws->program_rank = rank;
    ws->keep = l.snap.table;
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
    default: return "failed";
  }
}

ffi::Error CudaCollective(cudaStream_t stream, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                          ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size) {
  const CoreApi* core = g_core.load();
  if (core == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxccl (cuda): the CUDA module is not attached to jaxccl._native (import jaxccl.runtime.native)");
  }
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
  me.device = device;
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
  auto region = PrepareWorkspace(slot, rank, l, stream, &ws);
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
  args.chunks_per_period = t.chunks_per_period;
  args.num_slots = t.num_slots;
  args.esize = static_cast<int32_t>(l.esize);
  args.period_elems = l.period_elems;
  args.sum = l.sum;
  args.epoch = l.epoch;
  args.timeout_ns = static_cast<unsigned long long>(core->timeout_s() * 1e9);
  args.layout = LayoutOf(t);
  args.in = static_cast<char*>(const_cast<void*>(me.in));
  args.out = static_cast<char*>(me.out);
  args.staging = *region + (2 - (l.epoch & 1)) * args.layout.bytes();
  args.stage_bytes = l.stage_bytes;
  for (int32_t r = 0; r < n; ++r) args.regions[r] = l.regions[r];
  args.scratch = ws->scratch;
  char* error_dev = *region + args.layout.error();
  JAXCCL_CUDA_CHECK(cudaMemsetAsync(error_dev, 0, 16, stream));
  JAXCCL_CUDA_CHECK(LaunchInterpreter(args, t.rank_num_tbs[rank], stream));
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(ws->error_host, error_dev, 16, cudaMemcpyDeviceToHost, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t code = ws->error_host[0];
  if (code == kSizeMismatch) {
    return ffi::Error::Internal(StrCat("jaxccl (cuda): rank ", rank, ", threadblock ", ws->error_host[1], ", op ",
                                       ws->error_host[2], " ", ErrorWhat(code)));
  }
  if (code != kOk) {
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
                                  .Attr<int64_t>("axis_size"));

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

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace jaxccl
