// What the UCX transport (ucx.cc) asks of UCX and what a UCP context offers, shared with jaxccl._transport
// (bindings/transport_module.cc: `jaxccl info`, and the tests that pin UCX's protocol choice).
#ifndef JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_
#define JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <string>
#include <vector>

namespace jaxccl {

// Over TCP a message in host memory travels in pieces of this size and a last, shorter one (ucx.cc), each one
// eager fragment under the TCP segment sizes the transport sets (kTcpPieceSettings in ucx.cc).
inline constexpr size_t kUcxTcpPieceBytes = size_t{64} << 10;

// The context's resources as "transport/device" pairs ("tcp/eth0", "posix/memory"), in UCX's order.
// ucp_context_print_info writes them as "#  resource N : md M dev D flags F -- tl/dev"; UCX has no structured
// query for them. Empty when they cannot be read.
std::vector<std::string> UcxContextTransports(ucp_context_h context);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_
