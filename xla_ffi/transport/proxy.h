// The CPU executor across processes: the process group of an axis, and the proxy that carries a
// launch's connections to ranks in other processes through the transport (transport.h), as NCCL's
// proxy thread drives its network plugin.
//
// Each process runs the ranks of its local devices; the flag protocol (core/protocol.h) is unchanged
// for connections between local ranks. For a connection whose peer is in another process:
//   * a local sender's post hands the message to the proxy (an Isend of the slot's bytes) instead of
//     writing the receiver's descriptor; the send's completion stores the `consumed` tag in the
//     sender's region (the slot is free again) and releases a direct send's buffer;
//   * the proxy posts every receive of the launch up front into its own staging memory and, in
//     message order, once the slot is free, writes the local receiver's descriptor and `posted` tag,
//     so the receiver's op reads the message as it reads a local one;
//   * sends of the same bytes from one rank to several ranks of one other process share one transfer
//     (transport_shared_sends.h), which the receiving proxy hands to each of its receivers;
//   * staging memory is reused from launch to launch (no page faults on every launch).
// Every message of a launch carries the tag (slot, launch number, connection, message) and a trailer
// with its identity (core/protocol.h, LaunchIdentity of the table checksum and the full launch number):
// the receiving proxy refuses a message of another table or launch. Every wait ends at the launch
// deadline, and a failed peer fails the launch with an error naming its process.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_PROXY_H_
#define JAXCCL_XLA_FFI_TRANSPORT_PROXY_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host/common.h"
#include "transport/transport.h"
#include "transport/shared_sends.h"

namespace jaxccl {

class AlignedBuffer;
class CpuLaunch;

// Which process runs each rank of one group of the collective's axes (a mesh of several axes has one
// group per coordinate of the other axes), and the transport between the processes.
struct ProcessGroup {
  int32_t process_id = 0;
  int32_t index = 0;      // the group's linear index over the other mesh axes (the collective's coords[1])
  int32_t tag_index = 0;  // among the groups that span processes: tells their messages apart
  std::vector<int32_t> process_of_rank;  // per rank of the group
  std::vector<int32_t> local_index;      // per rank: its index among this process's ranks, or -1
  int32_t num_local = 0;
  Transport* transport = nullptr;  // owned by Python (jaxccl.distributed.transport), alive while attached
  bool Local(int32_t rank) const { return process_of_rank[rank] == process_id; }
  // Numbers the launches of a slot in this group (the same in every process: SPMD programs launch a
  // group's collectives of a slot in the same order everywhere).
  int64_t NextLaunch(int64_t slot) const;

 private:
  mutable std::mutex launches_mu_;
  mutable std::map<int64_t, int64_t> launches_;
};

// What follows every message between processes: the identity of the launch that sent it.
struct WireTrailer {
  unsigned long long identity = 0;  // LaunchIdentity(table checksum, launch number)
  unsigned long long magic = 0;     // kWireTrailerMagic: a message without a trailer is refused too
};
inline constexpr unsigned long long kWireTrailerMagic = 0x4A43434C54524C31ull;  // "JCCLTRL1"
inline constexpr size_t kWireTrailerBytes = sizeof(WireTrailer);

// What the transport module hands the native module (a capsule): a versioned handle.
struct TransportHandle {
  int32_t version = kTransportVersion;
  Transport* transport = nullptr;
};

// The most groups that may span processes at once (their index travels in every message's tag).
inline constexpr int32_t kMaxSpanningGroups = 256;

// Attaches the process groups of a mesh: process_of_rank[g][r] runs rank r of group g. An error when a
// group is malformed, this process runs no rank at all, or too many groups span processes.
ffi::Error AttachProcessGroups(Transport* transport, int32_t process_id,
                               const std::vector<std::vector<int32_t>>& process_of_rank);
void DetachProcessGroups();
// The attached group `index`: an error naming what is missing when none is attached or it has no such group.
ffi::ErrorOr<std::shared_ptr<const ProcessGroup>> ProcessGroupOf(int32_t index);
// Whether JAXCCL_TRANSPORT_TRACE is set: every launch across processes prints what it posted (stderr).
bool TraceLaunches();
// Numbers the launches of `slot` in `group` (ProcessGroup::NextLaunch).
int64_t NextLaunchNumber(const ProcessGroup& group, int64_t slot);

// One message to a rank in another process, as the sender's transport saw it: its post and its
// completion (steady clock). Taken by the proxy for every completed send; drained by Python
// (jaxccl.distributed.transport.TransportMeter), which turns them into measured link rates.
struct TransportRecord {
  int64_t src_rank, dst_rank, bytes, post_ns, done_ns;
};
inline constexpr size_t kMaxTransportRecords = 1 << 16;
void AddTransportRecord(const TransportRecord& r);
// The records since the last drain, oldest first, and how many were dropped (the buffer was full).
std::vector<TransportRecord> DrainTransportRecords(int64_t* dropped);

class CpuProxy {
 public:
  // Posts the launch's receives from other processes; the thread starts with Start().
  static ffi::ErrorOr<std::unique_ptr<CpuProxy>> Create(CpuLaunch* launch, std::shared_ptr<const ProcessGroup> group,
                                                         int64_t launch_number);
  ~CpuProxy();
  void Start();
  // A local rank posts message `msg` of connection `conn` to a rank in another process.
  void Send(int32_t rank, int32_t conn, int32_t msg, const void* data, size_t bytes, bool direct);
  // Waits until every message of the launch to or from other processes completed, or the launch failed.
  void WaitDone();
  // What this launch's proxy posted and completed, with the tags on the wire (a deadline's diagnosis;
  // JAXCCL_TRANSPORT_TRACE=1 prints it for every launch). `pending_only`: only what is not done.
  std::string Describe(bool pending_only) const;
  // The other processes this launch still waits for (messages from them not arrived, sends to them not
  // done), for a deadline's error: "; it waits for process 1 (2 messages from it, 1 to it)"; empty if none.
  std::string PendingProcesses() const;

 private:
  // One transfer from another process: what the transport receives into staging memory.
  struct InTransfer {
    TransportRequest request;
    char* data;
    size_t bytes;
    bool arrived = false;
  };
  // One message from another process to a local rank: its transfer (shared with other messages of
  // the same bytes, or its own).
  struct Recv {
    int32_t conn, msg, rank, peer_rank;
    size_t bytes;
    int32_t transfer;
    bool delivered = false;
  };
  // One transfer to another process: posted by the first of its messages a local rank sends.
  struct OutTransfer {
    TransportRequest request = 0;
    bool done = false;
    TransportCompletion completion;
    WireTrailer trailer;  // sent after the message's bytes; lives until the request completes
  };
  struct Send_ {
    int32_t rank, conn, msg, peer_rank;
    MessageRef transfer;  // the message whose transfer carries it
    bool direct;
  };
  CpuProxy() = default;
  void Run();
  // The identity every message of this launch carries on the wire.
  unsigned long long WireIdentity() const;
  ffi::ErrorOr<uint64_t> TagOf(int32_t conn, int32_t msg) const;
  // Fails the launch with `e` (naming the peer process), cancels what is in flight.
  void FailWith(const std::string& message, ffi::ErrorCode code);
  void CancelAll();
  // Tests the transfers to other processes; completes the sends whose transfer is done. False when one failed.
  bool ProgressSends(bool* progress);

  CpuLaunch* l_ = nullptr;
  std::shared_ptr<const ProcessGroup> group_;
  int64_t launch_number_ = 0;
  std::shared_ptr<const SharedSends> shared_;
  std::unique_ptr<AlignedBuffer> staging_;  // every remote message of the launch (64-byte aligned, not zeroed)
  std::vector<InTransfer> transfers_;
  std::vector<Recv> recvs_;                  // in (connection, message) order
  std::vector<std::vector<int32_t>> order_;  // per connection with remote sender: indices into recvs_, by message
  std::vector<int32_t> next_;                // per such connection: next message to deliver
  std::vector<int32_t> remote_in_conns_;
  int64_t sends_expected_ = 0;
  mutable std::mutex send_mu_;
  std::map<std::pair<int32_t, int32_t>, OutTransfer> out_;  // by the (connection, message) that names it
  std::vector<Send_> sends_;                                // posted, not yet complete
  int64_t sends_done_ = 0;
  bool failed_ = false;
  std::atomic<bool> done_{false};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::thread thread_;
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_PROXY_H_
