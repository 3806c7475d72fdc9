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
//
// Passive measurement (MCCL Sec. 5.1-5.2; layouts in xla_ffi/measurement_format.h): see MeasureArgs.
#ifndef JAXCCL_KERNELS_INTERPRETER_CUH_
#define JAXCCL_KERNELS_INTERPRETER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "measurement_format.h"

namespace jaxccl {
namespace cuda {

inline constexpr int kMaxRanks = 64;
inline constexpr int kThreads = 256;

// Per-rank program layout (int32 words), built on the host from the parsed Table.
inline constexpr int kProgHeader = 8;  // num_tbs, num_ops, num_conns, max_tbs, num_staged_conns, num_sends, 0, 0
inline constexpr int kProgTb = 8;      // first_op, num_ops, send_conn, recv_conn, send_peer, recv_peer, num_sends,
                                       // first_send
inline constexpr int kProgOp = 12;     // kind, src_buf, src_off, dst_buf, dst_off, count, dep_tb, dep_op,
                                       // flags, send_msg, recv_msg, 0
// followed by staged_index[num_conns] (-1: the connection stages nothing), then send_ops[num_sends]: for
// threadblock t, send_ops[first_send + j] is the index (within t) of the op that posts t's j-th message.

// Measurements Cache entries per threadblock (shared memory, MCCL Fig. 5). A threadblock sends to one peer, so
// it closes windows of one accumulator only; the cap matches the CPU executor's (a window that finds the cache
// full is counted as a drop).
inline constexpr int kMeasureCacheEntries = 32;

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

// Per-threadblock counters of the Measurements Buffer, cumulative since the buffer was allocated. The device
// copy is authoritative; the kernel mirrors it into host-mapped memory (write-only from the device).
struct MeasureCounters {
  unsigned long long records;  // records written into the buffer
  unsigned long long dropped;  // records dropped: no free slot, or the cache was full
  unsigned long long windows;  // measurement windows closed with a bandwidth
  unsigned long long reserved;
};
static_assert(sizeof(MeasureCounters) == 32, "host and device agree on the counter layout");

// Passive measurement of one rank's launch (MCCL Sec. 5.1-5.2; window rules as in xla_ffi/network.cc).
//  * Where: the interpreter pulls (a receiver copies each message out of the sender's memory, then marks it
//    consumed in the sender's workspace), so every accumulator lives with its sender and only the sender's
//    threadblocks touch it: device-scope atomics and one %globaltimer clock, never another GPU's.
//  * Keys: acc[0] = this rank's intra-node injection (all its channels to same-host peers), acc[1 + p] = the
//    inter-node pair (rank -> p). A threadblock has one send peer, so it feeds one accumulator.
//  * In flight: a message from its post until thread 0 of the sending block sees it consumed (it polls the
//    consumed counter, one local load, at least once in every wait); bytes_sent grows by the messages seen
//    consumed. A channel is active from its first post until its last message was seen consumed.
//  * Window: opens at a credit that finds the accumulator idle with active >= threshold (the opening
//    delivery's own bytes are before the window), closes when active drops below the threshold; its
//    bandwidth (bytes/s) goes into the block's Measurements Cache (shared memory).
//  * Export: at its end a block flushes the cache into its `slots_per_tb` slots of the host-mapped
//    Measurements Buffer (circular; a slot is written only while its flag is 0, fields first, then
//    __threadfence_system and flag = 1; with no free slot the record is dropped and counted, never waited for).
struct MeasureArgs {
  MeasurementAccumulator* acc;      // nullptr: this launch measures nothing
  MeasurementRecord* records;       // device pointer of host-mapped [num_tbs][slots_per_tb]
  MeasureCounters* counters_host;   // device pointer of host-mapped [num_tbs]
  MeasureCounters* counters_dev;    // [num_tbs], device memory
  unsigned int* cursor;             // [num_tbs], device memory: next slot to write (mod slots_per_tb)
  int32_t slots_per_tb;
  int32_t intra_threshold;
  int32_t inter_threshold;
  int32_t pad;
  unsigned long long intra_peers;   // bit p: rank p is on this rank's host
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
  MeasureArgs measure;
};

// Launches the interpreter for one rank: one block per threadblock of the rank.
cudaError_t LaunchInterpreter(const KernelArgs& args, int num_blocks, cudaStream_t stream);
// How many interpreter blocks fit on `device` at once (all blocks of a rank must be resident).
cudaError_t MaxResidentBlocks(int device, int* blocks);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_INTERPRETER_CUH_
