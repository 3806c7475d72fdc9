// What the UCX transport (ucx.cc) asks of UCX and what a UCP context offers, shared with jaxccl._transport
// (bindings/transport_module.cc: `jaxccl info`, and the tests that pin UCX's protocol choice).
#ifndef JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_
#define JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_

#include <ucp/api/ucp.h>

#include <cstddef>
#include <string>
#include <vector>

namespace jaxccl {

// Over TCP a message in host memory travels in pieces of kUcxTcpPieceBytes and a last, shorter one (ucx.cc), each
// one eager fragment under the TCP segment sizes the transport sets (kTcpPieceSettings in ucx.cc): UCX 1.22 sends
// up to kUcxEagerFragmentBytes so (UCX_PROTO_INFO=y). Not larger: UCX's automatic rendezvous threshold, which it
// estimates per interface, is about 267 KiB over tcp/lo, twice a piece but only 4% above a 256 KiB one.
//
// A piece and the header UCX sends before it fill whole TCP segments of an Ethernet frame: with TCP_NODELAY (which
// UCX sets) a send whose bytes end inside a segment sends that short segment at once, so 64 KiB pieces (65,549
// bytes on the wire: 45 segments and 389 bytes) doubled the packets, and with them the acknowledgements and the
// kernel's work per byte (docs/guides/multiprocess.md, "Pieces fill whole TCP segments"). Over links with
// other segment sizes a piece's last segment is short, as every piece's was before.
inline constexpr size_t kUcxEagerFragmentBytes = 131064;  // TCP_RX_SEG_SIZE=128k less UCX's receive header
inline constexpr size_t kUcxTagEagerHeaderBytes = 13;    // UCX 1.22: the TCP active message's 5, the tag's 8
inline constexpr size_t kEthernetTcpSegmentBytes = 1448;  // MTU 1500 less IPv4's, TCP's and the timestamps' headers
inline constexpr size_t kUcxTcpPieceBytes = 90 * kEthernetTcpSegmentBytes - kUcxTagEagerHeaderBytes;  // 130,307
static_assert(kUcxTcpPieceBytes <= kUcxEagerFragmentBytes, "a piece must stay one eager fragment");

// The context's resources as "transport/device" pairs ("tcp/eth0", "posix/memory"), in UCX's order.
// ucp_context_print_info writes them as "#  resource N : md M dev D flags F -- tl/dev"; UCX has no structured
// query for them. Empty when they cannot be read.
std::vector<std::string> UcxContextTransports(ucp_context_h context);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_UCX_SETTINGS_H_
