// The versioned interface through which the optional CUDA module (jaxccl._native_cuda)
// reaches the registry that lives in jaxccl._native. Both modules are built from
// this tree with one toolchain; the struct carries a version and its size so a
// mismatched pair refuses to attach instead of misbehaving.
#ifndef JAXCCL_XLA_FFI_CORE_API_H_
#define JAXCCL_XLA_FFI_CORE_API_H_

#include <cstdint>
#include <string>

#include "registry.h"

namespace jaxccl {

inline constexpr uint32_t kCoreApiVersion = 1;
inline constexpr const char* kCoreApiCapsuleName = "jaxccl.core_api";

struct CoreApi {
  uint32_t version;
  uint32_t struct_size;
  // The slot's current table for one launch (counts the launch). On failure returns false and sets *error.
  bool (*acquire)(int64_t slot, TableSnapshot* out, std::string* error);
  // The deadline of every rendezvous and wait, in seconds.
  double (*timeout_s)();
};

const CoreApi* GetCoreApi();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_API_H_
