// The transport between processes: one interface for every connection whose peer rank lives in
// another process (the executor drives it like NCCL's proxy thread drives a network plugin).
//
// A Transport joins the processes of one job. Each process publishes an opaque address through the
// job's out-of-band channel (jax.distributed's key-value store), connects to every peer's, and then
// moves the bytes of connection slots with nonblocking tagged sends and receives. A request
// completes with the steady-clock times of its post and its completion (what the meter reads), or
// fails with an error that names the peer process; every wait has a deadline.
//
// Implementations: UCX (ucx.cc, from the libucx wheel) for every backend. The CPU executor's messages
// live in host memory; a mapped launch on a GPU (transport/proxy_launch.h) sends from and receives into
// device memory, which UCX moves with its GPU support (cuda_copy, cuda_ipc between processes on one
// machine, GPUDirect RDMA where the network has it): every transfer says which memory it is in
// (MemoryKind), so UCX never has to detect it.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_H_
#define JAXCCL_XLA_FFI_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "host/common.h"

namespace jaxccl {

// Version of this interface; an implementation reports the version it was built against.
// 2: IsendWithTrailer (a message followed by a small trailer, one transfer).
// 3: the memory kind of every transfer's buffer.
// 4: PeerTransports (which of the library's transports a connection uses).
// 5: Drain, Disconnect and EndableInFlight (receives into memory the caller gives back when they fail).
inline constexpr int32_t kTransportVersion = 5;

// Which memory a transfer's buffer is in. kCuda: device memory (of the GPU current when it is posted).
// A transfer never mixes kinds: a message in device memory travels without its host trailer.
enum class MemoryKind : int32_t { kHost = 0, kCuda = 1 };

inline const char* MemoryKindName(MemoryKind kind) { return kind == MemoryKind::kCuda ? "cuda" : "host"; }

// A message's tag within one (source process, destination process) pair: the executor encodes
// (schedule slot, connection, message index) in it. Only the low kTransportTagBits bits are used.
inline constexpr int kTransportTagBits = 48;
inline constexpr uint64_t kTransportTagMask = (uint64_t{1} << kTransportTagBits) - 1;

// What a completed request reports (steady clock, NowNs()).
struct TransportCompletion {
  size_t bytes = 0;     // bytes moved (a receive: the bytes that arrived)
  int64_t post_ns = 0;  // when the request was posted
  int64_t done_ns = 0;  // when the transport reported it complete
};

using TransportRequest = int64_t;  // a handle; valid until its Wait returns

class Transport {
 public:
  virtual ~Transport() = default;

  virtual const char* name() const = 0;
  virtual int32_t version() const = 0;
  virtual int32_t process_id() const = 0;
  virtual int32_t num_processes() const = 0;

  // This process's address, to publish for the peers (opaque bytes).
  virtual ffi::ErrorOr<std::string> Address() = 0;
  // Connects to peer process `peer` at the address it published.
  virtual ffi::Error Connect(int32_t peer, const std::string& address) = 0;

  // Posts a send of `bytes` at `data` (memory of kind `memory`) to process `peer` with `tag`; `data` must
  // stay valid and unchanged until the request completes.
  virtual ffi::ErrorOr<TransportRequest> Isend(int32_t peer, uint64_t tag, const void* data, size_t bytes,
                                               MemoryKind memory) = 0;
  // Posts one message made of `bytes` at `data` followed by `trailer_bytes` at `trailer` (the executor's
  // message identity); the receiver sees bytes + trailer_bytes contiguous. Both must stay valid until
  // the request completes, and both are in memory of kind `memory` (kHost: a transfer never mixes kinds).
  virtual ffi::ErrorOr<TransportRequest> IsendWithTrailer(int32_t peer, uint64_t tag, const void* data, size_t bytes,
                                                          const void* trailer, size_t trailer_bytes,
                                                          MemoryKind memory) = 0;
  // Posts a receive of at most `bytes` into `data` (memory of kind `memory`) from process `peer` with `tag`.
  virtual ffi::ErrorOr<TransportRequest> Irecv(int32_t peer, uint64_t tag, void* data, size_t bytes,
                                               MemoryKind memory) = 0;
  // Whether `request` completed (it makes progress); an error when it failed.
  virtual ffi::ErrorOr<bool> Test(TransportRequest request) = 0;
  // Waits until `request` completes or `deadline`; frees the request. An error that names the peer
  // process when the peer failed (kUnavailable) or the deadline passed (kDeadlineExceeded); the
  // request is cancelled then.
  virtual ffi::ErrorOr<TransportCompletion> Wait(TransportRequest request, Clock::time_point deadline) = 0;
  // The error that ended the connection to `peer`, if one did (kOk while it is healthy).
  virtual ffi::Error PeerError(int32_t peer) = 0;
  // Ends `request` for good: cancels it and makes progress until it completed or `until`. True when it completed
  // (freed: nothing writes its buffer after), false when the library still owns it (a receive it matched and is
  // still moving bytes into); the request then stays the transport's, and Disconnect(peer) ends it.
  virtual ffi::ErrorOr<bool> Drain(TransportRequest request, Clock::time_point until) = 0;
  // Closes the connection to `peer` forcibly; `peer` counts as failed from then on (PeerError says `why`). The
  // last resort for a receive Drain could not end (which EndableInFlight says does not happen).
  virtual void Disconnect(int32_t peer, const std::string& why) = 0;
  // Whether a receive of `bytes` from `peer` always ends (Drain) once cancelled, also when `peer` hangs in the
  // middle of the message, so that the caller may give its buffer back after a failure (proxy.h: messages
  // that land in place).
  virtual bool EndableInFlight(int32_t peer, size_t bytes) = 0;
  // The library's "transport/device" pairs the connection to `peer` uses ("posix/memory", "tcp/eth0"), once
  // it carried a message; an error when `peer` is not a connected peer.
  virtual ffi::ErrorOr<std::vector<std::string>> PeerTransports(int32_t peer) = 0;
  // Closes every connection (forcibly: a dead peer never holds it up) and frees the transport's resources.
  virtual void Close() = 0;
};

// The transports this build has ("ucx" when the libucx wheel was found at build time).
const char* TransportsBuilt();

// Options of a transport: (name, value) pairs it passes to its library (UCX: its configuration
// variables without the UCX_ prefix, e.g. ("TLS", "tcp") to keep every byte on the network links).
using TransportOptions = std::vector<std::pair<std::string, std::string>>;

// Creates the transport `name` for process `process_id` of `num_processes`.
ffi::ErrorOr<std::unique_ptr<Transport>> MakeTransport(const std::string& name, int32_t process_id,
                                                       int32_t num_processes, const TransportOptions& options);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_H_
