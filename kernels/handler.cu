// The CUDA FFI handlers: check one rank's call (its attributes, operands and device), number it on its
// schedule slot and hand it to its launch (launch.cu): jaxccl_cuda_collective when every rank runs in this
// process, jaxccl_cuda_mp_collective when the group may span processes. And the hooks that attach the
// module to jaxccl._native's registry (host/core_api.h).
#include "handler.h"

#include <atomic>
#include <string>
#include <utility>

#include "host/common.h"
#include "host/core_api.h"
#include "host/dtype.h"
#include "interpreter.cuh"
#include "launch.h"
#include "transport/proxy.h"

namespace jaxccl {
namespace cuda {
namespace {

std::atomic<const CoreApi*> g_core{nullptr};

// One rank's call as both targets take it: checked, with its coordinates (coords = [rank, group]).
struct Call {
  CudaArrival me;
  int32_t rank = 0, group = 0;
};

ffi::ErrorOr<Call> ReadCall(const char* target, cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                            ffi::AnyBuffer out, int64_t axis_size, int64_t reduce_op) {
  using R = Call;
  if (AttachedCore() == nullptr) {
    return ErrorResult<R>(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxccl (cuda): the CUDA module is not attached to jaxccl._native (import jaxccl.runtime.native)"));
  }
  auto op = ReduceOpOf(reduce_op);
  if (!op.has_value()) return ErrorResult<R>(std::move(op.error()));
  if (coords.element_type() != ffi::DataType::S32 || coords.element_count() != 2) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat(target, ": coords must be int32[2] (rank, group)")));
  }
  if (axis_size < 1 || axis_size > kMaxRanks) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat(target, ": axis_size must be in 1..", kMaxRanks)));
  }
  auto failed = [](const char* what, cudaError_t e) {
    return ErrorResult<R>(ffi::Error::Internal(StrCat("jaxccl (cuda): ", what, " failed: ", cudaGetErrorString(e))));
  };
  Call call;
  CudaArrival& me = call.me;
  if (cudaError_t e = cudaGetDevice(&me.device); e != cudaSuccess) return failed("cudaGetDevice", e);
  if (out.untyped_data() != nullptr) {  // the buffer's device, should XLA's thread be on another one
    cudaPointerAttributes attr;
    if (cudaError_t e = cudaPointerGetAttributes(&attr, out.untyped_data()); e != cudaSuccess) {
      return failed("cudaPointerGetAttributes", e);
    }
    me.device = attr.device;
  }
  int32_t rc[2];
  cudaError_t e = cudaMemcpyAsync(rc, coords.untyped_data(), sizeof(rc), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return failed("reading coords", e);
  call.rank = rc[0];
  call.group = rc[1];
  if (call.rank < 0 || call.rank >= axis_size) {
    return ErrorResult<R>(
        ffi::Error::InvalidArgument(StrCat(target, ": rank ", call.rank, " outside axis of ", axis_size)));
  }
  me.in = x.untyped_data();
  me.out = out.untyped_data();
  me.in_elems = static_cast<int64_t>(x.element_count());
  me.out_elems = static_cast<int64_t>(out.element_count());
  me.in_dtype = x.element_type();
  me.out_dtype = out.element_type();
  me.reduce_op = *op;
  return call;
}

ffi::Error CudaCollective(cudaStream_t stream, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                          ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size,
                          int64_t reduce_op) {
  DeviceGuard guard;
  auto call = ReadCall("jaxccl_cuda_collective", stream, x, coords, *out, axis_size, reduce_op);
  if (!call.has_value()) return std::move(call.error());
  return RunLaunch(stream, run_id.run_id, slot, site, call->group, call->rank, static_cast<int32_t>(axis_size),
                   call->me, nullptr);
}

// jaxccl_cuda_collective for an axis whose ranks may run in several processes: the group attached with
// jaxccl.distributed.transport.attach (transport/proxy.h, ProcessGroup) says which ranks run here.
ffi::Error CudaMpCollective(cudaStream_t stream, ffi::RunId run_id, ffi::AnyBuffer x, ffi::AnyBuffer coords,
                            ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size,
                            int64_t reduce_op) {
  DeviceGuard guard;
  auto call = ReadCall("jaxccl_cuda_mp_collective", stream, x, coords, *out, axis_size, reduce_op);
  if (!call.has_value()) return std::move(call.error());
  const CoreApi* core = AttachedCore();
  if (core->process_group == nullptr || core->start_mapped_proxy == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxccl (cuda): this jaxccl._native does not run CUDA launches across processes (core API v3 "
                      "without process groups); rebuild both modules from one tree");
  }
  std::shared_ptr<const ProcessGroup> group;
  std::string error;
  if (!core->process_group(call->group, &group, &error)) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, error);
  if (ffi::Error e = CheckLocalRank(*group, call->group, call->rank, axis_size); e.failure()) return e;
  return RunLaunch(stream, run_id.run_id, slot, site, call->group, call->rank, static_cast<int32_t>(axis_size),
                   call->me, std::move(group));
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcclCudaMpCollective, CudaMpCollective,
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
