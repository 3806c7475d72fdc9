#include "host/registry.h"

#include <cmath>
#include <algorithm>
#include <cstdlib>

namespace jaxccl {

Registry& Registry::Get() {
  static Registry* registry = [] {
    auto* r = new Registry();  // never destroyed: worker threads may outlive static teardown
    // $JAXCCL_TIMEOUT_S sets the default deadline; jaxccl.runtime.native rejects malformed values loudly.
    if (const char* env = std::getenv("JAXCCL_TIMEOUT_S")) {
      char* end = nullptr;
      const double s = std::strtod(env, &end);
      if (end != env && *end == '\0') (void)r->SetTimeout(s);
    }
    return r;
  }();
  return *registry;
}

int64_t Registry::NewSlot() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_slot_++;
  slots_.emplace(id, Slot{});
  return id;
}

ffi::ErrorOr<Registry::Slot*> Registry::Find(int64_t slot) {
  auto it = slots_.find(slot);
  if (it == slots_.end()) {
    if (removed_.count(slot) > 0) {
      return ErrorResult<Slot*>(ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          StrCat("jaxccl: schedule slot ", slot, " was removed: the communicator that owned it is closed")));
    }
    return ErrorResult<Slot*>(ffi::Error::InvalidArgument(
        StrCat("jaxccl: no schedule slot ", slot, " (it was never created with new_slot())")));
  }
  return &it->second;
}

ffi::ErrorOr<int64_t> Registry::Install(int64_t slot, const int32_t* words, size_t num_words) {
  auto parsed = ParseTable(words, num_words);  // outside the lock: tables can be large
  if (!parsed.has_value()) return ErrorResult<int64_t>(std::move(parsed.error()));
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  Slot* st = *s;
  st->current = TableSnapshot{std::move(*parsed), st->next_version++};
  return st->current.version;
}

ffi::ErrorOr<int64_t> Registry::Stage(int64_t slot, const int32_t* words, size_t num_words,
                                      int64_t transition_seq) {
  auto parsed = ParseTable(words, num_words);
  if (!parsed.has_value()) return ErrorResult<int64_t>(std::move(parsed.error()));
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  Slot* st = *s;
  const int64_t version = st->next_version++;
  if (!st->current.table) {
    st->current = TableSnapshot{std::move(*parsed), version};
    return version;
  }
  int64_t max_issued = 0;
  for (const auto& [rank, seq] : st->issued) max_issued = std::max(max_issued, seq);
  if (transition_seq >= 0 && max_issued > transition_seq) {
    return ErrorResult<int64_t>(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        StrCat("jaxccl: cannot stage at transition point ", transition_seq, " in slot ", slot, ": a rank already issued call ",
               max_issued)));
  }
  st->staged = TableSnapshot{std::move(*parsed), version};  // a newer staged table replaces an older one
  st->transition_seq = transition_seq >= 0 ? transition_seq : max_issued;
  return version;
}

ffi::ErrorOr<int64_t> Registry::NoteIssued(int64_t slot, int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  return ++(*s)->issued[rank];
}

ffi::ErrorOr<Registry::SwapState> Registry::Swap(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<SwapState>(std::move(s.error()));
  const Slot* st = *s;
  SwapState out;
  out.current_version = st->current.version;
  out.staged_version = st->staged.table ? st->staged.version : 0;
  out.transition_seq = st->transition_seq;
  for (const auto& [rank, seq] : st->issued) out.issued = std::max(out.issued, seq);
  out.last_swap_seq = st->last_swap_seq;
  out.last_swap_ns = st->last_swap_ns;
  out.current_checksum = st->current.table ? st->current.table->checksum : 0;
  out.staged_checksum = st->staged.table ? st->staged.table->checksum : 0;
  return out;
}

ffi::ErrorOr<int64_t> Registry::CurrentVersion(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  return (*s)->current.version;
}

ffi::Error Registry::Remove(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slots_.erase(slot) == 0) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: no schedule slot ", slot, " to remove"));
  }
  constexpr size_t kMaxRemembered = 1 << 16;
  if (removed_.size() >= kMaxRemembered) removed_.erase(removed_.begin());  // the oldest (ids only grow)
  removed_.insert(slot);
  return ffi::Error::Success();
}

ffi::ErrorOr<TableSnapshot> Registry::Acquire(int64_t slot, int64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<TableSnapshot>(std::move(s.error()));
  Slot* st = *s;
  if (st->staged.table && seq > st->transition_seq) {
    st->current = std::move(st->staged);
    st->staged = TableSnapshot{};
    st->last_swap_seq = seq == INT64_MAX ? st->launches + 1 : seq;
    st->last_swap_ns = NowNs();
  }
  if (!st->current.table) {
    return ErrorResult<TableSnapshot>(
        ffi::Error::InvalidArgument(StrCat("jaxccl: no schedule installed in slot ", slot, " (call install first)")));
  }
  ++st->launches;
  st->last_launch_version = st->current.version;
  return st->current;
}

ffi::ErrorOr<int64_t> Registry::LaunchCount(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  return (*s)->launches;
}

void Registry::RecordLaunchTime(int64_t slot, int64_t ns) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(slot);
  if (it != slots_.end()) it->second.last_launch_ns = ns;  // a removed slot has nobody to tell
}

ffi::ErrorOr<int64_t> Registry::LastLaunchNs(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  return (*s)->last_launch_ns;
}

ffi::ErrorOr<int64_t> Registry::LastLaunchVersion(int64_t slot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto s = Find(slot);
  if (!s.has_value()) return ErrorResult<int64_t>(std::move(s.error()));
  return (*s)->last_launch_version;
}

size_t Registry::NumSlots() {
  std::lock_guard<std::mutex> lock(mu_);
  return slots_.size();
}

ffi::Error Registry::SetTimeout(double seconds) {
  if (!std::isfinite(seconds) || seconds <= 0) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl: timeout must be a positive number of seconds, got ", seconds));
  }
  timeout_s_.store(seconds, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace jaxccl
