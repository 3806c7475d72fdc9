// The schedule registry: numbered slots holding versioned compiled tables.
//
// Python installs a table into a slot (jaxccl.runtime.native.install); the
// compiled JAX program only names the slot (an FFI attribute), and the last
// rank to arrive at a launch picks the slot's current table once for the whole
// launch. Installing a new table therefore never recompiles the program.
//
// Hot-swap (MCCL Sec. 6.2.2): Stage() makes a table the slot's *staged*
// version and records the transition point, the maximum sequence number any
// rank has issued on the slot so far. Every collective call is numbered per
// rank (NoteIssued); a launch with sequence number <= the transition point
// runs the old table, the first later one activates the staged table. In one
// process every rank sees the same staged version, so the minimum staged
// version across ranks is simply the newest one. Launches of one slot never
// overlap (each needs every rank, and a rank issues its next call only after
// its previous one returned), so old and new never run concurrently.
#ifndef JAXCCL_XLA_FFI_REGISTRY_H_
#define JAXCCL_XLA_FFI_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "host/common.h"
#include "host/table.h"

namespace jaxccl {

// What a launch runs: one table version, fixed for the whole launch.
struct TableSnapshot {
  std::shared_ptr<const Table> table;
  int64_t version = 0;
};

class Registry {
 public:
  static Registry& Get();

  int64_t NewSlot();
  // Parses/validates the table, makes it the slot's current version; returns that version (1, 2, ...).
  ffi::ErrorOr<int64_t> Install(int64_t slot, const int32_t* words, size_t num_words);
  // Parses/validates the table and stages it (see above); the slot's first table becomes current at once.
  // `transition_seq` >= 0 sets the transition point instead (agreed across processes); it is refused when
  // a rank already issued a later call, whose launch may have run the old table.
  ffi::ErrorOr<int64_t> Stage(int64_t slot, const int32_t* words, size_t num_words, int64_t transition_seq = -1);
  // Numbers one rank's collective call on the slot: returns its sequence number (1, 2, ...).
  ffi::ErrorOr<int64_t> NoteIssued(int64_t slot, int32_t rank);
  // Current version (0 if nothing was installed yet).
  ffi::ErrorOr<int64_t> CurrentVersion(int64_t slot);
  ffi::Error Remove(int64_t slot);
  // The slot's current table for one launch; counts the launch. A staged table becomes current first
  // when `seq` (the launch's sequence number) is past its transition point; the default activates it.
  ffi::ErrorOr<TableSnapshot> Acquire(int64_t slot, int64_t seq = INT64_MAX);
  struct SwapState {
    int64_t current_version = 0, staged_version = 0, transition_seq = 0, issued = 0, last_swap_seq = 0;
    int64_t last_swap_ns = 0;  // steady clock (CLOCK_MONOTONIC) time of the last activation
    int64_t current_checksum = 0, staged_checksum = 0;  // the tables' checksum words (0: no table)
  };
  ffi::ErrorOr<SwapState> Swap(int64_t slot);
  ffi::ErrorOr<int64_t> LaunchCount(int64_t slot);
  // Executor time of the slot's most recently finished launch (ns, from its start to its last threadblock).
  void RecordLaunchTime(int64_t slot, int64_t ns);
  ffi::ErrorOr<int64_t> LastLaunchNs(int64_t slot);
  // Version that the most recent launch of the slot ran (0 if none).
  ffi::ErrorOr<int64_t> LastLaunchVersion(int64_t slot);
  size_t NumSlots();

  // Deadline of every rendezvous and wait, in seconds.
  double timeout_s() const { return timeout_s_.load(std::memory_order_relaxed); }
  ffi::Error SetTimeout(double seconds);

 private:
  struct Slot {
    TableSnapshot current;
    int64_t next_version = 1;
    int64_t launches = 0;
    int64_t last_launch_version = 0;
    TableSnapshot staged;            // staged.table == nullptr: nothing staged
    int64_t transition_seq = 0;      // launches with seq <= this run `current`
    std::map<int32_t, int64_t> issued;  // rank -> last issued sequence number
    int64_t last_swap_seq = 0;       // sequence number of the launch that last activated a staged table
    int64_t last_swap_ns = 0;
    int64_t last_launch_ns = 0;  // duration of the most recently finished launch
  };
  ffi::ErrorOr<Slot*> Find(int64_t slot);  // requires mu_

  std::mutex mu_;
  std::map<int64_t, Slot> slots_;
  std::set<int64_t> removed_;  // slots removed (their communicator closed): named in errors, bounded
  int64_t next_slot_ = 1;
  std::atomic<double> timeout_s_{60.0};
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_REGISTRY_H_
