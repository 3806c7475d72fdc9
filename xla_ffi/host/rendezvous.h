// In-process rendezvous of the per-device calls of one collective launch.
//
// Every rank of a group calls Arrive() from its own XLA thread. Calls meet
// under the key (run_id, site, group, occurrence): run_id identifies the launch
// of the compiled program, site the collective call site, group the replica
// group, and occurrence counts how often this rank already reached this site in
// this launch (a site inside lax.scan runs many times). The last rank to arrive
// runs `build` once for everybody (it picks the table, starts the executor) and
// all ranks receive its result. If not every rank arrives before the deadline,
// all waiting ranks get an error naming the missing ranks, and ranks arriving
// later get the same error; no entry outlives a bounded grace period.
#ifndef JAXCCL_XLA_FFI_RENDEZVOUS_H_
#define JAXCCL_XLA_FFI_RENDEZVOUS_H_

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "host/common.h"

namespace jaxccl {

template <typename Arrival, typename Result>
class Rendezvous {
 public:
  using Build = std::function<ffi::ErrorOr<std::shared_ptr<Result>>(const std::vector<Arrival>&)>;

  ffi::ErrorOr<std::shared_ptr<Result>> Arrive(int64_t run_id, int64_t site, int64_t group, int32_t rank,
                                               int32_t axis_size, const Arrival& arrival, double timeout_s,
                                               const Build& build) {
    using R = std::shared_ptr<Result>;
    std::unique_lock<std::mutex> lock(mu_);
    auto joined = Join(run_id, site, group, rank, axis_size, timeout_s);
    if (!joined.has_value()) return ErrorResult<R>(std::move(joined.error()));
    const Key key = joined->key;
    const std::shared_ptr<Entry> e = joined->entry;
    const std::string& where = joined->where;

    if (e->failed) {
      if (++e->accounted == e->axis_size) pending_.erase(key);
      return ErrorResult<R>(ffi::Error(e->code,
                                       StrCat("jaxccl: rank ", rank, " arrived after the rendezvous at ", where,
                                              " had already failed: ", e->error)));
    }
    // A rank calling twice lands on the next occurrence, so each rank appears at most once per entry.
    e->present[rank] = 1;
    e->arrivals[rank] = arrival;
    ++e->accounted;
    if (++e->arrived == e->axis_size) {
      pending_.erase(key);
      lock.unlock();
      auto result = build(e->arrivals);
      lock.lock();
      e->done = true;
      if (result.has_value()) {
        e->result = *result;
      } else {
        e->error = result.error().message();
      }
      e->cv.notify_all();
      return result;
    }
    bool finished = e->cv.wait_until(lock, e->deadline, [&] { return e->done || e->failed; });
    if (!finished && e->arrived == e->axis_size) {
      // Everybody arrived and the last rank is starting the launch (it never blocks): its workers will use
      // this rank's buffers, so this rank must not leave with a timeout now.
      finished = e->cv.wait_until(lock, DeadlineAfter(timeout_s), [&] { return e->done; });
    }
    if (!finished) {
      e->failed = true;
      std::string missing, present;
      int num_missing = 0;
      for (int32_t r = 0; r < e->axis_size; ++r) {
        std::string& list = e->present[r] ? present : missing;
        list += StrCat(list.empty() ? "" : ", ", r);
        num_missing += e->present[r] ? 0 : 1;
      }
      e->error = StrCat("rendezvous at ", where, " timed out after ", Seconds(timeout_s), ": rank",
                        num_missing > 1 ? "s " : " ", missing, " of ", e->axis_size, " did not arrive (arrived: ",
                        present, ")");
      e->expiry = DeadlineAfter(timeout_s);  // late arrivals within this window get the error too
      e->cv.notify_all();
      return ErrorResult<R>(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, StrCat("jaxccl: ", e->error)));
    }
    if (e->failed) {
      return ErrorResult<R>(ffi::Error(e->code, StrCat("jaxccl: ", e->error)));
    }
    if (!e->result) return ErrorResult<R>(ffi::Error::InvalidArgument(e->error));
    return e->result;
  }

  // A rank that cannot take part in a launch (its arrival failed: its communicator closed under it, a bad
  // input) says so instead of arriving: the ranks waiting for it fail at once with `why` instead of at the
  // deadline, and the ones still to come get the same error.
  void Abandon(int64_t run_id, int64_t site, int64_t group, int32_t rank, int32_t axis_size, double timeout_s,
               const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto joined = Join(run_id, site, group, rank, axis_size, timeout_s);
    if (!joined.has_value()) return;  // this rank's call contradicts the others' (named to it already)
    const std::shared_ptr<Entry>& e = joined->entry;
    if (!e->failed) {
      e->failed = true;
      e->code = ffi::ErrorCode::kAborted;
      e->error = StrCat("rank ", rank, " could not join the rendezvous at ", joined->where, ": ", why);
      e->expiry = DeadlineAfter(timeout_s);
      e->cv.notify_all();
    }
    if (++e->accounted == e->axis_size) pending_.erase(joined->key);
  }

  // Entries waiting for ranks or kept as failed tombstones.
  size_t NumPending() {
    std::lock_guard<std::mutex> lock(mu_);
    Prune(Clock::now(), last_timeout_s_);
    return pending_.size();
  }
  size_t NumOccurrenceEntries() {
    std::lock_guard<std::mutex> lock(mu_);
    Prune(Clock::now(), last_timeout_s_);
    return occurrences_.size();
  }

 private:
  struct Key {
    int64_t run_id, site, group, occurrence;
    bool operator<(const Key& o) const {
      return std::tie(run_id, site, group, occurrence) < std::tie(o.run_id, o.site, o.group, o.occurrence);
    }
  };
  struct Entry {
    Entry(int32_t n, Clock::time_point d) : axis_size(n), present(n, 0), arrivals(n), deadline(d) {}
    int32_t axis_size;
    int32_t arrived = 0;
    int32_t accounted = 0;  // arrived in time + arrived late
    std::vector<char> present;
    std::vector<Arrival> arrivals;
    Clock::time_point deadline;
    Clock::time_point expiry;
    bool done = false, failed = false;
    ffi::ErrorCode code = ffi::ErrorCode::kDeadlineExceeded;  // of a failed entry
    std::shared_ptr<Result> result;
    std::string error;
    std::condition_variable cv;
  };
  struct Occurrences {
    std::vector<int64_t> counts;  // per rank
    Clock::time_point last_touch;
  };

  struct Joined {
    Key key;
    std::shared_ptr<Entry> entry;
    std::string where;
  };
  // Counts this rank's occurrence of (run, site, group) and finds or makes its entry. Requires mu_.
  ffi::ErrorOr<Joined> Join(int64_t run_id, int64_t site, int64_t group, int32_t rank, int32_t axis_size,
                            double timeout_s) {
    const Clock::time_point now = Clock::now();
    MaybePrune(now, timeout_s);
    Occurrences& occ = occurrences_[std::make_tuple(run_id, site, group)];
    if (occ.counts.empty()) occ.counts.assign(axis_size, 0);
    if (static_cast<int32_t>(occ.counts.size()) != axis_size) {
      return ErrorResult<Joined>(ffi::Error::InvalidArgument(
          StrCat("jaxccl: collective site ", site, " (group ", group, ") was called with axis sizes ",
                 occ.counts.size(), " and ", axis_size, " in one launch")));
    }
    occ.last_touch = now;
    if (run_id > max_run_id_) max_run_id_ = run_id;
    const int64_t occurrence = occ.counts[rank]++;
    const Key key{run_id, site, group, occurrence};
    std::shared_ptr<Entry>& slot = pending_[key];
    if (!slot) slot = std::make_shared<Entry>(axis_size, DeadlineAfter(timeout_s));
    return Joined{key, slot, StrCat("site ", site, ", group ", group, ", occurrence ", occurrence)};
  }

  // Pruning scans everything, so it runs at most every 100 ms or when the maps grow.
  void MaybePrune(Clock::time_point now, double timeout_s) {
    last_timeout_s_ = timeout_s;
    if (now - last_prune_ < std::chrono::milliseconds(100) && occurrences_.size() < prune_size_) return;
    Prune(now, timeout_s);
    prune_size_ = std::max(kMaxRuns, 2 * occurrences_.size());
  }

  void Prune(Clock::time_point now, double timeout_s) {
    last_prune_ = now;
    for (auto it = pending_.begin(); it != pending_.end();) {
      it = it->second->failed && now >= it->second->expiry ? pending_.erase(it) : std::next(it);
    }
    // An occurrence counter may go once no rendezvous of it can still be pending: idle for longer than two
    // deadlines, or idle for a while and from a launch thousands of launches old (run ids only grow).
    const auto stale = std::chrono::duration<double>(2 * timeout_s + 1.0);
    const auto idle = std::chrono::seconds(1);
    for (auto it = occurrences_.begin(); it != occurrences_.end();) {
      const auto age = now - it->second.last_touch;
      const bool old_run = std::get<0>(it->first) + static_cast<int64_t>(kMaxRuns) < max_run_id_;
      it = (age > stale || (old_run && age > idle)) ? occurrences_.erase(it) : std::next(it);
    }
  }

  static constexpr size_t kMaxRuns = 4096;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<Entry>> pending_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, Occurrences> occurrences_;
  int64_t max_run_id_ = INT64_MIN;
  Clock::time_point last_prune_{};
  double last_timeout_s_ = 60.0;
  size_t prune_size_ = kMaxRuns;
};

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_RENDEZVOUS_H_
