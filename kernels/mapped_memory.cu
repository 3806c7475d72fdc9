// The memory of a CUDA launch across processes (mapped_memory.h): host-mapped flag regions and device
// staging. GPU-only, allocation only.
#include "mapped_memory.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>

#include "launch.h"

namespace jaxccl {
namespace cuda {
namespace {

ffi::Error CudaFailed(const char* what, cudaError_t e) {
  return ffi::Error::Internal(StrCat("jaxccl (cuda): ", what, " failed: ", cudaGetErrorString(e)));
}

}  // namespace

ffi::ErrorOr<char*> PrepareMappedRegion(MappedRegions* m, const RegionOwner& owner, uint64_t epoch) {
  using R = char*;
  const size_t region = owner.layout.bytes();
  if (m->bytes < 2 * region) {
    if (m->host != nullptr) {
      if (cudaError_t e = cudaFreeHost(m->host); e != cudaSuccess) return ErrorResult<R>(CudaFailed("cudaFreeHost", e));
    }
    m->host = nullptr;
    m->bytes = 0;
    void* p = nullptr;
    if (cudaError_t e = cudaHostAlloc(&p, 2 * region, cudaHostAllocPortable | cudaHostAllocMapped); e != cudaSuccess) {
      return ErrorResult<R>(CudaFailed("cudaHostAlloc(flag regions)", e));
    }
    m->host = static_cast<char*>(p);
    m->bytes = 2 * region;
    m->owned = false;
  }
  // Fresh memory, or another table or layout: its words would read as tags of any epoch (core/protocol.h).
  if (!m->owned || RegionNeedsClearing(m->owner, owner)) std::memset(m->host, 0, m->bytes);
  m->owner = owner;
  m->owned = true;
  char* r = m->host + (epoch & 1) * region;
  std::memset(r + owner.layout.error(), 0, 16);
  return r;
}

MappedRegions& ShadowRegionsLocked(int64_t slot, int64_t group, int32_t rank) {
  static auto* shadows = new std::map<std::tuple<int64_t, int64_t, int32_t>, MappedRegions>();
  return (*shadows)[{slot, group, rank}];
}

ffi::ErrorOr<char*> DeviceAddress(char* host) {
  void* dev = nullptr;
  if (cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0); e != cudaSuccess) {
    return ErrorResult<char*>(CudaFailed("cudaHostGetDevicePointer", e));
  }
  return static_cast<char*>(dev);
}

ffi::ErrorOr<char*> DeviceStaging::Acquire(size_t bytes) {
  const size_t size = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = free_.lower_bound(size); it != free_.end()) {
    char* p = it->second;
    used_[p] = it->first;
    free_.erase(it);
    return p;
  }
  DeviceGuard guard;  // the proxy's thread (or a rank's) keeps its current device
  void* p = nullptr;
  cudaError_t e = cudaSetDevice(device_);
  if (e == cudaSuccess) e = cudaMalloc(&p, size);
  if (e != cudaSuccess) {
    return ErrorResult<char*>(ffi::Error(
        ffi::ErrorCode::kResourceExhausted,
        StrCat("jaxccl (cuda): cannot allocate ", size, " bytes on GPU ", device_,
               " for messages from other processes: ", cudaGetErrorString(e))));
  }
  used_[static_cast<char*>(p)] = size;
  return static_cast<char*>(p);
}

void DeviceStaging::Release(char* data, bool reusable) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.find(data);
  if (it == used_.end()) return;
  const size_t size = it->second;
  used_.erase(it);
  if (!reusable) return;  // left to the transport for good
  free_.emplace(size, data);
  if (free_.size() > kMaxPooled) {
    surplus_.push_back(free_.begin()->second);  // the smallest
    free_.erase(free_.begin());
  }
}

void DeviceStaging::Trim() {
  std::vector<char*> surplus;
  {
    std::lock_guard<std::mutex> lock(mu_);
    surplus.swap(surplus_);
  }
  if (surplus.empty()) return;
  DeviceGuard guard;
  if (cudaSetDevice(device_) != cudaSuccess) return;
  for (char* p : surplus) (void)cudaFree(p);
}

DeviceStaging& StagingOf(int device) {
  static std::mutex mu;
  static auto* staging = new std::map<int, std::unique_ptr<DeviceStaging>>();
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<DeviceStaging>& s = (*staging)[device];
  if (!s) s = std::make_unique<DeviceStaging>(device);
  return *s;
}

}  // namespace cuda
}  // namespace jaxccl
