// The CUDA FFI handlers `jaxccl_cuda_collective` and `jaxccl_cuda_mp_collective` (handler.cu) and the hooks
// that connect the module to jaxccl._native's registry.
#ifndef JAXCCL_KERNELS_HANDLER_H_
#define JAXCCL_KERNELS_HANDLER_H_

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxccl {

struct CoreApi;

namespace cuda {

// Same operands, result and attributes as jaxccl_cpu_collective; runs on the device's stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcclCudaCollective);
// The same for an axis whose ranks run in several processes (the process group attached with
// jaxccl.distributed.transport.attach); same operands, result and attributes.
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcclCudaMpCollective);

// Connects this module to the registry of jaxccl._native; false (with a reason) on a version mismatch.
bool AttachCore(const CoreApi* api, std::string* error);
bool CoreAttached();
// The registry interface AttachCore installed (null before).
const CoreApi* AttachedCore();

// Visible CUDA devices (0 when there is no driver or no GPU).
int DeviceCount();

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_HANDLER_H_
