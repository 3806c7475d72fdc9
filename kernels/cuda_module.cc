// jaxccl._native_cuda: the CUDA FFI capsule; attaches to the registry of jaxccl._native.
#include <nanobind/nanobind.h>

#include <string>

#include "core_api.h"
#include "cuda_handler.h"

namespace nb = nanobind;

NB_MODULE(_native_cuda, m) {
  using namespace jaxccl;
  m.doc() = "jaxccl's CUDA executor (XLA FFI); tables come from jaxccl._native's registry.";
  m.def("registrations", [] {
    nb::dict d;
    d["jaxccl_cuda_collective"] = nb::capsule(reinterpret_cast<void*>(cuda::JaxcclCudaCollective));
    return d;
  }, "FFI handler capsules by target name (platform CUDA).");
  m.def(
      "attach",
      [](nb::capsule core) {
        if (core.name() == nullptr || std::string(core.name()) != kCoreApiCapsuleName) {
          throw nb::value_error("attach() expects jaxccl._native._core_api()");
        }
        std::string error;
        if (!cuda::AttachCore(static_cast<const CoreApi*>(core.data()), &error)) throw nb::value_error(error.c_str());
      },
      nb::arg("core"), "Connects the CUDA executor to jaxccl._native's schedule registry.");
  m.def("attached", &cuda::CoreAttached);
  m.def("device_count", &cuda::DeviceCount, "Visible CUDA devices (0 without a driver or GPU).");
}
