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

// Bounded spin: true once *flag >= target; false on timeout or when another block of this rank failed.
__device__ bool WaitAtLeast(const unsigned long long* flag, unsigned long long target, const Region& me,
                            unsigned long long deadline) {
  unsigned sleep_ns = 32;
  for (;;) {
    if (LoadVolatile(flag) >= target) return true;
    if (*reinterpret_cast<volatile int32_t*>(me.error()) != kOk) return false;
    if (GlobalTimer() > deadline) return false;
    __nanosleep(sleep_ns);
    if (sleep_ns < 4096) sleep_ns *= 2;
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
  const int64_t c = a.chunks_per_period;
  return static_cast<size_t>(ChunkStart(off + count, c, a.period_elems) - ChunkStart(off, c, a.period_elems)) *
         a.esize;
}

__global__ void __launch_bounds__(kThreads) InterpreterKernel(KernelArgs a) {
  const int32_t* header = a.prog;
  const int32_t num_conns = header[2];
  const int32_t* tbs = a.prog + kProgHeader;
  const int32_t* ops = tbs + header[0] * kProgTb;
  const int32_t* staged_index = ops + header[1] * kProgOp;

  const int32_t tb = blockIdx.x;
  const int32_t* t = tbs + tb * kProgTb;
  const int32_t first_op = t[0], num_ops = t[1], send_conn = t[2], recv_conn = t[3];
  const int32_t send_peer = t[4], recv_peer = t[5], num_sends = t[6];

  const Region me{a.regions[a.rank], a.layout};
  const unsigned long long deadline = GlobalTimer() + a.timeout_ns;
  __shared__ int32_t s_ok;
  __shared__ MsgDesc s_msg;

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
          !WaitAtLeast(me.tb_done() + dep_tb, Tag(a.epoch, dep_op + 1), me, deadline)) {
        RecordError(me, kTimeoutDependency, tb, i);
        ok = 0;
      }
      if (ok && receives) {
        if (!WaitAtLeast(me.posted() + recv_conn, Tag(a.epoch, recv_msg + 1), me, deadline)) {
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
          !WaitAtLeast(me.consumed() + send_conn, Tag(a.epoch, send_msg + 1 - a.num_slots), me, deadline)) {
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
      }
      __threadfence();
      StoreVolatile(me.tb_done() + tb, Tag(a.epoch, i + 1));
    }
    __syncthreads();
  }
  // A rank leaves only after its messages were consumed: receivers read its buffers and staging in place.
  if (threadIdx.x == 0 && send_conn >= 0 && num_sends > 0 &&
      !WaitAtLeast(me.consumed() + send_conn, Tag(a.epoch, num_sends), me, deadline)) {
    RecordError(me, kTimeoutDrain, tb, num_ops);
  }
  (void)num_conns;
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
