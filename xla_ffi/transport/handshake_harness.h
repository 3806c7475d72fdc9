// Tests: the CPU proof that what a GPU adds to a launch across processes is only its memory and the launch
// wiring. RunMappedLaunch runs one launch of a slot's table for this process's ranks of a process group the way
// the CUDA executor does (kernels/launch.cu, kernels/interpreter.cu), except that each threadblock of a local
// rank is a host thread and all memory is host memory:
//   * the launch goes through the core API the CUDA module uses (host/core_api.h): note_issued, acquire at the
//     agreed sequence number (only the local ranks are present), process_group, and start_mapped_proxy, which
//     starts the one proxy (proxy.h) over a MappedLaunch (mapped_launch.h);
//   * every rank of the group has a flag region (local ranks': their own, other processes' ranks': shadows),
//     kept per slot from launch to launch and cleared as the GPU's (RegionNeedsClearing), with a new epoch per
//     launch; a local rank's error word is cleared before the proxy starts;
//   * each threadblock thread runs the interpreter kernel's loop with the core's functions: the next ready unit
//     (NextReadyUnit), the message check (MessageError), the op's data step (RunOpData, the CPU's byte mover),
//     then the consumed tag into the sender's region, the descriptor and the posted tag into the receiver's, and
//     op_done into its own; at the end it drains (its messages consumed: LastMessageOfSlot); it stops on an
//     error word and records its own (StuckReason, kTimeoutDrain) at its deadline, kMappedRankGraceS
//     (mapped_launch.h) after the proxy's;
//   * after the threads: WaitDone, the proxy's failure (it names the process) before the ranks' codes, and
//     Abort when a rank failed by itself.
// The wire layout is the launch's choice: MemoryKind::kCuda sends every trailer apart, as from device memory.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_HANDSHAKE_HARNESS_H_
#define JAXCCL_XLA_FFI_TRANSPORT_HANDSHAKE_HARNESS_H_

#include <cstdint>
#include <vector>

#include "core/reduce.h"
#include "host/common.h"
#include "transport/transport.h"

namespace jaxccl {

// One local rank's call.
struct HarnessCall {
  int32_t rank = 0;
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_elems = 0, out_elems = 0;
  ffi::DataType dtype = ffi::DataType::INVALID;
};

struct HarnessOptions {
  int64_t slot = 0;
  int32_t group = 0;  // the attached process group (its index)
  ReduceOp reduce_op = ReduceOp::kSum;
  MemoryKind wire = MemoryKind::kHost;  // the launch's wire layout (its memory is host memory either way)
  int32_t tiles = 0;                    // > 0: this many tiles where the program is tileable (else as a GPU)
};

// A rank's error word after the launch (core/protocol.h, ProtocolError).
struct HarnessRankError {
  int32_t code = 0, tb = 0, op = 0;
};

struct HarnessResult {
  ffi::Error error = ffi::Error::Success();
  std::vector<HarnessRankError> ranks;  // per call
};

HarnessResult RunMappedLaunch(const HarnessOptions& options, const std::vector<HarnessCall>& calls);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_HANDSHAKE_HARNESS_H_
