#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "interpreter.cuh"

namespace jaxccl {
namespace cuda {
namespace {

// Op kind codes (xla_ffi/table.h, OpCode).
enum : int32_t { kS = 0, kR = 1, kRcs = 2, kRrc = 3, kRrs = 4, kRrcs = 5, kCpy = 6, kRe = 7, kNop = 8 };
enum : int32_t { kInput = 0, kOutput = 1, kScratch = 2 };

__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ unsigned long long Tag(unsigned long long epoch, long long value) {
  return (epoch << 32) | static_cast<unsigned long long>(value);
}

__device__ __forceinline__ unsigned long long LoadVolatile(const unsigned long long* p) {
  return *reinterpret_cast<const volatile unsigned long long*>(p);
}

__device__ __forceinline__ void StoreVolatile(unsigned long long* p, unsigned long long v) {
  *reinterpret_cast<volatile unsigned long long*>(p) = v;
}

__device__ __forceinline__ int64_t ChunkStart(int64_t i, int64_t c, int64_t l) { return (i / c) * l + (i % c) * l / c; }

struct Region {
  char* base;
  RegionLayout layout;
  __device__ unsigned long long* tb_done() const {
    return reinterpret_cast<unsigned long long*>(base + layout.tb_done());
  }
  __device__ unsigned long long* posted() const { return reinterpret_cast<unsigned long long*>(base + layout.posted()); }
  __device__ unsigned long long* consumed() const {
    return reinterpret_cast<unsigned long long*>(base + layout.consumed());
  }
  __device__ MsgDesc* msgs() const { return reinterpret_cast<MsgDesc*>(base + layout.msgs()); }
  __device__ int32_t* error() const { return reinterpret_cast<int32_t*>(base + layout.error()); }
};

__device__ __forceinline__ size_t RangeBytesOf(int64_t c, int64_t l, int32_t esize, int32_t off, int32_t count) {
  return static_cast<size_t>(ChunkStart(off + count, c, l) - ChunkStart(off, c, l)) * esize;
}

// ------------------------------------------------------------------------------------------- measurement
// Only thread 0 of a block touches these (see MeasureArgs in interpreter.cuh for the protocol).

using AtomicI32 = ::cuda::atomic_ref<int32_t, ::cuda::thread_scope_device>;
using AtomicI64 = ::cuda::atomic_ref<int64_t, ::cuda::thread_scope_device>;
constexpr auto kRelaxed = ::cuda::std::memory_order_relaxed;
constexpr auto kAcquire = ::cuda::std::memory_order_acquire;
constexpr auto kRelease = ::cuda::std::memory_order_release;
constexpr int32_t kIdle = static_cast<int32_t>(WindowState::kIdle);
constexpr int32_t kMeasuring = static_cast<int32_t>(WindowState::kMeasuring);
constexpr int32_t kFinalizing = static_cast<int32_t>(WindowState::kFinalizing);
constexpr unsigned kMeterSleepNs = 256;  // longest back-off of a wait while the block has messages in flight

// Per-threadblock Measurements Cache (shared memory): windows aggregated per (src, dst, kind) until the flush.
struct MeasureCache {
  MeasurementCacheEntry entries[kMeasureCacheEntries];
  int32_t size;
  int32_t overflow;  // windows that found the cache full
};

__device__ void CacheAdd(MeasureCache* c, int32_t src, int32_t dst, int32_t kind, double bw) {
  for (int32_t k = 0; k < c->size; ++k) {
    MeasurementCacheEntry& e = c->entries[k];
    if (e.src == src && e.dst == dst && e.kind == kind) {
      ++e.count;
      e.sum_bw += bw;
      return;
    }
  }
  if (c->size == kMeasureCacheEntries) {
    ++c->overflow;
    return;
  }
  c->entries[c->size++] = MeasurementCacheEntry{src, dst, kind, 1, bw};
}

// Thread 0's view of its threadblock's send connection: messages posted and messages it has seen consumed
// (credited to the accumulator). The channel is active from its first post until its last message is
// credited: MCCL's TBs increment `active` as they begin transmitting and decrement it as they complete their
// work. (Counting only while a message is in flight would close the window between the steps of a relay
// such as a ring, where the next message is posted only after the previous one was consumed downstream.)
struct Meter {
  MeasurementAccumulator* acc;  // nullptr: this threadblock measures nothing
  MeasureCache* cache;
  const unsigned long long* consumed;  // consumed[send_conn] in this rank's workspace
  const int32_t* ops;                  // this threadblock's op rows
  const int32_t* send_ops;             // op index of each of its messages
  unsigned long long base;             // Tag(epoch, 0): a consumed flag below it is from an older launch
  int64_t period_elems;
  int32_t chunks_per_period, esize;
  int32_t threshold, src, dst, kind;
  long long posted, credited, total;  // total: messages this threadblock posts in the launch

  __device__ bool on() const { return acc != nullptr; }

  // Bytes of the message that op row `op` posts (what the receiver checks it against).
  __device__ size_t MessageBytes(const int32_t* op) const {
    const int32_t at = (op[0] == kRcs || op[0] == kRrcs) ? op[4] : op[2];
    return RangeBytesOf(chunks_per_period, period_elems, esize, at, op[5]);
  }

  __device__ void OnPost() {
    if (acc == nullptr) return;
    if (posted == 0) AtomicI32(acc->active).fetch_add(1, kRelaxed);
    ++posted;
  }

  // Credits the messages consumed since the last poll (a non-blocking read of one local flag).
  __device__ void Poll() {
    if (acc == nullptr || credited == posted) return;
    const unsigned long long v = LoadVolatile(consumed);
    long long c = v >= base ? static_cast<long long>(v - base) : 0;
    if (c > posted) c = posted;
    if (c <= credited) return;
    long long bytes = 0;
    for (long long j = credited; j < c; ++j) bytes += static_cast<long long>(MessageBytes(ops + send_ops[j] * kProgOp));
    credited = c;
    Credit(bytes, credited == total);
  }

  // MCCL Fig. 4 on the accumulator, lock-free. kFinalizing doubles as "busy": the block that moves the state
  // out of kIdle (to open) or out of kMeasuring (to close) owns the window fields until it stores the next
  // state with release order, and whoever acquires that state sees the fields it wrote.
  __device__ void Credit(long long bytes, bool done) {
    AtomicI32 active(acc->active), state(acc->state);
    AtomicI64 sent(acc->bytes_sent), start_ns(acc->start_ns), start_size(acc->start_size);
    sent.fetch_add(bytes, kRelaxed);
    // The delivery that opens a window only marks its start: that message's transfer began before it.
    int32_t expected = kIdle;
    if (state.load(kRelaxed) == kIdle && active.load(kRelaxed) >= threshold &&
        state.compare_exchange_strong(expected, kFinalizing, kAcquire, kRelaxed)) {
      if (active.load(kRelaxed) >= threshold) {  // still above after taking the state
        start_ns.store(static_cast<int64_t>(GlobalTimer()), kRelaxed);
        start_size.store(sent.load(kRelaxed), kRelaxed);
        state.store(kMeasuring, kRelease);
      } else {
        state.store(kIdle, kRelease);
      }
    }
    if (done) active.fetch_sub(1, kRelaxed);
    expected = kMeasuring;
    if (state.load(kRelaxed) == kMeasuring && active.load(kRelaxed) < threshold &&
        state.compare_exchange_strong(expected, kFinalizing, kAcquire, kRelaxed)) {
      const int64_t end_ns = static_cast<int64_t>(GlobalTimer());
      const int64_t dbytes = sent.load(kRelaxed) - start_size.load(kRelaxed);
      const int64_t dt = end_ns - start_ns.load(kRelaxed);
      if (dbytes > 0 && dt > 0) CacheAdd(cache, src, dst, kind, static_cast<double>(dbytes) * 1e9 / dt);
      state.store(kIdle, kRelease);
    }
  }
};

// Moves the cache into this threadblock's slots of the host-mapped Measurements Buffer, never waiting: records
// go into consecutive slots from the cursor while their flag is 0 (the host frees a slot by storing 0), the
// rest are dropped and counted. `first_flag` is the flag of the cursor's slot, read before the block's final
// wait (only this block writes its slots and the host only clears flags, so a 0 seen then is still 0).
__device__ void FlushMeasurements(const MeasureArgs& m, int32_t tb, const MeasureCache& c, unsigned int cursor,
                                  int32_t first_flag) {
  if (c.size == 0 && c.overflow == 0) return;
  const unsigned int slots = static_cast<unsigned int>(m.slots_per_tb);
  volatile MeasurementRecord* region = m.records + static_cast<size_t>(tb) * slots;
  unsigned int w = cursor;
  int32_t k = 0;
  unsigned long long windows = c.overflow;
  for (int32_t j = 0; j < c.size; ++j) windows += c.entries[j].count;
  for (; k < c.size && w - cursor < slots; ++k, ++w) {
    volatile MeasurementRecord* r = region + w % slots;
    if (!(k == 0 && first_flag == 0) && r->flag != 0) break;
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

// Bounded spin: true once *flag >= target; false on timeout or when another block of this rank failed.
// While it spins it keeps crediting the threadblock's consumed messages (`meter` may be off); with messages
// in flight the back-off stays short, since how late a consumption is seen is the error of a window's edges.
__device__ __forceinline__ bool WaitAtLeast(const unsigned long long* flag, unsigned long long target,
                                            const Region& me, unsigned long long deadline, Meter* meter) {
  unsigned sleep_ns = 32;
  for (;;) {
    const bool done = LoadVolatile(flag) >= target;
    meter->Poll();
    if (done) return true;
    if (*reinterpret_cast<volatile int32_t*>(me.error()) != kOk) return false;
    if (GlobalTimer() > deadline) return false;
    __nanosleep(sleep_ns);
    const unsigned most = meter->on() && meter->credited < meter->posted ? kMeterSleepNs : 4096;
    sleep_ns = sleep_ns * 2 > most ? most : sleep_ns * 2;
  }
}

__device__ void RecordError(const Region& me, int32_t code, int32_t tb, int32_t op) {
  int32_t* e = me.error();
  if (atomicCAS(e, kOk, code) == kOk) {
    e[1] = tb;
    e[2] = op;
    __threadfence_system();
  }
}

__device__ void BlockCopy(char* dst, const char* src, size_t bytes) {
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

// dst[i] = a[i] + b[i]; bf16/f16 add in float and round to nearest even (as the CPU executor does).
__device__ void BlockSum(SumType t, char* dst, const char* a, const char* b, size_t n) {
  switch (t) {
    case SumType::kF32: {
      float* d = reinterpret_cast<float*>(dst);
      const float* x = reinterpret_cast<const float*>(a);
      const float* y = reinterpret_cast<const float*>(b);
      for (size_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = __fadd_rn(x[i], y[i]);
      break;
    }
    case SumType::kS32: {
      uint32_t* d = reinterpret_cast<uint32_t*>(dst);
      const uint32_t* x = reinterpret_cast<const uint32_t*>(a);
      const uint32_t* y = reinterpret_cast<const uint32_t*>(b);
      for (size_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = x[i] + y[i];
      break;
    }
    case SumType::kBF16: {
      __nv_bfloat16* d = reinterpret_cast<__nv_bfloat16*>(dst);
      const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(a);
      const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(b);
      for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        d[i] = __float2bfloat16_rn(__fadd_rn(__bfloat162float(x[i]), __bfloat162float(y[i])));
      }
      break;
    }
    case SumType::kF16: {
      __half* d = reinterpret_cast<__half*>(dst);
      const __half* x = reinterpret_cast<const __half*>(a);
      const __half* y = reinterpret_cast<const __half*>(b);
      for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        d[i] = __float2half_rn(__fadd_rn(__half2float(x[i]), __half2float(y[i])));
      }
      break;
    }
    case SumType::kNone:
      break;
  }
}

__device__ char* BufferPtr(const KernelArgs& a, int32_t buf, int32_t chunk) {
  const int64_t elem = ChunkStart(chunk, a.chunks_per_period, a.period_elems);
  char* base = buf == kInput ? a.in : buf == kOutput ? a.out : a.scratch;
  return base + elem * a.esize;
}

__device__ size_t RangeBytes(const KernelArgs& a, int32_t off, int32_t count) {
  return RangeBytesOf(a.chunks_per_period, a.period_elems, a.esize, off, count);
}

__global__ void __launch_bounds__(kThreads) InterpreterKernel(KernelArgs a) {
  const int32_t* header = a.prog;
  const int32_t num_conns = header[2];
  const int32_t* tbs = a.prog + kProgHeader;
  const int32_t* ops = tbs + header[0] * kProgTb;
  const int32_t* staged_index = ops + header[1] * kProgOp;
  const int32_t* send_ops = staged_index + num_conns;

  const int32_t tb = blockIdx.x;
  const int32_t* t = tbs + tb * kProgTb;
  const int32_t first_op = t[0], num_ops = t[1], send_conn = t[2], recv_conn = t[3];
  const int32_t send_peer = t[4], recv_peer = t[5], num_sends = t[6], first_send = t[7];

  const Region me{a.regions[a.rank], a.layout};
  const unsigned long long deadline = GlobalTimer() + a.timeout_ns;
  __shared__ int32_t s_ok;
  __shared__ MsgDesc s_msg;
  __shared__ MeasureCache s_cache;

  Meter meter{};  // thread 0's; stays off unless this launch measures and the block sends
  if (threadIdx.x == 0 && a.measure.acc != nullptr && send_conn >= 0 && num_sends > 0) {
    const MeasureArgs& m = a.measure;
    const bool intra = ((m.intra_peers >> send_peer) & 1ull) != 0;
    meter.acc = m.acc + (intra ? 0 : 1 + send_peer);
    meter.cache = &s_cache;
    meter.consumed = me.consumed() + send_conn;
    meter.ops = ops + first_op * kProgOp;
    meter.send_ops = send_ops + first_send;
    meter.total = num_sends;
    meter.base = Tag(a.epoch, 0);
    meter.period_elems = a.period_elems;
    meter.chunks_per_period = a.chunks_per_period;
    meter.esize = a.esize;
    meter.threshold = intra ? m.intra_threshold : m.inter_threshold;
    meter.src = a.rank;
    meter.dst = intra ? -1 : send_peer;
    meter.kind = static_cast<int32_t>(intra ? LinkKind::kIntra : LinkKind::kInter);
    s_cache.size = 0;
    s_cache.overflow = 0;
  }

  for (int32_t i = 0; i < num_ops; ++i) {
    const int32_t* op = ops + (first_op + i) * kProgOp;
    const int32_t kind = op[0], src_buf = op[1], src_off = op[2], dst_buf = op[3], dst_off = op[4], count = op[5];
    const int32_t dep_tb = op[6], dep_op = op[7], direct = op[8] & 1, send_msg = op[9], recv_msg = op[10];
    const bool receives = kind == kR || kind == kRcs || kind == kRrc || kind == kRrs || kind == kRrcs;
    const bool sends = kind == kS || kind == kRcs || kind == kRrs || kind == kRrcs;

    // Thread 0 waits for everything the op needs; the conditions only ever become true, so waiting for all
    // of them first is the same as the IR's "receive, then send if a slot is free".
    if (threadIdx.x == 0) {
      int32_t ok = 1;
      if (dep_tb >= 0 && dep_tb != tb &&
          !WaitAtLeast(me.tb_done() + dep_tb, Tag(a.epoch, dep_op + 1), me, deadline, &meter)) {
        RecordError(me, kTimeoutDependency, tb, i);
        ok = 0;
      }
      if (ok && receives) {
        if (!WaitAtLeast(me.posted() + recv_conn, Tag(a.epoch, recv_msg + 1), me, deadline, &meter)) {
          RecordError(me, kTimeoutMessage, tb, i);
          ok = 0;
        } else {
          __threadfence_system();
          const volatile MsgDesc* m = me.msgs() + recv_conn * a.num_slots + recv_msg % a.num_slots;
          s_msg.ptr = m->ptr;
          s_msg.bytes = m->bytes;
          const int32_t at = kind == kRrs ? src_off : dst_off;
          if (s_msg.bytes != RangeBytes(a, at, count)) {
            RecordError(me, kSizeMismatch, tb, i);
            ok = 0;
          }
        }
      }
      if (ok && sends && send_msg >= a.num_slots &&
          !WaitAtLeast(me.consumed() + send_conn, Tag(a.epoch, send_msg + 1 - a.num_slots), me, deadline, &meter)) {
        RecordError(me, kTimeoutSlot, tb, i);
        ok = 0;
      }
      s_ok = ok;
    }
    __syncthreads();
    if (!s_ok) return;

    const char* msg = reinterpret_cast<const char*>(s_msg.ptr);
    const int32_t slot = send_msg >= 0 ? send_msg % a.num_slots : 0;
    char* stage = (sends && !direct)
                      ? a.staging + (static_cast<size_t>(staged_index[send_conn]) * a.num_slots + slot) * a.stage_bytes
                      : nullptr;
    const char* outgoing = nullptr;
    size_t out_bytes = 0;
    switch (kind) {
      case kNop:
        break;
      case kCpy:
        BlockCopy(BufferPtr(a, dst_buf, dst_off), BufferPtr(a, src_buf, src_off), RangeBytes(a, src_off, count));
        break;
      case kRe: {
        char* d = BufferPtr(a, dst_buf, dst_off);
        BlockSum(a.sum, d, d, BufferPtr(a, src_buf, src_off), RangeBytes(a, src_off, count) / a.esize);
        break;
      }
      case kS:
        outgoing = BufferPtr(a, src_buf, src_off);
        out_bytes = RangeBytes(a, src_off, count);
        break;
      case kR:
      case kRcs:
        BlockCopy(BufferPtr(a, dst_buf, dst_off), msg, s_msg.bytes);
        outgoing = BufferPtr(a, dst_buf, dst_off);
        out_bytes = s_msg.bytes;
        break;
      case kRrc:
      case kRrcs:
        BlockSum(a.sum, BufferPtr(a, dst_buf, dst_off), BufferPtr(a, src_buf, src_off), msg, s_msg.bytes / a.esize);
        outgoing = BufferPtr(a, dst_buf, dst_off);
        out_bytes = s_msg.bytes;
        break;
      case kRrs:
        BlockSum(a.sum, stage, BufferPtr(a, src_buf, src_off), msg, s_msg.bytes / a.esize);
        outgoing = stage;
        out_bytes = s_msg.bytes;
        break;
    }
    if (sends && !direct && kind != kRrs) {
      __syncthreads();  // the local write (rcs/rrcs) is complete before it is staged
      BlockCopy(stage, outgoing, out_bytes);
      outgoing = stage;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();  // data written by this block is visible to peers before any flag
      if (receives) {
        const Region sender{a.regions[recv_peer], a.layout};
        StoreVolatile(sender.consumed() + recv_conn, Tag(a.epoch, recv_msg + 1));
      }
      if (sends) {
        const Region receiver{a.regions[send_peer], a.layout};
        volatile MsgDesc* m = receiver.msgs() + send_conn * a.num_slots + slot;
        m->ptr = reinterpret_cast<unsigned long long>(outgoing);
        m->bytes = out_bytes;
        __threadfence_system();
        StoreVolatile(receiver.posted() + send_conn, Tag(a.epoch, send_msg + 1));
        meter.OnPost();  // credits come from the polls in the next waits (every wait polls at least once)
      }
      __threadfence();
      StoreVolatile(me.tb_done() + tb, Tag(a.epoch, i + 1));
    }
    __syncthreads();
  }
  // A rank leaves only after its messages were consumed: receivers read its buffers and staging in place.
  if (threadIdx.x == 0 && send_conn >= 0 && num_sends > 0) {
    unsigned int cursor = 0;
    int32_t first_flag = 1;
    if (meter.on()) {  // issued before the drain spin, so the host-memory read overlaps it
      cursor = a.measure.cursor[tb];
      const size_t at = static_cast<size_t>(tb) * a.measure.slots_per_tb + cursor % a.measure.slots_per_tb;
      first_flag = reinterpret_cast<volatile MeasurementRecord*>(a.measure.records)[at].flag;
    }
    if (!WaitAtLeast(me.consumed() + send_conn, Tag(a.epoch, num_sends), me, deadline, &meter)) {
      RecordError(me, kTimeoutDrain, tb, num_ops);
    } else if (meter.on()) {
      meter.Poll();
      FlushMeasurements(a.measure, tb, s_cache, cursor, first_flag);
    }
  }
}

}  // namespace

cudaError_t LaunchInterpreter(const KernelArgs& args, int num_blocks, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  InterpreterKernel<<<num_blocks, kThreads, 0, stream>>>(args);
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
