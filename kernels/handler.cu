// The CUDA FFI handler: checks one rank's call (its attributes, operands and device), numbers it on its
// schedule slot and hands it to its launch (launch.cu); and the hooks that attach the module to
// jaxccl._native's registry (host/core_api.h).
#include "handler.h"

#include <atomic>
#include <string>
#include <utility>

#include "host/common.h"
#include "host/core_api.h"
#include "host/dtype.h"
#include "interpreter.cuh"
#include "launch.h"

namespace jaxccl {
namespace cuda {
namespace {

std::atomic<const CoreApi*> g_core{nullptr};

// Restores the calling thread's current device (XLA's) when it goes out of scope.
class DeviceGuard {
 public:
  DeviceGuard() { has_ = cudaGetDevice(&previous_) == cudaSuccess; }
  ~DeviceGuard() {
    if (has_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool has_ = false;
};

ffi::Error CudaCollective(cudaStream_t stream, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                          ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size,
                          int64_t reduce_op) {
  const CoreApi* core = AttachedCore();
  if (core == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxccl (cuda): the CUDA module is not attached to jaxccl._native (import jaxccl.runtime.native)");
  }
  auto op = ReduceOpOf(reduce_op);
  if (!op.has_value()) return std::move(op.error());
  if (coords.element_type() != ffi::DataType::S32 || coords.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxccl_cuda_collective: coords must be int32[2] (rank, group)");
  }
  if (axis_size < 1 || axis_size > kMaxRanks) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl_cuda_collective: axis_size must be in 1..", kMaxRanks));
  }
  DeviceGuard guard;
  int device = 0;
  JAXCCL_CUDA_CHECK(cudaGetDevice(&device));
  if (out->untyped_data() != nullptr) {  // the buffer's device, should XLA's thread be on another one
    cudaPointerAttributes attr;
    JAXCCL_CUDA_CHECK(cudaPointerGetAttributes(&attr, out->untyped_data()));
    device = attr.device;
  }
  int32_t rc[2];
  JAXCCL_CUDA_CHECK(cudaMemcpyAsync(rc, coords.untyped_data(), sizeof(rc), cudaMemcpyDeviceToHost, stream));
  JAXCCL_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int32_t rank = rc[0], group = rc[1];
  if (rank < 0 || rank >= axis_size) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl_cuda_collective: rank ", rank, " outside axis of ", axis_size));
  }
  CudaArrival me;
  me.in = x.untyped_data();
  me.out = out->untyped_data();
  me.in_elems = static_cast<int64_t>(x.element_count());
  me.out_elems = static_cast<int64_t>(out->element_count());
  me.in_dtype = x.element_type();
  me.out_dtype = out->element_type();
  me.reduce_op = *op;
  me.device = device;
  std::string issue_error;
  if (!core->note_issued(slot, rank, &me.seq, &issue_error)) return ffi::Error::InvalidArgument(issue_error);
  return RunLaunch(stream, run_id.run_id, slot, site, group, rank, static_cast<int32_t>(axis_size), me);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcclCudaCollective, CudaCollective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("axis_size")
                                  .Attr<int64_t>("reduce_op"));

bool AttachCore(const CoreApi* api, std::string* error) {
  if (api == nullptr || api->version != kCoreApiVersion || api->struct_size != sizeof(CoreApi)) {
    *error = StrCat("jaxccl._native_cuda expects core API version ", kCoreApiVersion, " (", sizeof(CoreApi),
                    " bytes); rebuild both modules from one tree");
    return false;
  }
  g_core.store(api);
  return true;
}

bool CoreAttached() { return g_core.load() != nullptr; }

const CoreApi* AttachedCore() { return g_core.load(); }

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace cuda
}  // namespace jaxccl
