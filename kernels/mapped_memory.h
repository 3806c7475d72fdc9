// The GPU-only part of a CUDA launch whose group spans processes: the memory of its handshake with the
// proxy that lives in jaxccl._native (transport/proxy_launch.h, MappedLaunchSpec). This file and its .cu
// are allocation only; launch.cu wires the memory into the kernel's arguments and the proxy's spec.
//   * Flag regions in pinned host memory mapped into the device (cudaHostAlloc Portable | Mapped): the
//     proxy reads and writes them as host memory, kernels through their device addresses. Two regions
//     (by the launch epoch's parity, as a workspace's device regions) per (schedule slot, device) for
//     this process's ranks, and per (slot, group, rank) as the shadow of a rank of another process.
//   * Staging for messages from other processes in device memory (DeviceStaging: cudaMalloc, pooled).
// The proxy, its poll of the shadows, the transport and every rule of the handshake are jaxccl._native's
// (the same code the CPU executor runs); the interpreter kernel does not know a peer is remote.
#ifndef JAXCCL_KERNELS_MAPPED_MEMORY_H_
#define JAXCCL_KERNELS_MAPPED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/protocol.h"
#include "host/common.h"
#include "transport/proxy_launch.h"

namespace jaxccl {
namespace cuda {

// Two host-mapped flag regions of one layout, picked by the launch epoch's parity.
struct MappedRegions {
  char* host = nullptr;  // pinned, mapped; never freed while a launch of its key may use it
  size_t bytes = 0;
  RegionOwner owner{};  // what the regions' contents belong to (core/protocol.h, RegionNeedsClearing)
  bool owned = false;
};

// The host address of the region of `epoch` in `m`, sized for `owner.layout` and cleared when its contents
// belong to another owner; its error word is zeroed (the kernel's and the proxy's, for this launch). No
// kernel or proxy of an earlier launch may still use `m` (WorkspaceMutex held, workspace.h).
ffi::ErrorOr<char*> PrepareMappedRegion(MappedRegions* m, const RegionOwner& owner, uint64_t epoch);

// The shadow regions of rank `rank` (of another process) in group `group` of schedule slot `slot`.
// WorkspaceMutex held.
MappedRegions& ShadowRegionsLocked(int64_t slot, int64_t group, int32_t rank);

// The device address of host-mapped memory `host` for the calling thread's current device.
ffi::ErrorOr<char*> DeviceAddress(char* host);

// Device memory of one GPU the proxy receives messages from other processes into (MemoryKind::kCuda).
// Blocks are pooled for the next launches; a block released as not reusable (after a failed launch the
// transport may still write a cancelled receive into it) is never reused nor freed.
class DeviceStaging final : public StagingMemory {
 public:
  explicit DeviceStaging(int device) : device_(device) {}
  MemoryKind kind() const override { return MemoryKind::kCuda; }
  ffi::ErrorOr<char*> Acquire(size_t bytes) override;
  void Release(char* data, bool reusable) override;
  // Frees the released blocks beyond the pool's bound. cudaFree waits for the whole device, so it runs
  // only here, on a rank's thread after its launch's proxy is gone, never on a proxy thread (whose
  // kernel may be waiting for it).
  void Trim();

 private:
  static constexpr size_t kMaxPooled = 4;
  const int device_;
  std::mutex mu_;
  std::multimap<size_t, char*> free_;  // pooled blocks by size
  std::map<char*, size_t> used_;       // acquired blocks and their sizes
  std::vector<char*> surplus_;         // released beyond kMaxPooled, freed by Trim
};

// The staging of GPU `device` (process-wide, never destroyed: it outlives every proxy).
DeviceStaging& StagingOf(int device);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_MAPPED_MEMORY_H_
