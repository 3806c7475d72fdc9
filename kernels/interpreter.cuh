// The CUDA schedule interpreter: the table format and op semantics of the CPU
// executor (xla_ffi/cpu_executor.h), on GPUs that reach each other through
// peer access.
//
// One thread block runs one threadblock of the schedule and executes its ops
// in order. Synchronization lives in a per-rank device workspace:
//   * tb_done[t]      ops completed by threadblock t of this rank (dependencies),
//   * posted[k]       messages posted on connection k (in the receiver's workspace),
//   * msgs[k][slot]   where message slot `slot` of connection k is (receiver's workspace),
//   * consumed[k]     messages the receiver consumed (in the sender's workspace),
// each flag tagged with the launch epoch in its upper 32 bits, so stale flags of
// earlier launches compare smaller and nothing needs resetting. Two workspace
// regions alternate by epoch parity (a launch can only overlap the one before it:
// every rank's output depends on every other rank's input). Every wait is a
// bounded spin (with __nanosleep back-off) against %globaltimer; on timeout the
// block records an error code for the host and the rank's other blocks bail out.
#ifndef JAXCCL_KERNELS_INTERPRETER_CUH_
#define JAXCCL_KERNELS_INTERPRETER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace jaxccl {
namespace cuda {

inline constexpr int kMaxRanks = 64;
inline constexpr int kThreads = 256;

// Per-rank program layout (int32 words), built on the host from the parsed Table.
inline constexpr int kProgHeader = 8;  // num_tbs, num_ops, num_conns, max_tbs, num_staged_conns, 0, 0, 0
inline constexpr int kProgTb = 8;      // first_op, num_ops, send_conn, recv_conn, send_peer, recv_peer, num_sends, 0
inline constexpr int kProgOp = 12;     // kind, src_buf, src_off, dst_buf, dst_off, count, dep_tb, dep_op,
                                       // flags, send_msg, recv_msg, 0
// followed by staged_index[num_conns] (-1: the connection stages nothing)

enum class SumType : int32_t { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2, kS32 = 3 };

enum ErrorCode : int32_t {
  kOk = 0,
  kTimeoutDependency = 1,
  kTimeoutMessage = 2,
  kTimeoutSlot = 3,
  kTimeoutDrain = 4,
  kSizeMismatch = 5,
};

struct MsgDesc {
  unsigned long long ptr;
  unsigned long long bytes;
};

// Byte layout of one workspace region (identical on every rank of a launch).
struct RegionLayout {
  int32_t max_tbs, num_conns, num_slots;
  __host__ __device__ size_t tb_done() const { return 0; }
  __host__ __device__ size_t posted() const { return tb_done() + 8 * static_cast<size_t>(max_tbs); }
  __host__ __device__ size_t consumed() const { return posted() + 8 * static_cast<size_t>(num_conns); }
  __host__ __device__ size_t msgs() const { return consumed() + 8 * static_cast<size_t>(num_conns); }
  __host__ __device__ size_t error() const {
    return msgs() + sizeof(MsgDesc) * static_cast<size_t>(num_conns) * num_slots;
  }
  __host__ __device__ size_t bytes() const { return (error() + 16 + 255) / 256 * 256; }
};

struct KernelArgs {
  const int32_t* prog;
  int32_t rank;
  int32_t chunks_per_period;
  int32_t num_slots;
  int32_t esize;
  int64_t period_elems;
  SumType sum;
  unsigned long long epoch;
  unsigned long long timeout_ns;
  RegionLayout layout;
  char* in;
  char* out;
  char* scratch;
  char* staging;  // this rank's staging: [staged conn][slot][stage_bytes]
  unsigned long long stage_bytes;
  char* regions[kMaxRanks];  // every rank's workspace region of this epoch's parity
};

// Launches the interpreter for one rank: one block per threadblock of the rank.
cudaError_t LaunchInterpreter(const KernelArgs& args, int num_blocks, cudaStream_t stream);
// How many interpreter blocks fit on `device` at once (all blocks of a rank must be resident).
cudaError_t MaxResidentBlocks(int device, int* blocks);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_INTERPRETER_CUH_
