// One launch of the CUDA executor (launch.cu), as the FFI handlers (handler.cu) hand a rank's call to it.
#ifndef JAXCCL_KERNELS_LAUNCH_H_
#define JAXCCL_KERNELS_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "core/reduce.h"
#include "host/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxccl {

struct ProcessGroup;

namespace cuda {

// Returns an internal ffi::Error from the enclosing function when a CUDA call fails.
#define JAXCCL_CUDA_CHECK(expr)                                                                            \
  do {                                                                                                     \
    cudaError_t jaxccl_err_ = (expr);                                                                      \
    if (jaxccl_err_ != cudaSuccess) {                                                                      \
      return ffi::Error::Internal(StrCat("jaxccl (cuda): ", #expr, " failed: ", cudaGetErrorString(jaxccl_err_), \
                                         " at ", __FILE__, ":", __LINE__));                                \
    }                                                                                                      \
  } while (0)

// Restores the calling thread's current device when it goes out of scope.
class DeviceGuard {
 public:
  DeviceGuard() { has_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceGuard() {
    if (has_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool has_ = false;
};

// One rank's call.
struct CudaArrival {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t in_elems = 0, out_elems = 0;
  ffi::DataType in_dtype = ffi::DataType::INVALID, out_dtype = ffi::DataType::INVALID;
  int device = -1;
  int64_t seq = 0;  // this rank's sequence number of the call on its slot (hot-swap transition point)
  ReduceOp reduce_op = ReduceOp::kSum;  // the call's operator (used when its table reduces)
};

// Numbers the call on its slot, then runs rank `rank`'s part of the launch its call `me` belongs to (call
// site `site` of run `run_id`, group `group` of `axis_size` ranks, schedule slot `slot`) on `stream`, and
// waits for the kernel to report. A call its slot refuses (a closed communicator) fails the launch's
// rendezvous at once for every rank.
// `processes`: the group's process group when it may span processes (jaxccl_cuda_mp_collective: this
// process's ranks meet, and the proxy in jaxccl._native carries the connections to the others); null
// when every rank runs in this process.
ffi::Error RunLaunch(cudaStream_t stream, int64_t run_id, int64_t slot, int64_t site, int32_t group, int32_t rank,
                     int32_t axis_size, const CudaArrival& me, std::shared_ptr<const ProcessGroup> processes);

// What a protocol error code (core/protocol.h, ProtocolError) of the kernel means.
const char* ErrorWhat(int32_t code);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_LAUNCH_H_
