// The CUDA backend of the executor core (xla_ffi/core): one thread block runs one threadblock of one
// rank's program (blockIdx.x) for one rank of the launch (blockIdx.y: production launches one rank per
// GPU; the test entry runs every rank of a table on one GPU). Thread 0 picks the next ready unit with
// the core's dataflow rule and waits by bounded spinning (__nanosleep back-off, %globaltimer
// deadline); all threads then run the core's op data step; thread 0 publishes the flags of the core's
// protocol (core/protocol.h): consumed tag into the sender's region, message descriptor and posted tag
// into the receiver's, op_done into its own. On timeout the block records an error code for the host
// and the rank's other blocks bail out. Regions are device memory, or, in a launch across processes,
// pinned host memory mapped into the device, a remote rank's being the shadow the proxy polls
// (mapped_memory.h): the kernel treats both alike, and stops when the proxy stores kPeerFailed.
//
// Passive measurement (MCCL Sec. 5.1-5.2) with the core's window state machine and cache
// (core/meter.h), of the connections to ranks of this process (MeasureArgs::remote_peers): a sending
// block's thread 0 counts its connection active from the post of a message that finds nothing in flight
// until it sees the last in-flight one consumed (it polls the consumed tags in its own region, in every
// wait); accumulators (MeterWindow, device memory) are shared by the rank's blocks under a spin lock;
// each block flushes its cache into its slots of the host-mapped Measurements Buffer at its end (never
// waiting: a full slot drops the record and counts it).
#ifndef JAXCCL_KERNELS_INTERPRETER_CUH_
#define JAXCCL_KERNELS_INTERPRETER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "core/meter.h"
#include "core/protocol.h"
#include "core/measurement_format.h"

namespace jaxccl {
namespace cuda {

inline constexpr int kMaxRanks = 64;
inline constexpr int kThreads = 256;
// A sending block tracks at most this many in-flight messages for the meter (one per slot); a table
// with more slots is not measured.
inline constexpr int kMeterMaxSlots = 64;

// Per-threadblock counters of the Measurements Buffer, cumulative since the buffer was allocated. The device
// copy is authoritative; the kernel mirrors it into host-mapped memory (write-only from the device).
struct MeasureCounters {
  unsigned long long records;  // records written into the buffer
  unsigned long long dropped;  // records dropped: no free slot, or the cache was full
  unsigned long long windows;  // measurement windows closed with a bandwidth
  unsigned long long reserved;
};
static_assert(sizeof(MeasureCounters) == 32, "host and device agree on the counter layout");

struct MeasureArgs {
  MeterWindow* acc;                 // nullptr: this launch measures nothing; [0] intra, [1 + p] inter to p
  MeasurementRecord* records;       // device pointer of host-mapped [num_tbs][slots_per_tb]
  MeasureCounters* counters_host;   // device pointer of host-mapped [num_tbs]
  MeasureCounters* counters_dev;    // [num_tbs], device memory
  unsigned int* cursor;             // [num_tbs], device memory: next slot to write (mod slots_per_tb)
  int32_t slots_per_tb;
  int32_t intra_threshold;
  int32_t inter_threshold;
  int32_t pad;
  long long min_window_bytes;       // windows that carried fewer bytes are dropped
  unsigned long long intra_peers;   // bit p: rank p is on this rank's host
  // Bit p: rank p runs in another process. The kernel does not meter sends to it: that connection's
  // messages are timed by the proxy on the wire (transport/proxy.h, TransportRecord), and the kernel
  // would only see the proxy's handshake around the same transfer.
  unsigned long long remote_peers;
};

// One rank's launch.
struct KernelArgs {
  const int32_t* prog;  // the rank's program (core/program.h), device memory
  int32_t rank;
  int32_t tiles;
  Reduction reduction;  // none() for collectives without reduction
  RankBuffers buffers;
  unsigned long long epoch;
  unsigned long long identity;  // LaunchIdentity(table checksum, epoch): carried by every message, checked by receivers
  unsigned long long timeout_ns;
  RegionLayout layout;
  char* staging;  // this rank's staging: [staged conn][slot][stage_bytes]
  unsigned long long stage_bytes;
  char* regions[kMaxRanks];  // every rank's flag region of this epoch
  MeasureArgs measure;
};

// Launches the interpreter: grid (max threadblocks of a rank, ranks); `args` is a device array of `ranks`.
cudaError_t LaunchInterpreter(const KernelArgs* args_dev, int max_tbs, int ranks, cudaStream_t stream);
// How many interpreter blocks fit on `device` at once (all blocks of a launch must be resident).
cudaError_t MaxResidentBlocks(int device, int* blocks);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_INTERPRETER_CUH_
