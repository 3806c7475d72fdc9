// Messages to another process that carry the same bytes travel once; which messages may land in place.
//
// A schedule written for ranks that share memory sends a block to every rank that needs it (the direct
// AllGather sends each rank's input to all N - 1 peers). Across processes the ranks of one process
// need it once: sends of one rank's same bytes to several ranks of one other process share one
// transfer, which that process's proxy hands to each of its receivers (they only read it).
//
// Sends share a transfer when they are plain sends (not fused with a receive) from the same rank,
// buffer, chunk range and tile to ranks of the same other process, and their bytes cannot differ:
// the range is in the input (never written), or the sends have the same dependency and their source
// is final at it (core/stable_source.h, SourceFinalAtDependency).
// The grouping is a pure function of the table, the tiling and the process of every rank, so the
// sending and the receiving process compute the same groups; a group travels with the tag of its
// first message in (connection, message) order.
#ifndef JAXCCL_XLA_FFI_TRANSPORT_SHARED_SENDS_H_
#define JAXCCL_XLA_FFI_TRANSPORT_SHARED_SENDS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "core/table_format.h"

namespace jaxccl {

// A message of a connection.
struct MessageRef {
  int32_t conn = -1, msg = -1;
  bool operator==(const MessageRef& o) const { return conn == o.conn && msg == o.msg; }
};

// For every message between ranks of different processes: the first message of the group whose
// transfer it shares (the message itself when it shares none), and whether it may land in place. Empty for
// connections within a process.
//
// Landing in place: the receiving proxy receives the message straight into the receiver's output, where the
// receiving op would copy it (the op then finds it there and copies nothing). A message may when it travels
// alone (shares no transfer), its receiving op is a receive that copies (`r`, `rcs`) into the output, that op
// is the only writer of its chunk range in the receiving rank's program, and every op that reads the range
// follows it (dependencies and waits, per tile). Nothing else of the rank then touches the range before the
// op, so bytes that arrive early change nothing the program reads. Whether a launch uses it also depends on
// the message's size (kInPlaceMinBytes, proxy.h), which both processes know; its trailer then travels apart.
struct SharedSends {
  std::vector<std::vector<MessageRef>> leader;   // [conn][msg]
  std::vector<std::vector<uint8_t>> in_place;    // [conn][msg]: may land in place
  int64_t shared = 0;                            // messages that ride on another's transfer
  MessageRef LeaderOf(int32_t conn, int32_t msg) const { return leader[conn][msg]; }
  bool MayLandInPlace(int32_t conn, int32_t msg) const { return in_place[conn][msg] != 0; }
};

// The groups of a launch of `t` in `tiles` tiles, where rank r runs in process process_of_rank[r].
SharedSends ShareIdenticalSends(const Table& t, int32_t tiles, const std::vector<int32_t>& process_of_rank);
// The same, computed once per (table, tiles, processes) and reused by the launches that follow.
std::shared_ptr<const SharedSends> SharedSendsOf(const std::shared_ptr<const Table>& t, int32_t tiles,
                                                 const std::vector<int32_t>& process_of_rank);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TRANSPORT_SHARED_SENDS_H_
