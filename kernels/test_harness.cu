// The CUDA executor's test entry: one call of a schedule slot with every rank of its table on the current
// GPU, in one kernel (grid y = rank), through the launch agreement (core/launch.h) the FFI handler uses.
#include "test_harness.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "core/launch.h"
#include "handler.h"
#include "host/common.h"
#include "host/core_api.h"
#include "interpreter.cuh"
#include "launch.h"

namespace jaxccl {
namespace cuda {
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
  const CoreApi* core = AttachedCore();
  if (core == nullptr) {
    r.error = "jaxccl (cuda test): the CUDA module is not attached to jaxccl._native";
    return r;
  }
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    r.error = StrCat("jaxccl (cuda test): num_ranks must be in 1..", kMaxRanks);
    return r;
  }
  // Every rank's call, as the FFI handler would see it: one element type (its output sized by the plan).
  std::vector<LaunchArrival> calls(num_ranks);
  for (int32_t k = 0; k < num_ranks; ++k) {
    LaunchArrival& a = calls[k];
    if (!core->note_issued(slot, k, &a.seq, &r.error)) return r;
    a.in_elems = in_elems;
    a.out_elems = -1;
    a.in_dtype = a.out_dtype = 0;
    a.in_dtype_name = a.out_dtype_name = "(test_run's element type)";
    a.esize = esize;
    a.elem = reduction.type;
    a.reduce_op = reduction.op;
  }
  r.seq = AgreedSequence(calls);
  TableSnapshot snap;
  if (!core->acquire(slot, r.seq, &snap, &r.error)) return r;
  r.version = snap.version;
  const Table& t = *snap.table;
  LaunchOptions options;
  options.tiles = tiles;
  options.slot = slot;
  options.version = snap.version;
  LaunchPlan plan;
  if (LaunchError e = PlanLaunch(t, calls, options, &plan); !e.ok()) {
    r.error = StrCat("jaxccl (cuda test): ", e.message);
    return r;
  }
  r.tiles = plan.tiles;
  const RegionLayout layout = plan.layout;
  const size_t stage_bytes = (plan.largest_staged + 255) / 256 * 256;
  const size_t in_bytes = static_cast<size_t>(in_elems) * esize;
  const size_t out_bytes = static_cast<size_t>(plan.out_elems) * esize;
  const size_t scratch_bytes = plan.scratch_bytes;
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
    a.reduction = plan.reduction;
    a.buffers = RankBuffers{in, outs[k], scratch, plan.period_elems, t.chunks_per_period, esize, r.tiles};
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
