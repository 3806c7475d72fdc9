// A launch whose ranks run elsewhere and reach the proxy through host-visible memory (MappedLaunchSpec,
// proxy_launch.h): the CUDA executor's kernels (kernels/), and the harness that runs the kernels' protocol
// with host threads on a CPU (handshake_harness.h). This class and the memory are the whole handshake
// between such ranks and the proxy (proxy.h); nothing in it is CUDA.
//
//   * Every rank of the group has a flag region (RegionLayout, core/protocol.h) in host-visible memory: a
//     local rank the one its kernel uses, a rank of another process a shadow. A local rank posts a message
//     to a rank of another process exactly as to a local one (descriptor, then the posted tag, into the
//     receiver's region: the shadow), and stores the consumed tag of a message from one into the sender's
//     region (the shadow).
//   * The proxy thread polls the shadows' posted tags (PollPosts) and sends each posted message (its
//     descriptor's pointer and bytes) to the receiver's process; once the send completed, the proxy stores
//     the consumed tag into the local sender's region (the kernel's drain waits for it, and the slot is free).
//   * Messages from other processes the proxy delivers as on every backend: descriptor (a pointer into the
//     staging, spec.staging), then posted tag, into the local receiver's region, once the consumed tag in
//     the sender's shadow says the slot is free.
//   * A failure of the proxy (a process failed, the deadline, a stale message) stores kPeerFailed into the
//     error word of every local rank's region that has none yet, so their kernels stop waiting; and a local
//     rank that records an error (its kernel failed by itself) stops the proxy.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_MAPPED_LAUNCH_H_
#define JAXCCL_XLA_FFI_TRANSPORT_MAPPED_LAUNCH_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "host/common.h"
#include "transport/proxy_launch.h"

namespace jaxccl {

struct ProcessGroup;

// A mapped launch's ranks wait this much longer than its proxy (their deadline comes after view.deadline), so
// that a launch that waits for another process fails with the proxy's error, which names the process (the
// proxy's kPeerFailed stops the ranks), rather than with a rank's timeout.
inline constexpr double kMappedRankGraceS = 1.0;

class MappedLaunch final : public ProxyLaunch {
 public:
  // Checks the spec against the group (a region per rank, 8-byte aligned; staging) and plans the polls.
  static ffi::ErrorOr<std::unique_ptr<MappedLaunch>> Create(const MappedLaunchSpec& spec,
                                                            std::shared_ptr<const ProcessGroup> group);

  const ProxyLaunchView& view() const override { return spec_.view; }
  std::atomic<uint64_t>* Flag(int32_t rank, size_t offset, size_t index) const override;
  MsgDesc* Desc(int32_t rank, size_t cell) const override;
  void Delivered(int32_t rank, size_t cell) override {}  // the kernel polls its flags
  void SendDone(int32_t rank, int32_t conn, int32_t msg, bool direct) override {}  // ... and its consumed tags
  void PollPosts(ProxyHandle& proxy) override;
  void Fail(const std::string& message, ffi::ErrorCode code) override;
  bool Aborted() const override;
  std::string Where(int32_t global_tb, int32_t rank_op) const override;
  StagingMemory& staging() override { return *spec_.staging; }

 private:
  // A connection from a local sender to a rank of another process, and per slot the next message to send.
  struct OutConn {
    int32_t conn, sender, receiver, total;
    std::vector<int32_t> next;  // per slot s: the next message on it (s, s + num_slots, ...)
  };
  MappedLaunch() = default;
  // Rank `rank`'s error word (code, threadblock, op), core/protocol.h.
  std::atomic<int32_t>* ErrorWord(int32_t rank) const;

  MappedLaunchSpec spec_;
  std::shared_ptr<const ProcessGroup> group_;
  std::vector<int32_t> local_;  // the local ranks
  std::vector<OutConn> out_;
  std::atomic<bool> failed_{false};
};

// Starts the proxy of a mapped launch of `group` (CoreApi::start_mapped_proxy, host/core_api.h): draws the
// launch number of spec.view.slot in the group, posts the launch's receives from other processes and starts
// the proxy thread. The handle owns the MappedLaunch; spec.staging and the regions must outlive it.
ffi::ErrorOr<std::unique_ptr<ProxyHandle>> StartMappedProxy(const MappedLaunchSpec& spec,
                                                            std::shared_ptr<const ProcessGroup> group);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_MAPPED_LAUNCH_H_
