#include "interpreter.cuh"

namespace jaxccl {
namespace cuda {
namespace {

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long LoadVolatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

__device__ __forceinline__ void StoreVolatile(unsigned long long* p, unsigned long long v) {
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

// One rank's flag region (core/protocol.h, RegionLayout).
struct Region {
  char* base;
  RegionLayout layout;
  __device__ unsigned long long* op_done() const {
    return reinterpret_cast<unsigned long long*>(base + layout.op_done());
  }
  __device__ unsigned long long* posted() const { return reinterpret_cast<unsigned long long*>(base + layout.posted()); }
  __device__ unsigned long long* consumed() const {
    return reinterpret_cast<unsigned long long*>(base + layout.consumed());
  }
  __device__ MsgDesc* msgs() const { return reinterpret_cast<MsgDesc*>(base + layout.msgs()); }
  __device__ int32_t* error() const { return reinterpret_cast<int32_t*>(base + layout.error()); }
};

// The GPU's view of the flags for the core's readiness rule (thread 0 only).
struct GpuProbe {
  Region me;
  unsigned long long epoch;
  int32_t op_stride, num_slots;
  __device__ bool Done(int32_t tile, int32_t o) const {
    return LoadVolatile(me.op_done() + static_cast<size_t>(tile) * op_stride + o) >= Tag(epoch, 1);
  }
  __device__ bool Posted(int32_t conn, int32_t m) const {
    return LoadVolatile(me.posted() + me.layout.cell(conn, m)) >= Tag(epoch, m + 1);
  }
  __device__ bool SlotFree(int32_t conn, int32_t m) const {
    return LoadVolatile(me.consumed() + me.layout.cell(conn, m)) >= Tag(epoch, m - num_slots + 1);
  }
};

// Byte moves of a block: every thread takes its lanes; 16-byte vectors when everything is aligned.
struct GpuMover {
  __device__ void Copy(char* dst, const char* src, size_t bytes) const {
    if (bytes == 0 || dst == src) return;
    const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes;
    if (align % 16 == 0) {
      uint4* d = reinterpret_cast<uint4*>(dst);
      const uint4* s = reinterpret_cast<const uint4*>(src);
      for (size_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d[i] = s[i];
    } else if (align % 4 == 0) {
      uint32_t* d = reinterpret_cast<uint32_t*>(dst);
      const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
      for (size_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) d[i] = s[i];
    } else {
      for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
    }
  }
  __device__ void Reduce(Reduction r, char* dst, const char* a, const char* b, size_t n) const {
    ReduceLanes(r, dst, a, b, n, threadIdx.x, blockDim.x);
  }
  __device__ void Barrier() const { __syncthreads(); }
};

// Thread 0's meter of a sending block (see interpreter.cuh).
struct GpuMeter {
  MeterWindow* acc;  // nullptr: off
  MeterCache* cache;
  const unsigned long long* consumed;  // consumed[send_conn][*] in this rank's region
  unsigned long long epoch;
  int32_t num_slots, threshold, src, dst, in_flight;
  LinkKind kind;
  long long min_window_bytes;
  int32_t msg[kMeterMaxSlots];
  long long bytes[kMeterMaxSlots];

  __device__ void Lock() const {
    while (atomicCAS(&acc->lock, 0, 1) != 0) {
    }
    __threadfence();
  }
  __device__ void Unlock() const {
    __threadfence();
    atomicExch(&acc->lock, 0);
  }
  __device__ void OnPost(int32_t m, long long b) {
    if (acc == nullptr) return;
    const int64_t now = static_cast<int64_t>(GlobalTimer());
    Lock();
    MeterOnPost(acc, threshold, in_flight == 0, false, now, now);
    Unlock();
    msg[m % num_slots] = m;
    bytes[m % num_slots] = b;
    ++in_flight;
  }
  // Credits the messages seen consumed since the last poll (local loads only).
  __device__ void Poll() {
    if (acc == nullptr || in_flight == 0) return;
    for (int32_t s = 0; s < num_slots; ++s) {
      if (msg[s] < 0 || LoadVolatile(consumed + s) < Tag(epoch, msg[s] + 1)) continue;
      msg[s] = -1;
      --in_flight;
      Lock();
      const double bw = MeterOnDelivered(acc, threshold, min_window_bytes, bytes[s], in_flight == 0,
                                         static_cast<int64_t>(GlobalTimer()));
      Unlock();
      if (bw > 0) cache->Add(src, dst, kind, bw);
    }
  }
};

// Moves the cache into this threadblock's slots of the host-mapped Measurements Buffer, never waiting: records
// go into consecutive slots from the cursor while their flag is 0 (the host frees a slot by storing 0), the
// rest are dropped and counted.
__device__ void FlushMeasurements(const MeasureArgs& m, int32_t tb, const MeterCache& c) {
  if (c.empty()) return;
  const unsigned int slots = static_cast<unsigned int>(m.slots_per_tb);
  volatile MeasurementRecord* region = m.records + static_cast<size_t>(tb) * slots;
  const unsigned int cursor = m.cursor[tb];
  unsigned int w = cursor;
  int32_t k = 0;
  unsigned long long windows = c.overflow;
  for (int32_t j = 0; j < c.size; ++j) windows += c.entries[j].count;
  for (; k < c.size && w - cursor < slots; ++k, ++w) {
    volatile MeasurementRecord* r = region + w % slots;
    if (r->flag != 0) break;
    const MeasurementCacheEntry& e = c.entries[k];
    r->src = e.src;
    r->dst = e.dst;
    r->kind = e.kind;
    r->count = e.count;
    r->tb = tb;
    r->sum_bw = e.sum_bw;
  }
  if (w != cursor) {
    __threadfence_system();  // every record's fields reach the host before any of their flags
    for (unsigned int s = cursor; s != w; ++s) region[s % slots].flag = 1;
  }
  MeasureCounters& d = m.counters_dev[tb];
  d.records += w - cursor;
  d.dropped += static_cast<unsigned long long>(c.size - k) + static_cast<unsigned long long>(c.overflow);
  d.windows += windows;
  volatile MeasureCounters* h = m.counters_host + tb;
  h->records = d.records;
  h->dropped = d.dropped;
  h->windows = d.windows;
  m.cursor[tb] = w;
}

__device__ void RecordError(const Region& me, int32_t code, int32_t tb, int32_t op) {
  int32_t* e = me.error();
  if (atomicCAS(e, kProtocolOk, code) == kProtocolOk) {
    e[1] = tb;
    e[2] = op;
    __threadfence_system();
  }
}

__device__ __forceinline__ bool Failed(const Region& me) {
  return *reinterpret_cast<volatile int32_t*>(me.error()) != kProtocolOk;
}

constexpr int32_t kFailed = -3;

__global__ void __launch_bounds__(kThreads) InterpreterKernel(const KernelArgs* all) {
  const KernelArgs& a = all[blockIdx.y];
  const ProgramView p(a.prog);
  const int32_t t = blockIdx.x;
  if (t >= p.num_tbs()) return;
  const ProgTb tb = p.tb(t);
  const Region me{a.regions[a.rank], a.layout};
  const unsigned long long deadline = GlobalTimer() + a.timeout_ns;
  const int32_t num_slots = p.num_slots();
  __shared__ int32_t s_unit;
  __shared__ MsgDesc s_msg;
  __shared__ MeterCache s_cache;

  GpuProbe probe{me, a.epoch, p.max_ops(), num_slots};
  GpuMeter meter{};
  if (threadIdx.x == 0) {
    s_cache.Clear();
    const MeasureArgs& m = a.measure;
    if (m.acc != nullptr && tb.send_conn >= 0 && tb.num_sends > 0 && num_slots <= kMeterMaxSlots &&
        ((m.remote_peers >> tb.send_peer) & 1ull) == 0) {
      const bool intra = ((m.intra_peers >> tb.send_peer) & 1ull) != 0;
      meter.acc = m.acc + (intra ? 0 : 1 + tb.send_peer);
      meter.cache = &s_cache;
      meter.consumed = me.consumed() + me.layout.cell(tb.send_conn, 0);
      meter.epoch = a.epoch;
      meter.num_slots = num_slots;
      meter.threshold = intra ? m.intra_threshold : m.inter_threshold;
      meter.src = a.rank;
      meter.dst = intra ? -1 : tb.send_peer;
      meter.kind = intra ? LinkKind::kIntra : LinkKind::kInter;
      meter.min_window_bytes = m.min_window_bytes;
      for (int32_t s = 0; s < kMeterMaxSlots; ++s) meter.msg[s] = -1;
    }
  }
  int32_t first = 0;
  for (;;) {
    if (threadIdx.x == 0) {
      unsigned sleep_ns = 32;
      int32_t v = kNoneReady;
      for (;;) {
        v = NextReadyUnit(p, tb, a.tiles, &first, probe);
        meter.Poll();
        if (v != kNoneReady) break;
        if (Failed(me)) {
          v = kFailed;
          break;
        }
        if (GlobalTimer() > deadline) {
          const Unit u = UnitOf(p, tb, first);
          RecordError(me, StuckReason(p, tb, u, p.op(u.op), probe), t, u.op - tb.first_op);
          v = kFailed;
          break;
        }
        __nanosleep(sleep_ns);
        const unsigned most = meter.acc != nullptr && meter.in_flight > 0 ? 256 : 4096;
        sleep_ns = sleep_ns * 2 > most ? most : sleep_ns * 2;
      }
      if (v >= 0) {
        const Unit u = UnitOf(p, tb, v);
        if (u.recv_msg >= 0) {
          __threadfence_system();
          const volatile MsgDesc* d = me.msgs() + me.layout.cell(tb.recv_conn, u.recv_msg);
          s_msg.ptr = d->ptr;
          s_msg.bytes = d->bytes;
          s_msg.identity = d->identity;
          const int32_t refused = MessageError(s_msg, a.identity, a.buffers.RecvBytes(p.op(u.op), u.tile));
          if (refused != kProtocolOk) {
            RecordError(me, refused, t, u.op - tb.first_op);
            v = kFailed;
          }
        }
      }
      s_unit = v;
    }
    __syncthreads();
    const int32_t v = s_unit;
    if (v < 0) break;
    const Unit u = UnitOf(p, tb, v);
    const ProgOp op = p.op(u.op);
    char* stage = nullptr;
    if (op.sends() && !op.direct()) {
      stage = a.staging + StageOffset(p, tb.send_conn, u.send_msg, a.stage_bytes);
    }
    GpuMover mover;
    const Outgoing out =
        RunOpData(op, u.tile, a.buffers, a.reduction, reinterpret_cast<const char*>(s_msg.ptr), s_msg.bytes, stage, mover);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // data written by this block is visible to peers before any flag
      if (u.recv_msg >= 0) {
        const Region sender{a.regions[tb.recv_peer], a.layout};
        StoreVolatile(sender.consumed() + a.layout.cell(tb.recv_conn, u.recv_msg), Tag(a.epoch, u.recv_msg + 1));
      }
      if (u.send_msg >= 0) {
        const Region receiver{a.regions[tb.send_peer], a.layout};
        volatile MsgDesc* d = receiver.msgs() + a.layout.cell(tb.send_conn, u.send_msg);
        d->ptr = reinterpret_cast<unsigned long long>(out.ptr);
        d->bytes = out.bytes;
        d->identity = a.identity;
        __threadfence_system();
        StoreVolatile(receiver.posted() + a.layout.cell(tb.send_conn, u.send_msg), Tag(a.epoch, u.send_msg + 1));
        meter.OnPost(u.send_msg, static_cast<long long>(out.bytes));
      }
      __threadfence();
      StoreVolatile(me.op_done() + static_cast<size_t>(u.tile) * p.max_ops() + u.op, Tag(a.epoch, 1));
    }
    __syncthreads();
  }
  // A rank leaves only after its messages were consumed: receivers read its buffers and staging in place.
  if (threadIdx.x == 0 && tb.send_conn >= 0 && tb.num_sends > 0 && !Failed(me)) {
    const int32_t total = a.tiles * tb.num_sends;
    for (int32_t s = 0; s < num_slots; ++s) {
      const int32_t last = LastMessageOfSlot(s, total, num_slots);
      if (last < 0) break;
      const unsigned long long* flag = me.consumed() + a.layout.cell(tb.send_conn, s);
      unsigned sleep_ns = 32;
      while (LoadVolatile(flag) < Tag(a.epoch, last + 1)) {
        meter.Poll();
        if (Failed(me)) break;
        if (GlobalTimer() > deadline) {
          RecordError(me, kTimeoutDrain, t, tb.num_ops);
          break;
        }
        __nanosleep(sleep_ns);
        sleep_ns = sleep_ns * 2 > 256 ? 256 : sleep_ns * 2;
      }
    }
    meter.Poll();
    if (meter.acc != nullptr && !Failed(me)) FlushMeasurements(a.measure, t, s_cache);
  }
}

}  // namespace

cudaError_t LaunchInterpreter(const KernelArgs* args_dev, int max_tbs, int ranks, cudaStream_t stream) {
  if (max_tbs == 0 || ranks == 0) return cudaSuccess;
  InterpreterKernel<<<dim3(max_tbs, ranks), kThreads, 0, stream>>>(args_dev);
  return cudaGetLastError();
}

cudaError_t MaxResidentBlocks(int device, int* blocks) {
  int per_sm = 0, sms = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, InterpreterKernel, kThreads, 0);
  if (e != cudaSuccess) return e;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  *blocks = per_sm * sms;
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace jaxccl
