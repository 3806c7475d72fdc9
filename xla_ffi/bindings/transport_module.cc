// jaxccl._transport: the transport between processes (transport.h) for Python: the bootstrap through
// jax.distributed's key-value store (jaxccl/distributed/transport.py) and the tests drive it.
//
// Errors: a deadline raises TransportDeadline (a TimeoutError), a failed peer TransportPeerFailed, bad
// arguments ValueError; jaxccl/distributed/transport.py turns them into jaxccl's error types.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <ucp/api/ucp.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "transport/transport.h"
#include "transport/proxy.h"
#include "transport/ucx_settings.h"

namespace nb = nanobind;

namespace jaxccl {
namespace {

struct TransportDeadline : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct TransportPeerFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Raise(const ffi::Error& e) {
  switch (e.errc().value_or(ffi::ErrorCode::kUnknown)) {
    case ffi::ErrorCode::kDeadlineExceeded:
      throw TransportDeadline(e.message());
    case ffi::ErrorCode::kUnavailable:
      throw TransportPeerFailed(e.message());
    case ffi::ErrorCode::kInvalidArgument:
      throw nb::value_error(e.message().c_str());
    default:
      throw std::runtime_error(e.message());
  }
}

template <typename T>
T Unwrap(ffi::ErrorOr<T> v) {
  if (!v.has_value()) Raise(v.error());
  return std::move(*v);
}

using Bytes = nb::ndarray<nb::device::cpu, nb::c_contig>;

// One process's transport; requests are waited for with a timeout in seconds.
class PyTransport {
 public:
  PyTransport(const std::string& name, int32_t process_id, int32_t num_processes,
              const std::map<std::string, std::string>& options)
      : t_(Unwrap(MakeTransport(name, process_id, num_processes, TransportOptions(options.begin(), options.end())))) {}

  nb::bytes Address() {
    std::string a = Unwrap(Get()->Address());
    return nb::bytes(a.data(), a.size());
  }
  void Connect(int32_t peer, nb::bytes address) {
    ffi::Error e = Get()->Connect(peer, std::string(address.c_str(), address.size()));
    if (e.failure()) Raise(e);
  }
  int64_t Isend(int32_t peer, uint64_t tag, Bytes data) {
    return Unwrap(Get()->Isend(peer, tag, data.data(), data.nbytes(), MemoryKind::kHost));
  }
  int64_t Irecv(int32_t peer, uint64_t tag, Bytes data) {
    return Unwrap(Get()->Irecv(peer, tag, data.data(), data.nbytes(), MemoryKind::kHost));
  }
  bool Test(int64_t request) { return Unwrap(Get()->Test(request)); }
  std::tuple<int64_t, int64_t, int64_t> Wait(int64_t request, double timeout_s) {
    if (!(timeout_s >= 0)) throw nb::value_error("timeout_s must be >= 0");
    TransportCompletion c;
    {
      nb::gil_scoped_release release;  // other Python threads (and the caller's peers in-process) go on
      auto r = Get()->Wait(request, DeadlineAfter(timeout_s));
      if (!r.has_value()) {
        nb::gil_scoped_acquire acquire;
        Raise(r.error());
      }
      c = *r;
    }
    return {static_cast<int64_t>(c.bytes), c.post_ns, c.done_ns};
  }
  void CheckPeer(int32_t peer) {
    ffi::Error e = Get()->PeerError(peer);
    if (e.failure()) Raise(e);
  }
  std::vector<std::string> PeerTransports(int32_t peer) {
    auto r = Get()->PeerTransports(peer);
    if (!r.has_value()) Raise(r.error());
    return *r;
  }
  void Close() {
    if (t_) t_->Close();
    t_.reset();
  }
  bool closed() const { return !t_; }
  // A capsule for jaxccl._native.set_process_group; valid while this transport is open.
  nb::capsule Capsule() {
    handle_.transport = Get();
    return nb::capsule(static_cast<const void*>(&handle_), "jaxccl_transport");
  }
  int32_t process_id() { return Get()->process_id(); }
  int32_t num_processes() { return Get()->num_processes(); }
  std::string name() { return Get()->name(); }

 private:
  Transport* Get() {
    if (!t_) throw std::runtime_error("jaxccl transport: the transport is closed");
    return t_.get();
  }
  std::unique_ptr<Transport> t_;
  TransportHandle handle_;
};

// The version of the UCX library this module loaded (`jaxccl info`).
std::string UcxVersion() { return ucp_get_version_string(); }

// The transports UCX would choose from here, as "transport/device" (e.g. "tcp/eth0", "posix/memory"): the
// resources of a UCP context opened as the transport opens its own (tag matching, this process's UCX_*
// variables, e.g. UCX_TLS). `options` are UCX variables without "UCX_", as for Transport.
std::vector<std::string> UcxTransports(const std::map<std::string, std::string>& options) {
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) throw std::runtime_error(std::string("ucp_config_read: ") + ucs_status_string(st));
  for (const auto& [key, value] : options) {
    st = ucp_config_modify(config, key.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      throw nb::value_error(("UCX option " + key + "=" + value + ": " + ucs_status_string(st)).c_str());
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) throw std::runtime_error(std::string("ucp_init: ") + ucs_status_string(st));
  std::vector<std::string> transports = UcxContextTransports(context);
  ucp_cleanup(context);
  return transports;
}

}  // namespace
}  // namespace jaxccl

NB_MODULE(_transport, m) {
  using jaxccl::PyTransport;
  m.doc() = "jaxccl's transport between processes (see xla_ffi/transport/transport.h)";
  nb::exception<jaxccl::TransportDeadline>(m, "TransportDeadline", PyExc_TimeoutError);
  nb::exception<jaxccl::TransportPeerFailed>(m, "TransportPeerFailed", PyExc_RuntimeError);
  m.def("transports_built", [] { return std::string(jaxccl::TransportsBuilt()); });
  m.def("ucx_version", &jaxccl::UcxVersion);
  m.def("ucx_transports", &jaxccl::UcxTransports, nb::arg("options"));
  m.attr("TRANSPORT_VERSION") = jaxccl::kTransportVersion;
  m.attr("TAG_BITS") = jaxccl::kTransportTagBits;
  m.attr("TCP_PIECE_BYTES") = jaxccl::kUcxTcpPieceBytes;
  nb::class_<PyTransport>(m, "Transport")
      .def(nb::init<const std::string&, int32_t, int32_t, const std::map<std::string, std::string>&>(),
           nb::arg("name"), nb::arg("process_id"), nb::arg("num_processes"), nb::arg("options"))
      .def("address", &PyTransport::Address)
      .def("connect", &PyTransport::Connect, nb::arg("peer"), nb::arg("address"))
      .def("isend", &PyTransport::Isend, nb::arg("peer"), nb::arg("tag"), nb::arg("data"))
      .def("irecv", &PyTransport::Irecv, nb::arg("peer"), nb::arg("tag"), nb::arg("data"))
      .def("test", &PyTransport::Test, nb::arg("request"))
      .def("wait", &PyTransport::Wait, nb::arg("request"), nb::arg("timeout_s"))
      .def("check_peer", &PyTransport::CheckPeer, nb::arg("peer"))
      .def("peer_transports", &PyTransport::PeerTransports, nb::arg("peer"))
      .def("close", &PyTransport::Close)
      .def("capsule", &PyTransport::Capsule)
      .def_prop_ro("closed", &PyTransport::closed)
      .def_prop_ro("process_id", &PyTransport::process_id)
      .def_prop_ro("num_processes", &PyTransport::num_processes)
      .def_prop_ro("name", &PyTransport::name);
}
