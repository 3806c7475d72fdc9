// The versioned interface through which the optional CUDA module (jaxccl._native_cuda)
// reaches the registry that lives in jaxccl._native. Both modules are built from
// this tree with one toolchain; the struct carries a version and its size so a
// mismatched pair refuses to attach instead of misbehaving.
#ifndef JAXCCL_XLA_FFI_CORE_API_H_
#define JAXCCL_XLA_FFI_CORE_API_H_

#include <cstdint>
#include <memory>
#include <string>

#include "host/registry.h"
#include "transport/proxy_launch.h"

namespace jaxccl {

struct ProcessGroup;

// Version 2: the CUDA path numbers each rank's call (note_issued) and acquires the table for the launch's
// agreed sequence number (the largest any rank issued), so a staged table becomes current at the same
// call on every backend (MCCL Sec. 6.2.2; docs/executor.md, "Hot-swap").
// Version 3: launches across processes (process_group, start_mapped_proxy): the CUDA executor's ranks in other
// processes are reached through the proxy and transport that live in jaxccl._native (transport/proxy_launch.h).
inline constexpr uint32_t kCoreApiVersion = 3;
inline constexpr const char* kCoreApiCapsuleName = "jaxccl.core_api";

struct CoreApi {
  uint32_t version;
  uint32_t struct_size;
  // Numbers rank `rank`'s call on the slot: *seq = its sequence number (1, 2, ...). False (with *error) on failure.
  bool (*note_issued)(int64_t slot, int32_t rank, int64_t* seq, std::string* error);
  // The slot's table for the launch whose sequence number is `seq` (counts the launch): a staged table
  // becomes current once `seq` is past its transition point. On failure returns false and sets *error.
  bool (*acquire)(int64_t slot, int64_t seq, TableSnapshot* out, std::string* error);
  // The deadline of every rendezvous and wait, in seconds.
  double (*timeout_s)();
  // The attached process group `index` (transport/proxy.h, ProcessGroupOf). False (with *error) when none is.
  bool (*process_group)(int32_t index, std::shared_ptr<const ProcessGroup>* out, std::string* error);
  // Starts the proxy of a mapped launch (transport/proxy_launch.h) of `group`: draws the launch number of
  // spec.view.slot in the group, posts the launch's receives from other processes and starts the proxy thread.
  // False (with *error) when it cannot.
  bool (*start_mapped_proxy)(const MappedLaunchSpec& spec, std::shared_ptr<const ProcessGroup> group,
                             std::unique_ptr<ProxyHandle>* out, std::string* error);
};

const CoreApi* GetCoreApi();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_CORE_API_H_
