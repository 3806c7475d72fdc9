// Launches across processes: the process group of an axis, and the proxy that carries a launch's
// connections to ranks in other processes through the transport (transport.h), as NCCL's proxy thread
// drives its network plugin. One proxy serves every backend through its ProxyLaunch (proxy_launch.h): the
// CPU executor (cpu/executor.h) and mapped launches (mapped_launch.h: the CUDA executor's kernels, and the
// host-thread harness that runs the kernels' protocol on a CPU, handshake_harness.h).
//
// Each process runs the ranks of its local devices; the flag protocol (core/protocol.h) is unchanged
// for connections between local ranks. For a connection whose peer is in another process:
//   * a local sender's message goes to the proxy (ProxyHandle::Send, or the proxy finds it posted in the
//     receiver's shadow region: ProxyLaunch::PollPosts) instead of to the receiver; the send's completion
//     stores the `consumed` tag in the sender's region (the slot is free again) and lets the backend
//     release what it holds for the message (ProxyLaunch::SendDone);
//   * the proxy posts every receive of the launch up front into the backend's staging memory and, in
//     message order, once the slot is free, writes the local receiver's descriptor and `posted` tag,
//     so the receiver's op reads the message as it reads a local one;
//   * sends of the same bytes from one rank to several ranks of one other process share one transfer
//     (shared_sends.h), which the receiving proxy hands to each of its receivers;
//   * staging memory is reused from launch to launch (no page faults on every launch);
//   * a message of at least kInPlaceMinBytes that may land in place (shared_sends.h) travels with its trailer
//     apart, and is received straight into the receiver's output, where its op would have copied it, when the
//     transport can always end that receive (Transport::EndableInFlight: over shared memory, where the receiver
//     reads the sender's memory itself; over TCP, where the message travels in pieces of one eager fragment
//     each). When such a launch fails, the proxy ends those receives before the
//     launch returns: it cancels them and makes progress until each completed (Transport::Drain), so that
//     nothing writes into memory XLA may free; one still in flight after kInPlaceDrainSeconds (which the
//     transport says does not happen) has its sender's connection closed (Transport::Disconnect). Every other
//     message lands in staging, which a failed launch never gives back.
// Every message of a launch carries the tag (slot, group, launch number, part, connection, message) and a
// trailer with its identity (core/protocol.h, LaunchIdentity of the table checksum and the full launch
// number): the receiving proxy refuses a message of another table or launch. In host memory a message and
// its trailer are one transfer; in device memory (MemoryKind::kCuda) two, the trailer from host memory (the
// tag's part bit tells them apart). Every wait ends at the launch deadline, and a failed peer fails the
// launch with an error naming its process.
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

#include "core/table_format.h"
#include "host/common.h"
#include "transport/proxy_launch.h"
#include "transport/shared_sends.h"
#include "transport/transport.h"

namespace jaxccl {

// Which process runs each rank of one group of the collective's axes (a mesh of several axes has one
// group per coordinate of the other axes), and the transport between the processes.
struct ProcessGroup {
  int32_t process_id = 0;
  int32_t index = 0;      // the collective's coords[1]: its layout's first index plus its linear index over
                          // the layout's other mesh axes
  int32_t layout = 0;     // which attached layout (mesh and axes) it belongs to, in the order attached
  int32_t tag_index = 0;  // among the groups of every layout that span processes: tells their messages apart
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

// Whether a call of rank `rank` in group `group_index` of a collective over `axis_size` ranks may run in this
// process under the attached `group`: the group has the axis's ranks and `rank` is one of this process's.
// Both backends' FFI handlers check a call with it (inline: the CUDA module does not link jaxccl._native).
inline ffi::Error CheckLocalRank(const ProcessGroup& group, int32_t group_index, int32_t rank, int64_t axis_size) {
  if (static_cast<int64_t>(group.process_of_rank.size()) != axis_size) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: the attached mesh's groups have ", group.process_of_rank.size(),
                                              " ranks but the collective's axes have ", axis_size));
  }
  if (rank < 0 || rank >= axis_size || !group.Local(rank)) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: rank ", rank, " is not one of process ", group.process_id,
                                              "'s ranks in group ", group_index, " of the attached mesh"));
  }
  return ffi::Error::Success();
}

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

// The smallest message that lands in place (above UCX's rendezvous thresholds: shared memory and TCP move it by
// rendezvous only), and how long a failed launch waits for such a message in flight before it closes the
// sender's connection.
inline constexpr size_t kInPlaceMinBytes = 512 << 10;
inline constexpr double kInPlaceDrainSeconds = 1.0;
// Messages from other processes received in place since the process started, and connections closed because a
// failed launch left one in flight (for tests and stats).
int64_t InPlaceReceives();
int64_t InPlaceDisconnects();

// The most groups that may span processes at once (their index travels in every message's tag).
inline constexpr int32_t kMaxSpanningGroups = 256;

// Attaches the process groups of one layout (a mesh and the axes of its collectives) after those already
// attached: process_of_rank[g][r] runs rank r of the layout's group g, whose index is *first + g. An error
// when a group is malformed, this process runs no rank of the layout, another transport is attached, or too
// many groups of all layouts span processes. *layout is the layout's number (0 for the first attached).
ffi::Error AttachProcessGroups(Transport* transport, int32_t process_id,
                               const std::vector<std::vector<int32_t>>& process_of_rank, int32_t* first,
                               int32_t* layout);
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
  int64_t layout;  // the attached layout whose ranks src_rank and dst_rank are
};
inline constexpr size_t kMaxTransportRecords = 1 << 16;
void AddTransportRecord(const TransportRecord& r);
// The records since the last drain, oldest first, and how many were dropped (the buffer was full).
std::vector<TransportRecord> DrainTransportRecords(int64_t* dropped);

// "rank R, threadblock T, op I ('kind' from rank P in process Q, channel C)": global threadblock `g`, rank-local
// op `o` of `t`, a peer in another process named with its process (`group` null: every rank is local).
std::string DescribeOp(const Table& t, const ProcessGroup* group, int32_t g, int32_t o);

class Proxy final : public ProxyHandle {
 public:
  // Posts the launch's receives from other processes; the thread starts with Start(). `owned`, when given, is
  // `launch`, which the proxy then owns (a mapped launch: mapped_launch.h).
  static ffi::ErrorOr<std::unique_ptr<Proxy>> Create(ProxyLaunch* launch, std::shared_ptr<const ProcessGroup> group,
                                                      int64_t launch_number,
                                                      std::unique_ptr<ProxyLaunch> owned = nullptr);
  ~Proxy() override;
  void Start() override;
  void Send(int32_t rank, int32_t conn, int32_t msg, const void* data, size_t bytes, bool direct) override;
  void WaitDone() override;
  // What this launch's proxy posted and completed, with the tags on the wire (a deadline's diagnosis;
  // JAXCCL_TRANSPORT_TRACE=1 prints it for every launch). `pending_only`: only what is not done.
  std::string Describe(bool pending_only) const override;
  // The other processes this launch still waits for (messages from them not arrived, sends to them not
  // done), for a deadline's error: "; it waits for process 1 (2 messages from it, 1 to it)"; empty if none.
  std::string PendingProcesses() const override;
  ffi::Error Failure() const override;
  void Abort(const std::string& message, ffi::ErrorCode code) override;

 private:
  // A message and its trailer on the wire: one transfer (host memory), or two (device memory).
  static constexpr int kParts = 2;
  // One transfer from another process: what the transport receives into staging memory (and, split, its
  // trailer into host memory).
  struct InTransfer {
    TransportRequest request[kParts] = {0, 0};
    bool part_done[kParts] = {false, false};
    char* data = nullptr;  // staging, or the receiver's output (in_place)
    size_t bytes = 0;
    bool arrived = false;
    bool split = false;     // its trailer travels apart (device memory, or a message that may land in place)
    bool in_place = false;  // data is the receiver's output
    int32_t process = -1;   // the sender's
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
    TransportRequest request[kParts] = {0, 0};
    bool part_done[kParts] = {false, false};
    bool done = false;
    TransportCompletion completion;
    WireTrailer trailer;  // sent after the message's bytes; lives until the request completes
    bool split = false;   // the trailer travels apart
  };
  struct Send_ {
    int32_t rank, conn, msg, peer_rank;
    MessageRef transfer;  // the message whose transfer carries it
    bool direct;
  };
  Proxy() = default;
  void Run();
  static int PartsOf(bool split) { return split ? 2 : 1; }
  // Whether message `lead`'s trailer travels apart: in device memory, or when it may land in place (the same
  // rule in both processes).
  bool TravelsApart(const MessageRef& lead, size_t bytes) const {
    return split_ || (bytes >= kInPlaceMinBytes && shared_->MayLandInPlace(lead.conn, lead.msg));
  }
  // The identity every message of this launch carries on the wire.
  unsigned long long WireIdentity() const;
  // The tag of message `msg` of connection `conn` (part 0: the message, 1: its trailer when split).
  ffi::ErrorOr<uint64_t> TagOf(int32_t conn, int32_t msg, int part = 0) const;
  // Posts the receives of transfer `k`, named by message `lead`.
  ffi::Error PostReceive(int32_t k, const MessageRef& lead);
  // Tests transfer `x` of message `r`: true once every part arrived and its trailer is this launch's. An error
  // (naming what failed) when a part failed, has an unexpected size, or the trailer is refused.
  ffi::ErrorOr<bool> Arrived(InTransfer& x, int32_t k, const Recv& r);
  // Records the failure (the first wins) and fails the launch; FailWith also cancels what is in flight.
  void Fail(const std::string& message, ffi::ErrorCode code);
  void FailWith(const std::string& message, ffi::ErrorCode code);
  void CancelAll();
  // Tests the transfers to other processes; completes the sends whose transfer is done. False when one failed.
  bool ProgressSends(bool* progress);

  std::unique_ptr<ProxyLaunch> owned_;  // first: destroyed after everything that refers to it
  ProxyLaunch* l_ = nullptr;
  const ProxyLaunchView* v_ = nullptr;
  std::shared_ptr<const ProcessGroup> group_;
  int64_t launch_number_ = 0;
  bool split_ = false;                     // the wire layout: trailers travel on their own (MemoryKind::kCuda)
  MemoryKind memory_ = MemoryKind::kHost;  // where staging and send sources are (the staging's kind)
  std::shared_ptr<const SharedSends> shared_;
  char* staging_ = nullptr;  // every remote message of the launch (not zeroed), from the launch's StagingMemory
  std::vector<InTransfer> transfers_;
  std::vector<WireTrailer> trailers_;        // split: per transfer, its trailer (host memory)
  std::vector<Recv> recvs_;                  // in (connection, message) order
  std::vector<std::vector<int32_t>> order_;  // per connection with remote sender: indices into recvs_, by message
  std::vector<int32_t> next_;                // per such connection: next message to deliver
  std::vector<int32_t> remote_in_conns_;
  int64_t sends_expected_ = 0;
  mutable std::mutex send_mu_;
  std::map<std::pair<int32_t, int32_t>, OutTransfer> out_;  // by the (connection, message) that names it
  std::vector<Send_> sends_;                                // posted, not yet complete
  std::atomic<int64_t> sends_posted_{0};                    // messages handed to Send (the thread's progress)
  int64_t sends_done_ = 0;
  bool failed_ = false;
  mutable std::mutex failure_mu_;
  std::string failure_;
  ffi::ErrorCode failure_code_ = ffi::ErrorCode::kOk;
  std::atomic<bool> done_{false};
  std::mutex done_mu_;
  std::condition_variable done_cv_;
  std::thread thread_;
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_PROXY_H_
