// What the proxy of a launch across processes (proxy.h) needs from the launch it serves, and the
// handshake through which a launch whose ranks run elsewhere (CUDA kernels) reaches it.
//
// The proxy is one implementation for every backend: it posts the launch's receives from other
// processes into staging memory, delivers them to local receivers in message order once their slot is
// free, sends what local ranks post to other processes, checks every message's wire identity, ends
// every wait at the launch deadline and records every completed send for the meter. A backend gives
// it a ProxyLaunch:
//   * the CPU executor (cpu/executor.h): its rank threads post a message to another process by
//     calling ProxyHandle::Send, and the proxy wakes their waits;
//   * a mapped launch (transport/mapped_launch.h): every rank's flag region is host-visible memory
//     (on a GPU: pinned host memory mapped into the device); a rank of another process has a shadow
//     region in which local ranks post their messages to it exactly as to a local rank (descriptor,
//     then the posted tag) and into which they store the consumed tags of its messages. The proxy
//     polls the shadows' posted tags (PollPosts) - that poll, and the memory, are the whole
//     device-to-proxy handshake.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_PROXY_LAUNCH_H_
#define JAXCCL_XLA_FFI_TRANSPORT_PROXY_LAUNCH_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/protocol.h"
#include "core/table_format.h"
#include "host/common.h"
#include "transport/transport.h"

namespace jaxccl {

// Where a launch's messages live (MemoryKind, transport.h): send sources and receive staging. kCuda: device
// memory; the transport moves it with the library's GPU support (UCX: cuda_copy, cuda_ipc, GPUDirect RDMA),
// and every message's wire trailer travels as a second transfer from host memory (a transfer never mixes
// memory kinds).

// Memory the proxy receives messages from other processes into (kHost: pooled host memory;
// kCuda: device memory of the launch's GPU). Implemented by the backend; called by the proxy thread.
class StagingMemory {
 public:
  virtual ~StagingMemory() = default;
  // The memory the staging and the launch's send sources are in: what the proxy tells the transport.
  virtual MemoryKind kind() const = 0;
  // At least `bytes` bytes, 256-byte aligned, valid until Release (or forever: see Release).
  virtual ffi::ErrorOr<char*> Acquire(size_t bytes) = 0;
  // Gives `data` back for reuse; `reusable` is false after a failed launch (the transport may still
  // write a cancelled receive into it): the memory must then never be reused nor freed.
  virtual void Release(char* data, bool reusable) = 0;
};

// What stays fixed for the whole launch.
struct ProxyLaunchView {
  std::shared_ptr<const Table> table;
  int64_t slot = 0;
  int64_t version = 0;  // the registry version of the table
  int32_t tiles = 1;
  RegionLayout layout{};
  uint64_t epoch = 0;                // the launch's flag epoch in this process (core/protocol.h, Tag)
  unsigned long long identity = 0;   // LaunchIdentity(checksum, epoch): the descriptors the proxy writes carry it
  Clock::time_point deadline;
  double timeout_s = 0;
  std::vector<RankBuffers> buffers;  // per rank of the group: the chunk geometry (RecvBytes); pointers unused
  // The wire layout: kHost sends a message and its trailer as one transfer, kCuda as two (the trailer from
  // host memory). The staging's kind() says which memory the bytes are in (tests run kCuda's layout over
  // host memory).
  MemoryKind memory = MemoryKind::kHost;
};

class ProxyHandle;

class ProxyLaunch {
 public:
  virtual ~ProxyLaunch() = default;
  virtual const ProxyLaunchView& view() const = 0;
  // A flag word / message descriptor of rank `rank`'s region (host memory the proxy may access; every rank
  // of the group has a region in this process, a rank of another process its shadow).
  virtual std::atomic<uint64_t>* Flag(int32_t rank, size_t offset, size_t index) const = 0;
  virtual MsgDesc* Desc(int32_t rank, size_t cell) const = 0;
  // The proxy stored the posted tag of a message for local rank `rank` in `cell`: wake its waits.
  virtual void Delivered(int32_t rank, size_t cell) = 0;
  // Local rank `rank`'s message `msg` of connection `conn` left for another process and the proxy stored its
  // consumed tag: release what the backend holds for it (`direct`: it was sent from the rank's own buffer).
  virtual void SendDone(int32_t rank, int32_t conn, int32_t msg, bool direct) = 0;
  // Called by the proxy thread on every turn: hands the messages local ranks posted to other processes to
  // proxy.Send. The CPU executor posts through ProxyHandle::Send directly and polls nothing.
  virtual void PollPosts(ProxyHandle& proxy) { (void)proxy; }
  // Fails the launch (the first failure wins) and makes its ranks stop.
  virtual void Fail(const std::string& message, ffi::ErrorCode code) = 0;
  virtual bool Aborted() const = 0;
  // "rank R, threadblock T, op I ('kind' from rank P in process Q, channel C)" for errors.
  virtual std::string Where(int32_t global_tb, int32_t rank_op) const = 0;
  virtual StagingMemory& staging() = 0;
};

// The proxy of one launch, as a backend drives it (virtual: the CUDA module drives the proxy that lives in
// jaxccl._native through this interface, host/core_api.h).
class ProxyHandle {
 public:
  virtual ~ProxyHandle() = default;  // joins the proxy thread
  // Starts the proxy thread (after the launch's ranks may be woken).
  virtual void Start() = 0;
  // A local rank posts message `msg` of connection `conn` to a rank in another process.
  virtual void Send(int32_t rank, int32_t conn, int32_t msg, const void* data, size_t bytes, bool direct) = 0;
  // Waits until every message of the launch to or from other processes completed, or the launch failed.
  virtual void WaitDone() = 0;
  // "; the launch waits for process 1 (2 message(s) from it not arrived, ...)", empty when it waits for none.
  virtual std::string PendingProcesses() const = 0;
  // What the proxy posted and completed (a deadline's diagnosis). `pending_only`: only what is not done.
  virtual std::string Describe(bool pending_only) const = 0;
  // The launch's failure as the proxy saw it (Success while none): for a mapped launch, whose ranks learn of
  // it through the kPeerFailed code the proxy stores in every local rank's region (core/protocol.h).
  virtual ffi::Error Failure() const = 0;
  // The backend's ranks failed (e.g. a kernel's own deadline): fail the launch and cancel what is in flight.
  virtual void Abort(const std::string& message, ffi::ErrorCode code) = 0;
};

// A launch whose ranks run elsewhere and post through host-visible regions (the handshake above).
struct MappedLaunchSpec {
  ProxyLaunchView view;
  // Per rank of the group: the host address of its flag region of this launch (RegionLayout bytes, 8-byte
  // aligned, host-visible): a local rank's is the one its kernel uses, another process's rank's the shadow.
  std::vector<char*> regions;
  StagingMemory* staging = nullptr;  // owned by the backend, alive until the proxy is destroyed
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_PROXY_LAUNCH_H_
