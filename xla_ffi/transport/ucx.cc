// The UCX transport (transport.h): one UCP worker per process with the tag-matching API and an endpoint per
// peer process. A dead peer fails its requests instead of aborting the job:
//   * a peer on another machine (or every peer, when the transport's options choose UCX's transports, e.g.
//     NETWORK_ONLY): the endpoint is in UCX's peer-failure mode, which only network transports support;
//   * a peer on this machine (same boot and process namespace): the endpoint lets UCX use shared memory
//     (posix/sysv and cma: one copy, against two over loopback TCP and its kernel work), and the transport
//     watches the peer process itself through a pidfd; its exit fails the requests on it as a peer failure does.
// Every published address starts with the publisher's HostIdentity, which is how a peer tells the two apart.
// Over TCP (a context whose only network transport is tcp, and no UCX variable that moves its protocol choice)
// a message travels in pieces of one eager fragment each (kUcxTcpPieceBytes), so that a receive UCX matched has
// also completed: nothing writes into a receive's buffer after it was cancelled.
//
// Tags: the source process in the high 16 bits, the caller's 48-bit tag below, so a receive matches
// exactly one (peer, tag). All UCP calls of a transport run under one mutex; a waiting thread
// drives progress itself, and the transport's progress thread drives it whenever nobody else has
// for kIdleProgressPeriod. Progress must never stop while the process waits elsewhere: UCX reports a
// send complete once its bytes are in UCX's own buffers (over TCP, a user-space segment when the
// socket is full) and moves them, and answers a peer's rendezvous, only inside progress. A process
// that stopped progressing after a launch (waiting in jax.distributed's key-value store for a peer)
// held back the tail of a message that the peer's launch waited for: both waited until a deadline.
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "transport/ucx_settings.h"

namespace jaxccl {
namespace {

// How long progress may pause before the progress thread drives it (an idle process costs a wakeup per period).
constexpr std::chrono::microseconds kIdleProgressPeriod{500};
// How often progress looks whether a peer process on this machine exited (one poll() of their pidfds), and how
// long a request that failed on such a peer waits to see the process exit.
constexpr int64_t kLivenessPeriodNs = 1'000'000;
constexpr int kExitGraceMs = 200;
// From this size UCX 1.22 sends a message over shared memory by rendezvous only (UCX_PROTO_INFO=y: multi-fragment
// eager ends below 256 KiB), unless UCX_RNDV_THRESH moves the switch.
constexpr size_t kSharedMemoryRendezvousBytes = 256 << 10;
// Over TCP a message travels in pieces (pieced_, per peer): bytes / kUcxTcpPieceBytes (ucx_settings.h) pieces of
// kUcxTcpPieceBytes, then a last, shorter one (possibly empty), each a tagged message with the message's tag; UCX
// matches one sender's messages of one tag in the order they were sent, and the receiver posts the pieces in that
// order. With kTcpPieceSettings every piece is one eager fragment (UCX 1.22, UCX_PROTO_INFO=y: "eager zero-copy
// copy-out" up to kUcxEagerFragmentBytes; tests/distributed/test_multiprocess_native.py pins it), which UCX matches
// and writes in one step: a piece's receive is unmatched, and a cancel ends it at once, or complete. A whole large
// message is a rendezvous whose fragments the sender pushes and UCX matches by the receive's id, which nothing ends
// while the sender hangs (EndableInFlight). Pieces cost no more over TCP than whole messages, less up to a few MiB
// (benchmarks/multiprocess/tcp_pieces.py). Why a piece is that size and not larger: ucx_settings.h.
//
// What makes every piece one eager fragment: larger TCP segments, and UCX's protocol choice at its defaults, which
// the transport sets so that no UCX configuration file (ucx.conf, UCX_CONFIG_FILE) moves them. When the environment
// or the transport's options set any of these, the caller chose UCX's protocols, and messages travel whole.
constexpr std::pair<const char*, const char*> kTcpPieceSettings[] = {
    {"TCP_TX_SEG_SIZE", "64k"}, {"TCP_RX_SEG_SIZE", "128k"}, {"RNDV_THRESH", "auto"}, {"RNDV_SCHEME", "auto"},
    {"ZCOPY_THRESH", "auto"},   {"BCOPY_THRESH", "auto"},    {"PROTO_ENABLE", "y"}};
// UCX transports that never leave the machine: next to them, a context whose every other transport is tcp sends
// over the network by TCP only.
constexpr const char* kLocalTransports[] = {"self",     "posix",    "sysv",      "cma",       "knem",
                                            "xpmem",    "cuda_copy", "cuda_ipc", "gdr_copy",  "rocm_copy",
                                            "rocm_ipc", "rocm_gdr", "ze_copy",   "ze_ipc"};

// What precedes the worker address in a published address: where the publisher runs.
struct HostIdentity {
  uint64_t magic = 0;  // kAddressMagic
  char boot_id[40] = {};  // /proc/sys/kernel/random/boot_id: the machine's current boot
  uint64_t pid_ns_dev = 0, pid_ns_ino = 0;  // /proc/self/ns/pid: process ids mean the same in both processes
  int64_t pid = 0;
  uint32_t pieces = 0;  // 1: the publisher sends to peers over TCP in pieces (kUcxTcpPieceBytes)
  uint32_t reserved = 0;
};
constexpr uint64_t kAddressMagic = 0x4A43434C55435833ull;  // "JCCLUCX3"

HostIdentity ThisHost() {
  HostIdentity h;
  h.magic = kAddressMagic;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (boot && std::getline(boot, id)) std::strncpy(h.boot_id, id.c_str(), sizeof(h.boot_id) - 1);
  struct stat ns{};
  if (stat("/proc/self/ns/pid", &ns) == 0) {
    h.pid_ns_dev = static_cast<uint64_t>(ns.st_dev);
    h.pid_ns_ino = static_cast<uint64_t>(ns.st_ino);
  }
  h.pid = static_cast<int64_t>(getpid());
  return h;
}

// Whether `a` and `b` run on one machine in one process namespace (an unknown boot or namespace: never).
bool SameHost(const HostIdentity& a, const HostIdentity& b) {
  return a.boot_id[0] != 0 && a.pid_ns_ino != 0 && std::strncmp(a.boot_id, b.boot_id, sizeof(a.boot_id)) == 0 &&
         a.pid_ns_dev == b.pid_ns_dev && a.pid_ns_ino == b.pid_ns_ino;
}

// Whether the UCX variable `variable` (without "UCX_") is set, in the environment or in `options`.
bool Configured(const TransportOptions& options, const char* variable) {
  if (std::getenv(StrCat("UCX_", variable).c_str()) != nullptr) return true;
  return std::any_of(options.begin(), options.end(), [&](const auto& option) { return option.first == variable; });
}

// Whether a context with `transports` ("tl/dev") reaches other machines by TCP alone: it has tcp, and every other
// transport stays on the machine.
bool NetworkIsTcpOnly(const std::vector<std::string>& transports) {
  bool tcp = false;
  for (const std::string& entry : transports) {
    const std::string tl = entry.substr(0, entry.find('/'));
    if (tl == "tcp") {
      tcp = true;
    } else if (std::find(std::begin(kLocalTransports), std::end(kLocalTransports), tl) == std::end(kLocalTransports)) {
      return false;
    }
  }
  return tcp;
}

// A descriptor that becomes readable when process `pid` exits (-1: not available, errno says why).
int OpenPidfd(int64_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

struct UcxRequestState {
  bool done = false;
  ucs_status_t status = UCS_OK;
  size_t bytes = 0;
  int64_t done_ns = 0;
};

// One tagged message of UCX: a request's whole message, or one of its pieces over TCP.
struct UcxPiece {
  UcxRequestState state;
  void* ucp_request = nullptr;  // null when UCP completed it inline
  size_t bytes = 0;             // posted: what it sends, or at most receives
  bool cancelled = false;       // asked UCX to cancel it
  ucp_dt_iov_t iov[2] = {};     // a send that spans the message and its trailer: UCP reads it until it completes
  ucp_tag_recv_info_t recv_info = {};  // a receive that completes inline: what arrived
};

struct UcxRequest {
  std::vector<UcxPiece> pieces;  // sized before the first is posted: UCP keeps pointers to their states
  int32_t peer = 0;
  bool is_send = false;
  size_t posted_bytes = 0;
  int64_t post_ns = 0;

  // The pieces that make up the message: all of a send's; a receive's up to the first that arrived shorter than
  // posted, which ends the message (the pieces behind it are cancelled, and never written).
  size_t Counted() const {
    if (is_send) return pieces.size();
    for (size_t i = 0; i < pieces.size(); ++i) {
      const UcxRequestState& s = pieces[i].state;
      if (s.done && s.status == UCS_OK && s.bytes < pieces[i].bytes) return i + 1;
    }
    return pieces.size();
  }
  // Whether it completed: one piece of the message failed, or every piece completed.
  bool Done() const {
    if (Status() != UCS_OK) return true;
    const size_t n = Counted();
    for (size_t i = 0; i < n; ++i) {
      if (!pieces[i].state.done) return false;
    }
    return true;
  }
  // The first failed piece's status, or UCS_OK.
  ucs_status_t Status() const {
    const size_t n = Counted();
    for (size_t i = 0; i < n; ++i) {
      if (pieces[i].state.done && pieces[i].state.status != UCS_OK) return pieces[i].state.status;
    }
    return UCS_OK;
  }
  // A completed receive: the bytes that arrived.
  size_t Arrived() const {
    const size_t n = Counted();
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) total += pieces[i].state.bytes;
    return total;
  }
  int64_t DoneNs() const {
    const size_t n = Counted();
    int64_t last = 0;
    for (size_t i = 0; i < n; ++i) last = std::max(last, pieces[i].state.done_ns);
    return last;
  }
  // Whether UCP may still write or read a piece's buffer.
  bool OwnedByUcp() const {
    for (const UcxPiece& p : pieces) {
      if (p.ucp_request != nullptr && !p.state.done) return true;
    }
    return false;
  }
};

ffi::Error UcxError(const std::string& what, ucs_status_t status) {
  return ffi::Error::Internal(StrCat("jaxccl transport ucx: ", what, ": ", ucs_status_string(status)));
}

void OnSend(void* request, ucs_status_t status, void* user_data) {
  auto* s = static_cast<UcxRequestState*>(user_data);
  s->status = status;
  s->done_ns = NowNs();
  s->done = true;
}

void OnRecv(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* s = static_cast<UcxRequestState*>(user_data);
  s->status = status;
  if (status == UCS_OK) s->bytes = info->length;
  s->done_ns = NowNs();
  s->done = true;
}

class UcxTransport final : public Transport {
 public:
  UcxTransport(int32_t process_id, int32_t num_processes)
      : process_id_(process_id), num_processes_(num_processes), eps_(num_processes, nullptr),
        peer_status_(num_processes, UCS_OK) {}
  ~UcxTransport() override { Close(); }

  ffi::Error Init(const TransportOptions& options) {
    host_ = ThisHost();
    watched_.assign(num_processes_, false);
    pieced_.assign(num_processes_, false);
    rendezvous_threshold_set_ = Configured(options, "RNDV_THRESH");
    for (const auto& option : options) {
      if (option.first == "TLS") shared_memory_ = false;  // the caller chose UCX's transports (NETWORK_ONLY)
    }
    bool protocol_moved = false;
    for (const auto& setting : kTcpPieceSettings) protocol_moved |= Configured(options, setting.first);
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return UcxError("ucp_config_read", st);
    for (const auto& [key, value] : options) {
      st = ucp_config_modify(config, key.c_str(), value.c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return ffi::Error::InvalidArgument(
            StrCat("jaxccl transport ucx: option ", key, "=", value, ": ", ucs_status_string(st)));
      }
    }
    if (!protocol_moved) {
      for (const auto& [key, value] : kTcpPieceSettings) {
        st = ucp_config_modify(config, key, value);
        if (st != UCS_OK) {
          ucp_config_release(config);
          return UcxError(StrCat("setting ", key, "=", value), st);
        }
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG;
    params.mt_workers_shared = 0;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return UcxError("ucp_init", st);
    host_.pieces = !protocol_moved && NetworkIsTcpOnly(UcxContextTransports(context_)) ? 1 : 0;
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // serialized by mu_
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return UcxError("ucp_worker_create", st);
    progress_thread_ = std::thread([this] { ProgressWhileIdle(); });
    return ffi::Error::Success();
  }

  const char* name() const override { return "ucx"; }
  int32_t version() const override { return kTransportVersion; }
  int32_t process_id() const override { return process_id_; }
  int32_t num_processes() const override { return num_processes_; }

  ffi::ErrorOr<std::string> Address() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr) return ErrorResult<std::string>(Closed());
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    ucs_status_t st = ucp_worker_get_address(worker_, &addr, &len);
    if (st != UCS_OK) return ErrorResult<std::string>(UcxError("ucp_worker_get_address", st));
    std::string out(reinterpret_cast<const char*>(&host_), sizeof(host_));
    out.append(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    return out;
  }

  ffi::Error Connect(int32_t peer, const std::string& address) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr) return Closed();
    if (peer < 0 || peer >= num_processes_ || peer == process_id_) {
      return ffi::Error::InvalidArgument(
          StrCat("jaxccl transport ucx: peer process ", peer, " is not another process of 0..", num_processes_ - 1));
    }
    if (eps_[peer] != nullptr) return ffi::Error::Success();
    HostIdentity host;
    if (address.size() <= sizeof(host)) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: the address of process ", peer, " has ",
                                                address.size(), " bytes: not a jaxccl transport's address"));
    }
    std::memcpy(&host, address.data(), sizeof(host));
    if (host.magic != kAddressMagic) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: the address of process ", peer,
                                                " is not this jaxccl version's (another jaxccl in that process?)"));
    }
    peer_args_.resize(num_processes_);
    peer_args_[peer] = {this, peer};
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data() + sizeof(host));
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    if (shared_memory_ && SameHost(host_, host)) {
      const int fd = OpenPidfd(host.pid);
      if (fd >= 0) {
        pidfds_.push_back({fd, peer, host.pid});
        watched_[peer] = true;
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;  // UCX's shared memory has no peer-failure mode: the pidfd watches
      } else if (errno == ESRCH) {
        Exited(peer, host.pid);
      }
    }
    if (ep.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
      pieced_[peer] = host_.pieces == 1 && host.pieces == 1;  // both send over TCP in pieces
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = &UcxTransport::OnPeerError;
      ep.err_handler.arg = &peer_args_[peer];
    }
    ucs_status_t st = ucp_ep_create(worker_, &ep, &eps_[peer]);
    if (st != UCS_OK) {
      eps_[peer] = nullptr;
      return UcxError(StrCat("connecting to process ", peer), st);
    }
    return ffi::Error::Success();
  }

  ffi::ErrorOr<TransportRequest> Isend(int32_t peer, uint64_t tag, const void* data, size_t bytes,
                                       MemoryKind memory) override {
    return IsendWithTrailer(peer, tag, data, bytes, nullptr, 0, memory);
  }

  ffi::ErrorOr<TransportRequest> IsendWithTrailer(int32_t peer, uint64_t tag, const void* data, size_t bytes,
                                                  const void* trailer, size_t trailer_bytes,
                                                  MemoryKind memory) override {
    if (trailer_bytes > 0 && memory != MemoryKind::kHost) {
      return ErrorResult<TransportRequest>(ffi::Error::InvalidArgument(
          "jaxccl transport ucx: a message in device memory cannot carry a trailer in the same transfer"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (auto e = CheckPeer(peer, tag); e.failure()) return ErrorResult<TransportRequest>(std::move(e));
    const size_t total = bytes + trailer_bytes;
    auto req = NewRequest(peer, /*is_send=*/true, total, memory);
    const char* message = static_cast<const char*>(data);
    const char* behind = static_cast<const char*>(trailer);
    size_t begin = 0;
    for (UcxPiece& piece : req->pieces) {
      const size_t end = begin + piece.bytes;
      ucp_request_param_t p = PieceParam(piece, memory);
      p.cb.send = &OnSend;
      // The piece's bytes of the message, then of the trailer: one span, or two as an IO vector.
      const void* buffer = end <= bytes ? message + begin : behind + (begin - std::min(begin, bytes));
      size_t count = piece.bytes;
      if (begin < bytes && end > bytes) {
        piece.iov[0] = ucp_dt_iov_t{const_cast<char*>(message + begin), bytes - begin};
        piece.iov[1] = ucp_dt_iov_t{const_cast<char*>(behind), end - bytes};
        p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        p.datatype = ucp_dt_make_iov();
        buffer = piece.iov;
        count = 2;
      }
      ucs_status_ptr_t r = ucp_tag_send_nbx(eps_[peer], buffer, count, WireTag(process_id_, tag), &p);
      if (ffi::Error e = Posted(*req, piece, r, "send"); e.failure()) return Abandon(std::move(req), std::move(e));
      begin = end;
    }
    return Track(std::move(req));
  }

  ffi::ErrorOr<TransportRequest> Irecv(int32_t peer, uint64_t tag, void* data, size_t bytes,
                                       MemoryKind memory) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto e = CheckPeer(peer, tag); e.failure()) return ErrorResult<TransportRequest>(std::move(e));
    auto req = NewRequest(peer, /*is_send=*/false, bytes, memory);
    char* into = static_cast<char*>(data);
    for (UcxPiece& piece : req->pieces) {
      ucp_request_param_t p = PieceParam(piece, memory);
      p.cb.recv = &OnRecv;
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
      p.recv_info.tag_info = &piece.recv_info;
      ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_, into, piece.bytes, WireTag(peer, tag), ~uint64_t{0}, &p);
      if (ffi::Error e = Posted(*req, piece, r, "receive"); e.failure()) return Abandon(std::move(req), std::move(e));
      if (piece.state.done && piece.state.bytes < piece.bytes) break;  // the message had arrived, and ended here
      into += piece.bytes;
    }
    return Track(std::move(req));
  }

  ffi::ErrorOr<bool> Test(TransportRequest request) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return ErrorResult<bool>(UnknownRequest(request));
    Progress();
    UcxRequest& r = *it->second;
    if (r.Done()) {
      Cancel(r);  // the pieces behind one that failed or ended the message
      if (r.Status() != UCS_OK) return ErrorResult<bool>(RequestError(r));
      return true;
    }
    if (!peer_status_.empty() && peer_status_[r.peer] != UCS_OK) {
      return ErrorResult<bool>(PeerFailed(r.peer, peer_status_[r.peer]));
    }
    return false;
  }

  ffi::ErrorOr<TransportCompletion> Wait(TransportRequest request, Clock::time_point deadline) override {
    using R = TransportCompletion;
    return PollRequest<R>(request, [&](RequestIt it) -> std::optional<ffi::ErrorOr<R>> {
      UcxRequest& r = *it->second;
      // Progress until nothing more happens, then look at the request.
      Progress();
      if (r.Done()) {
        Cancel(r);
        ffi::Error e = r.Status() == UCS_OK ? ffi::Error::Success() : RequestError(r);
        R out{r.is_send ? r.posted_bytes : r.Arrived(), r.post_ns, r.DoneNs()};
        Free(it);
        if (e.failure()) return ErrorResult<R>(std::move(e));
        return ffi::ErrorOr<R>(out);
      }
      const bool peer_down = peer_status_[r.peer] != UCS_OK;
      if (!peer_down && Clock::now() < deadline) return std::nullopt;
      ffi::Error e = peer_down ? PeerFailed(r.peer, peer_status_[r.peer])
                               : ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                                            StrCat("jaxccl transport ucx: ", r.is_send ? "send to" : "receive from",
                                                   " process ", r.peer, " (", r.posted_bytes,
                                                   " bytes) did not complete before its deadline; process ", r.peer,
                                                   " may be dead or hung"));
      Cancel(r);
      Free(it);
      return ErrorResult<R>(std::move(e));
    });
  }

  ffi::ErrorOr<bool> Drain(TransportRequest request, Clock::time_point until) override {
    return PollRequest<bool>(request, [&](RequestIt it) -> std::optional<ffi::ErrorOr<bool>> {
      UcxRequest& r = *it->second;
      if (r.OwnedByUcp() && worker_ != nullptr) {
        Cancel(r);
        Progress();
      }
      if (!r.OwnedByUcp()) {
        Free(it);
        return ffi::ErrorOr<bool>(true);
      }
      if (Clock::now() >= until) return ffi::ErrorOr<bool>(false);  // still UCX's: it stays tracked until Close
      return std::nullopt;
    });
  }

  void Disconnect(int32_t peer, const std::string& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr || peer < 0 || peer >= num_processes_ || peer == process_id_) return;
    MarkFailed(peer, UCS_ERR_CANCELED, StrCat("this process closed the connection: ", why));
    CloseEndpoint(&eps_[peer]);
  }

  bool EndableInFlight(int32_t peer, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer < 0 || peer >= num_processes_) return false;
    // Over shared memory a rendezvous ends by itself: the receiver's own progress reads the sender's memory
    // (also a stopped process's; a dead one's read fails). Over TCP the sender pushes the fragments of a
    // rendezvous, which UCX matches by the receive's id, not by connection: a hung peer that resumes writes them
    // into the receive even after this process closed its endpoint (measured: a heap corrupted after the
    // launch failed, tests/distributed/test_multiprocess_native.py), as are the fragments of a multi-fragment
    // eager message. A message in pieces (kUcxTcpPieceBytes; in host memory, the only kind the proxy asks about)
    // has none: every piece is one eager fragment, whose receive is unmatched or complete.
    return pieced_[peer] || (watched_[peer] && !rendezvous_threshold_set_ && bytes >= kSharedMemoryRendezvousBytes);
  }

  ffi::Error PeerError(int32_t peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer < 0 || peer >= num_processes_) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: no process ", peer));
    }
    if (peer_status_[peer] != UCS_OK) return PeerFailed(peer, peer_status_[peer]);
    return ffi::Error::Success();
  }

  ffi::ErrorOr<std::vector<std::string>> PeerTransports(int32_t peer) override {
    using R = std::vector<std::string>;
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ == nullptr) return ErrorResult<R>(Closed());
    if (peer < 0 || peer >= num_processes_ || eps_[peer] == nullptr) {
      return ErrorResult<R>(ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: process ", peer,
                                                               " is not a connected peer")));
    }
    std::vector<ucp_transport_entry_t> entries(16);
    ucp_ep_attr_t attr{};
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries.data();
    attr.transports.num_entries = static_cast<unsigned>(entries.size());
    attr.transports.entry_size = sizeof(ucp_transport_entry_t);
    ucs_status_t st = ucp_ep_query(eps_[peer], &attr);
    if (st != UCS_OK) return ErrorResult<R>(UcxError(StrCat("querying the connection to process ", peer), st));
    R out;
    for (unsigned i = 0; i < attr.transports.num_entries; ++i) {
      std::string name = StrCat(entries[i].transport_name, "/", entries[i].device_name);
      if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(std::move(name));
    }
    return out;
  }

  void Close() override {
    stop_progress_.store(true);
    if (progress_thread_.joinable()) progress_thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    if (worker_ != nullptr) {
      for (auto it = requests_.begin(); it != requests_.end();) {
        Cancel(*it->second);
        it = Free(it);
      }
      for (ucp_ep_h& ep : eps_) CloseEndpoint(&ep);
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
    for (const PeerProcess& p : pidfds_) close(p.fd);
    pidfds_.clear();
    if (context_ != nullptr) {
      ucp_cleanup(context_);
      context_ = nullptr;
    }
  }

 private:
  struct PeerArg {
    UcxTransport* self;
    int32_t peer;
  };

  // Progresses until nothing more happens; under mu_.
  void Progress() {
    if (worker_ == nullptr) return;
    while (ucp_worker_progress(worker_) != 0) {
    }
    const int64_t now = NowNs();
    last_progress_ns_.store(now, std::memory_order_relaxed);
    if (!pidfds_.empty() && now - last_liveness_ns_ >= kLivenessPeriodNs) {
      last_liveness_ns_ = now;
      WatchPeerProcesses();
    }
  }

  // Marks `peer` failed with `status`, for `reason` (the first failure wins). Under mu_.
  void MarkFailed(int32_t peer, ucs_status_t status, std::string reason) {
    if (peer_status_[peer] != UCS_OK) return;
    peer_status_[peer] = status;
    failure_reason_[peer] = std::move(reason);
  }
  void Exited(int32_t peer, int64_t pid) {
    MarkFailed(peer, UCS_ERR_CONNECTION_RESET, StrCat("it exited: pid ", pid, " on this machine"));
  }

  // Closes `*ep` forcibly (never waiting for a peer that may be dead): UCX completes its outstanding requests with
  // an error and touches none of their buffers after. Under mu_.
  void CloseEndpoint(ucp_ep_h* ep) {
    if (*ep == nullptr) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(*ep, &p);
    if (UCS_PTR_IS_PTR(r)) {
      const auto until = DeadlineAfter(5.0);
      while (ucp_request_check_status(r) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    *ep = nullptr;
  }

  // Marks the watched peer processes that exited as failed (their requests then fail as on a peer failure);
  // `only` >= 0: looks at that peer alone, waiting up to `wait_ms` for its exit. Under mu_.
  void WatchPeerProcesses(int32_t only = -1, int wait_ms = 0) {
    std::vector<pollfd> fds;
    std::vector<size_t> watched;  // indices into pidfds_
    for (size_t i = 0; i < pidfds_.size(); ++i) {
      if (only >= 0 && pidfds_[i].peer != only) continue;
      fds.push_back(pollfd{pidfds_[i].fd, POLLIN, 0});
      watched.push_back(i);
    }
    if (fds.empty() || poll(fds.data(), fds.size(), wait_ms) <= 0) return;
    std::vector<PeerProcess> alive;
    for (size_t i = 0, w = 0; i < pidfds_.size(); ++i) {
      const PeerProcess& p = pidfds_[i];
      const bool exited = w < watched.size() && watched[w] == i && fds[w++].revents != 0;
      if (!exited) {
        alive.push_back(p);
        continue;
      }
      Exited(p.peer, p.pid);
      close(p.fd);
      // Without peer-failure mode nothing else ends the requests on it: a send queued for the dead process would
      // read its buffer whenever progress next ran, after XLA freed it.
      CloseEndpoint(&eps_[p.peer]);
    }
    pidfds_ = std::move(alive);
  }

  // The progress thread: drives progress when no caller did for kIdleProgressPeriod (between launches,
  // while the process waits for its peers elsewhere).
  void ProgressWhileIdle() {
    const int64_t period_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(kIdleProgressPeriod).count();
    while (!stop_progress_.load()) {
      std::this_thread::sleep_for(kIdleProgressPeriod);
      if (NowNs() - last_progress_ns_.load(std::memory_order_relaxed) < period_ns) continue;
      std::lock_guard<std::mutex> lock(mu_);
      Progress();
    }
  }

  static void OnPeerError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* a = static_cast<PeerArg*>(arg);
    a->self->peer_status_[a->peer] = status;  // runs inside ucp_worker_progress, under mu_
  }

  // Tells UCX which memory a buffer is in, so that it skips detecting it (and moves device memory with its
  // GPU transports).
  static void SetMemoryType(ucp_request_param_t* p, MemoryKind memory) {
    p->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p->memory_type = memory == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  }

  static uint64_t WireTag(int32_t source, uint64_t tag) {
    return (static_cast<uint64_t>(source) << kTransportTagBits) | (tag & kTransportTagMask);
  }

  ffi::Error CheckPeer(int32_t peer, uint64_t tag) {
    if (worker_ == nullptr) return Closed();
    if (peer < 0 || peer >= num_processes_ || peer == process_id_) {
      return ffi::Error::InvalidArgument(
          StrCat("jaxccl transport ucx: peer process ", peer, " is not another process of 0..", num_processes_ - 1));
    }
    if (tag > kTransportTagMask) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: tag ", tag, " has more than ",
                                                kTransportTagBits, " bits"));
    }
    if (peer_status_[peer] != UCS_OK) return PeerFailed(peer, peer_status_[peer]);
    if (eps_[peer] == nullptr) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, StrCat("jaxccl transport ucx: process ", peer, " is not connected"));
    }
    return ffi::Error::Success();
  }

  // A request to or from `peer` of `bytes` in `memory`, its pieces sized: one, or over TCP in pieces
  // (kUcxTcpPieceBytes): the same count and sizes for a send and for a receive of the same bytes.
  std::unique_ptr<UcxRequest> NewRequest(int32_t peer, bool is_send, size_t bytes, MemoryKind memory) {
    auto req = std::make_unique<UcxRequest>();
    req->peer = peer;
    req->is_send = is_send;
    req->posted_bytes = bytes;
    req->post_ns = NowNs();
    const bool in_pieces = pieced_[peer] && memory == MemoryKind::kHost;
    req->pieces.resize(in_pieces ? bytes / kUcxTcpPieceBytes + 1 : 1);
    for (UcxPiece& piece : req->pieces) piece.bytes = in_pieces ? kUcxTcpPieceBytes : bytes;
    if (in_pieces) req->pieces.back().bytes = bytes % kUcxTcpPieceBytes;
    return req;
  }

  static ucp_request_param_t PieceParam(UcxPiece& piece, MemoryKind memory) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.user_data = &piece.state;
    SetMemoryType(&p, memory);
    return p;
  }

  // Records what posting `piece` of `req` returned: in flight, completed inline, or an error.
  ffi::Error Posted(UcxRequest& req, UcxPiece& piece, ucs_status_ptr_t r, const char* what) {
    if (UCS_PTR_IS_ERR(r)) {
      piece.state.status = UCS_PTR_STATUS(r);
      piece.state.done = true;
      // A receive posted after its message arrived fails at once when the message is larger.
      if (piece.state.status == UCS_ERR_MESSAGE_TRUNCATED) return RequestError(req);
      return UcxError(StrCat(what, " with process ", req.peer, " (", req.posted_bytes, " bytes)"), piece.state.status);
    }
    if (r == nullptr) {  // completed inline; the callback was not called
      piece.state.done = true;
      // A receive of a message that had arrived: its length (it may be shorter than the receive).
      piece.state.bytes = req.is_send ? piece.bytes : piece.recv_info.length;
      piece.state.done_ns = NowNs();
    } else {
      piece.ucp_request = r;
    }
    return ffi::Error::Success();
  }

  ffi::ErrorOr<TransportRequest> Track(std::unique_ptr<UcxRequest> req) {
    const TransportRequest id = next_id_++;
    requests_.emplace(id, std::move(req));
    return id;
  }

  // A request whose piece could not be posted: the pieces posted before it are cancelled, and `e` returned.
  ffi::ErrorOr<TransportRequest> Abandon(std::unique_ptr<UcxRequest> req, ffi::Error e) {
    Cancel(*req);
    Release(std::move(req));
    return ErrorResult<TransportRequest>(std::move(e));
  }

  using RequestIt = std::map<TransportRequest, std::unique_ptr<UcxRequest>>::iterator;

  // Looks at `request` under mu_ with `look` until it gives the result, backing off between looks (nothing to do:
  // the other threads, and processes on the same cores, run).
  template <class T, class Look>
  ffi::ErrorOr<T> PollRequest(TransportRequest request, Look look) {
    Backoff backoff(64, std::chrono::microseconds(50));
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = requests_.find(request);
        if (it == requests_.end()) return ErrorResult<T>(UnknownRequest(request));
        if (std::optional<ffi::ErrorOr<T>> out = look(it)) return std::move(*out);
      }
      backoff.Pause();
    }
  }

  // Cancels the pieces of `r` still in flight: an unmatched receive completes at once; a matched receive or a send
  // that UCX cannot cancel goes on (waiting for it would not end it: Release keeps its memory, Drain waits where
  // the caller must know).
  void Cancel(UcxRequest& r) {
    bool asked = false;
    for (UcxPiece& piece : r.pieces) {
      if (piece.ucp_request == nullptr || piece.state.done) continue;
      if (!piece.cancelled) ucp_request_cancel(worker_, piece.ucp_request);
      piece.cancelled = true;
      asked = true;
    }
    if (asked) ucp_worker_progress(worker_);
  }

  RequestIt Free(RequestIt it) {
    Release(std::move(it->second));
    return requests_.erase(it);
  }

  // Frees `req`'s UCP requests, or leaks it whole while UCP still owns a piece (a cancel that did not finish)
  // rather than free memory UCP writes.
  static void Release(std::unique_ptr<UcxRequest> req) {
    if (req->OwnedByUcp()) {
      static_cast<void>(req.release());
      return;
    }
    for (UcxPiece& piece : req->pieces) {
      if (piece.ucp_request != nullptr) ucp_request_free(piece.ucp_request);
    }
  }

  ffi::Error RequestError(const UcxRequest& r) {
    // A watched peer's shared memory fails as the process exits, a moment before its pidfd says so.
    if (peer_status_[r.peer] == UCS_OK) WatchPeerProcesses(r.peer, kExitGraceMs);
    if (peer_status_[r.peer] != UCS_OK) return PeerFailed(r.peer, peer_status_[r.peer]);
    if (r.Status() == UCS_ERR_MESSAGE_TRUNCATED) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: message from process ", r.peer,
                                                " is larger than the ", r.posted_bytes, "-byte receive"));
    }
    return UcxError(StrCat(r.is_send ? "send to" : "receive from", " process ", r.peer), r.Status());
  }

  ffi::Error PeerFailed(int32_t peer, ucs_status_t status) const {
    auto it = failure_reason_.find(peer);
    const std::string why =
        it != failure_reason_.end() ? it->second : StrCat("its connection reported: ", ucs_status_string(status));
    return ffi::Error(ffi::ErrorCode::kUnavailable, StrCat("jaxccl transport ucx: process ", peer, " failed (", why, ")"));
  }
  static ffi::Error Closed() { return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jaxccl transport ucx: transport is closed"); }
  static ffi::Error UnknownRequest(TransportRequest r) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl transport ucx: no request ", r, " (already waited for?)"));
  }

  const int32_t process_id_;
  const int32_t num_processes_;
  std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<ucp_ep_h> eps_;
  std::vector<ucs_status_t> peer_status_;
  std::vector<PeerArg> peer_args_;
  // Peer processes on this machine, watched through their pidfds (their endpoints use shared memory).
  struct PeerProcess {
    int fd;
    int32_t peer;
    int64_t pid;
  };
  std::vector<PeerProcess> pidfds_;
  std::map<int32_t, std::string> failure_reason_;  // peers this process saw exit or disconnected (MarkFailed): why
  int64_t last_liveness_ns_ = 0;
  HostIdentity host_;  // this process's, published before its worker address
  bool shared_memory_ = true;  // false: the options chose UCX's transports; every endpoint in peer-failure mode
  std::vector<bool> watched_;  // per peer: connected over shared memory, watched through its pidfd
  std::vector<bool> pieced_;   // per peer: messages in host memory travel in pieces (kUcxTcpPieceBytes), over TCP
  bool rendezvous_threshold_set_ = false;  // UCX_RNDV_THRESH (or the option) moves UCX's eager/rendezvous switch
  std::map<TransportRequest, std::unique_ptr<UcxRequest>> requests_;
  TransportRequest next_id_ = 1;
  std::atomic<int64_t> last_progress_ns_{0};
  std::atomic<bool> stop_progress_{false};
  std::thread progress_thread_;  // last: started once the worker exists, joined before it is destroyed
};

}  // namespace

std::vector<std::string> UcxContextTransports(ucp_context_h context) {
  char* text = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&text, &size);
  if (stream == nullptr) return {};
  ucp_context_print_info(context, stream);
  std::fclose(stream);
  std::vector<std::string> transports;
  std::istringstream lines(std::string(text, size));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t arrow = line.rfind(" -- ");
    if (line.find("resource") == std::string::npos || arrow == std::string::npos) continue;
    std::string tl = line.substr(arrow + 4);
    tl.erase(tl.find_last_not_of(" \t\r") + 1);
    if (!tl.empty()) transports.push_back(tl);
  }
  return transports;
}

const char* TransportsBuilt() { return "ucx"; }

ffi::ErrorOr<std::unique_ptr<Transport>> MakeTransport(const std::string& name, int32_t process_id,
                                                       int32_t num_processes, const TransportOptions& options) {
  using R = std::unique_ptr<Transport>;
  if (name != "ucx") {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: unknown transport '", name, "'; this build has: ", TransportsBuilt())));
  }
  if (num_processes < 1 || process_id < 0 || process_id >= num_processes || num_processes > 65535) {
    return ErrorResult<R>(ffi::Error::InvalidArgument(
        StrCat("jaxccl transport: process ", process_id, " of ", num_processes, " is not a valid process id")));
  }
  auto t = std::make_unique<UcxTransport>(process_id, num_processes);
  if (auto e = t->Init(options); e.failure()) return ErrorResult<R>(std::move(e));
  return R(std::move(t));
}

}  // namespace jaxccl
