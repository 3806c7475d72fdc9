#include "cpu/link_emulation.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace jaxccl {
namespace {

// The latest time a transfer can be scheduled for (ns since the steady clock's epoch), far below
// INT64_MAX so that adding a route's latency cannot overflow.
constexpr double kHorizonNs = 4e18;

}  // namespace

// ------------------------------------------------------------------ config

ffi::Error NetworkConfig::Validate() const {
  const int64_t n = num_ranks;
  if (n < 1) return ffi::Error::InvalidArgument(StrCat("jaxccl network: num_ranks must be >= 1, got ", n));
  if (static_cast<int64_t>(host_of_rank.size()) != n) {
    return ffi::Error::InvalidArgument(
        StrCat("jaxccl network: host_of_rank has ", host_of_rank.size(), " entries for ", n, " ranks"));
  }
  if (capacity.size() != latency_ns.size()) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl network: ", capacity.size(), " capacities but ",
                                              latency_ns.size(), " latencies"));
  }
  for (size_t l = 0; l < capacity.size(); ++l) {
    if (!(capacity[l] >= kMinCapacity) || !std::isfinite(capacity[l])) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl network: link ", l, " has a real capacity of ", capacity[l],
                                                " bytes/ns; it must be finite and >= ", kMinCapacity,
                                                " (one byte per ", 1e-9 / kMinCapacity, " s)"));
    }
    if (!(latency_ns[l] >= 0) || !(latency_ns[l] <= kMaxLatencyNs)) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl network: link ", l, " has a real latency of ", latency_ns[l],
                                                " ns; it must be between 0 and ", kMaxLatencyNs, " ns"));
    }
  }
  if (static_cast<int64_t>(route_offsets.size()) != n * n + 1 || route_offsets.front() != 0 ||
      route_offsets.back() != static_cast<int32_t>(route_links.size())) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl network: route_offsets must have N*N+1 = ", n * n + 1,
                                              " entries from 0 to len(route_links) = ", route_links.size()));
  }
  for (int64_t p = 0; p < n * n; ++p) {
    if (route_offsets[p + 1] < route_offsets[p]) {
      return ffi::Error::InvalidArgument(StrCat("jaxccl network: route_offsets decrease at pair ", p));
    }
    if (p / n != p % n && route_offsets[p + 1] == route_offsets[p]) {
      return ffi::Error::InvalidArgument(
          StrCat("jaxccl network: no route from rank ", p / n, " to rank ", p % n, " (every pair needs one)"));
    }
  }
  for (int32_t l : route_links) {
    if (l < 0 || l >= static_cast<int32_t>(capacity.size())) {
      return ffi::Error::InvalidArgument(
          StrCat("jaxccl network: route names link ", l, " but there are ", capacity.size(), " links"));
    }
  }
  if (intra_threshold < 1 || inter_threshold < 1) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl network: channel thresholds must be >= 1, got intra ",
                                              intra_threshold, ", inter ", inter_threshold));
  }
  if (min_window_bytes < 0) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl network: min_window_bytes must be >= 0, got ", min_window_bytes));
  }
  if (slots_per_tb < 1 || slots_per_tb > kMaxSlotsPerTb) {
    return ffi::Error::InvalidArgument(
        StrCat("jaxccl network: slots_per_tb must be in [1, ", kMaxSlotsPerTb, "], got ", slots_per_tb));
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ cache


// ------------------------------------------------------------------ network

ffi::ErrorOr<std::shared_ptr<Network>> Network::Create(NetworkConfig config) {
  if (ffi::Error e = config.Validate(); e.failure()) return ErrorResult<std::shared_ptr<Network>>(std::move(e));
  std::shared_ptr<Network> net(new Network());
  const int32_t n = config.num_ranks;
  net->num_ranks_ = n;
  net->host_of_rank_ = config.host_of_rank;
  for (int32_t i = 0; i < n; ++i) net->intra_acc_.push_back(std::make_unique<Accumulator>());
  for (int64_t i = 0; i < static_cast<int64_t>(n) * n; ++i) net->inter_acc_.push_back(std::make_unique<Accumulator>());
  if (ffi::Error e = net->Update(std::move(config)); e.failure()) return ErrorResult<std::shared_ptr<Network>>(std::move(e));
  return net;
}

ffi::Error Network::Update(NetworkConfig config) {
  if (ffi::Error e = config.Validate(); e.failure()) return e;
  if (config.num_ranks != num_ranks_) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl network: update has ", config.num_ranks,
                                              " ranks but the network was created for ", num_ranks_));
  }
  if (config.host_of_rank != host_of_rank_) {
    return ffi::Error::InvalidArgument("jaxccl network: an update cannot move GPUs to other hosts");
  }
  {
    std::lock_guard<std::mutex> lock(links_mu_);
    if (config.capacity.size() != free_at_ns_.size()) {
      free_at_ns_.assign(config.capacity.size(), 0.0);
    } else {
      // A link whose capacity changes carries the bytes still queued on it at its new speed: a backlog
      // reserved on a nearly dead link drains at once when the link heals, instead of blocking it for good.
      const double now = static_cast<double>(NowNs());
      for (size_t l = 0; l < free_at_ns_.size(); ++l) {
        if (free_at_ns_[l] > now && config.capacity[l] != capacity_[l]) {
          free_at_ns_[l] = now + (free_at_ns_[l] - now) * capacity_[l] / config.capacity[l];
        }
      }
    }
    capacity_ = std::move(config.capacity);
    latency_ns_ = std::move(config.latency_ns);
    route_offsets_ = std::move(config.route_offsets);
    route_links_ = std::move(config.route_links);
    route_latency_ns_.assign(static_cast<size_t>(num_ranks_) * num_ranks_, 0);
    for (size_t p = 0; p < route_latency_ns_.size(); ++p) {
      double lat = 0;
      for (int32_t k = route_offsets_[p]; k < route_offsets_[p + 1]; ++k) lat += latency_ns_[route_links_[k]];
      route_latency_ns_[p] = static_cast<int64_t>(std::ceil(lat));
    }
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    slots_per_tb_ = config.slots_per_tb;  // regions made from now on get this many slots
  }
  intra_threshold_.store(config.intra_threshold);
  inter_threshold_.store(config.inter_threshold);
  min_window_bytes_.store(config.min_window_bytes);
  pace_.store(config.pace);
  measure_.store(config.measure);
  link_timestamps_.store(config.link_timestamps);
  trace_.store(config.trace);
  return ffi::Error::Success();
}

Transfer Network::Reserve(int32_t src, int32_t dst, size_t bytes, int64_t now_ns) {
  std::lock_guard<std::mutex> lock(links_mu_);
  const int64_t p = static_cast<int64_t>(src) * num_ranks_ + dst;
  const double now = static_cast<double>(now_ns);
  double done = now;
  double start_of_bottleneck = now;
  double first_start = now, first_end = now;
  for (int32_t k = route_offsets_[p]; k < route_offsets_[p + 1]; ++k) {
    const int32_t l = route_links_[k];
    const double start = std::max(now, free_at_ns_[l]);
    free_at_ns_[l] = start + static_cast<double>(bytes) / capacity_[l];
    if (k == route_offsets_[p]) first_start = start, first_end = free_at_ns_[l];
    if (free_at_ns_[l] >= done) {
      done = free_at_ns_[l];
      start_of_bottleneck = start;
    }
  }
  // Saturate instead of overflowing int64: a transfer that would end beyond the horizon just never ends
  // in time, and the wait for it misses its deadline.
  const auto ns = [](double t) { return static_cast<int64_t>(std::min(t, kHorizonNs)); };
  Transfer t;
  t.tx_start_ns = ns(start_of_bottleneck);
  t.tx_end_ns = static_cast<int64_t>(std::ceil(std::min(done, kHorizonNs)));
  t.ready_ns = std::min<int64_t>(t.tx_end_ns, static_cast<int64_t>(kHorizonNs)) + route_latency_ns_[p];
  const bool injection = Intra(src, dst);
  t.meter_start_ns = injection ? ns(first_start) : t.tx_start_ns;
  t.meter_end_ns = injection ? static_cast<int64_t>(std::ceil(std::min(first_end, kHorizonNs))) : t.tx_end_ns;
  return t;
}

Network::Accumulator& Network::AccumulatorFor(int32_t src, int32_t dst) {
  return Intra(src, dst) ? *intra_acc_[src] : *inter_acc_[static_cast<int64_t>(src) * num_ranks_ + dst];
}

void Network::OnPost(int32_t src, int32_t dst, int64_t post_ns, bool became_busy, const Transfer* t) {
  const int32_t threshold = (Intra(src, dst) ? intra_threshold_ : inter_threshold_).load(std::memory_order_relaxed);
  Accumulator& acc = AccumulatorFor(src, dst);
  std::lock_guard<std::mutex> lock(acc.mu);
  MeterOnPost(&acc.w, threshold, became_busy, t != nullptr, t ? t->meter_start_ns : post_ns,
              t ? t->meter_end_ns : post_ns);
}

void Network::OnDelivered(int32_t src, int32_t dst, size_t bytes, int64_t done_ns, bool now_idle,
                          MeasurementCache* cache) {
  const bool intra = Intra(src, dst);
  Accumulator& acc = AccumulatorFor(src, dst);
  const int32_t threshold = (intra ? intra_threshold_ : inter_threshold_).load(std::memory_order_relaxed);
  double bw = -1;
  {
    std::lock_guard<std::mutex> lock(acc.mu);
    bw = MeterOnDelivered(&acc.w, threshold, min_window_bytes_.load(std::memory_order_relaxed),
                          static_cast<int64_t>(bytes), now_idle, done_ns);
  }
  if (bw > 0) {
    windows_.fetch_add(1, std::memory_order_relaxed);
    cache->Add(src, intra ? -1 : dst, intra ? LinkKind::kIntra : LinkKind::kInter, bw);
  }
}

Network::Region& Network::RegionFor(int64_t slot, int32_t rank, int32_t tb) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  auto& r = regions_[{slot, rank, tb}];
  if (!r) {
    r = std::make_unique<Region>();
    r->slots.resize(slots_per_tb_);
    r->flags.reset(new std::atomic<int32_t>[slots_per_tb_]);
    for (int32_t k = 0; k < slots_per_tb_; ++k) r->flags[k].store(0);
  }
  return *r;
}

void Network::Flush(int64_t slot, int32_t rank, int32_t tb, const MeasurementCache& cache) {
  if (cache.empty()) return;
  dropped_.fetch_add(cache.overflow, std::memory_order_relaxed);
  if (cache.size == 0) return;
  Region& r = RegionFor(slot, rank, tb);
  std::lock_guard<std::mutex> lock(r.writer);
  const size_t n = r.slots.size();
  for (int32_t j = 0; j < cache.size; ++j) {
    const MeasurementCacheEntry& e = cache.entries[j];
    const size_t k = r.write % n;
    if (r.flags[k].load(std::memory_order_acquire) != 0) {  // the host has not drained it: drop, never wait
      dropped_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    r.slots[k] = MeasurementRecord{0, e.src, e.dst, e.kind, e.count, tb, e.sum_bw};
    r.flags[k].store(1, std::memory_order_release);
    ++r.write;
    records_.fetch_add(1, std::memory_order_relaxed);
  }
}

std::vector<MeasurementRecord> Network::Drain() {
  std::vector<MeasurementRecord> out;
  std::lock_guard<std::mutex> lock(regions_mu_);
  for (auto& [key, r] : regions_) {
    const size_t n = r->slots.size();
    while (r->flags[r->read % n].load(std::memory_order_acquire) == 1) {
      MeasurementRecord rec = r->slots[r->read % n];
      rec.flag = 1;
      out.push_back(rec);
      r->flags[r->read % n].store(0, std::memory_order_release);
      ++r->read;
    }
  }
  return out;
}

MeasurementStats Network::Stats() {
  MeasurementStats s;
  s.windows = windows_.load();
  s.records = records_.load();
  s.dropped = dropped_.load();
  s.accumulator_bytes = static_cast<int64_t>((intra_acc_.size() + inter_acc_.size()) * sizeof(MeasurementAccumulator));
  std::lock_guard<std::mutex> lock(regions_mu_);
  s.regions = static_cast<int64_t>(regions_.size());
  for (auto& [key, r] : regions_) {
    s.slots += static_cast<int64_t>(r->slots.size());
    for (size_t k = 0; k < r->slots.size(); ++k) s.used += r->flags[k].load(std::memory_order_acquire);
  }
  s.buffer_bytes = s.slots * static_cast<int64_t>(sizeof(MeasurementRecord));
  return s;
}

void Network::ResetMeasurements() {
  for (auto* accs : {&intra_acc_, &inter_acc_}) {
    for (auto& acc : *accs) {
      std::lock_guard<std::mutex> lock(acc->mu);
      const int32_t active = acc->w.a.active;  // connections in flight right now stay counted
      acc->w = MeterWindow{};
      acc->w.a.active = active;
    }
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    regions_.clear();
  }
  windows_.store(0);
  records_.store(0);
  dropped_.store(0);
}

void Network::Trace(const TraceRecord& r) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  if (trace_records_.size() < kMaxTrace) {
    trace_records_.push_back(r);
  } else {
    ++trace_dropped_;
  }
}

std::vector<TraceRecord> Network::TakeTrace(int64_t* dropped) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  *dropped = trace_dropped_;
  trace_dropped_ = 0;
  return std::exchange(trace_records_, {});
}

// ------------------------------------------------------------------ registry of networks

namespace {
std::mutex nets_mu;
int64_t next_net_id = 1;
std::map<int64_t, std::shared_ptr<Network>>& Nets() {
  static auto* nets = new std::map<int64_t, std::shared_ptr<Network>>();
  return *nets;
}
std::map<int64_t, std::shared_ptr<Network>>& SlotNets() {
  static auto* m = new std::map<int64_t, std::shared_ptr<Network>>();
  return *m;
}
}  // namespace

ffi::ErrorOr<int64_t> CreateNetwork(NetworkConfig config) {
  auto net = Network::Create(std::move(config));
  if (!net.has_value()) return ErrorResult<int64_t>(std::move(net.error()));
  std::lock_guard<std::mutex> lock(nets_mu);
  const int64_t id = next_net_id++;
  Nets()[id] = std::move(*net);
  return id;
}

ffi::ErrorOr<std::shared_ptr<Network>> FindNetwork(int64_t id) {
  std::lock_guard<std::mutex> lock(nets_mu);
  auto it = Nets().find(id);
  if (it == Nets().end()) {
    return ErrorResult<std::shared_ptr<Network>>(ffi::Error::InvalidArgument(StrCat("jaxccl: no network ", id)));
  }
  return it->second;
}

ffi::Error UpdateNetwork(int64_t id, NetworkConfig config) {
  auto net = FindNetwork(id);
  if (!net.has_value()) return std::move(net.error());
  return (*net)->Update(std::move(config));
}

ffi::Error RemoveNetwork(int64_t id) {
  std::lock_guard<std::mutex> lock(nets_mu);
  auto it = Nets().find(id);
  if (it == Nets().end()) return ffi::Error::InvalidArgument(StrCat("jaxccl: no network ", id));
  for (auto s = SlotNets().begin(); s != SlotNets().end();) {
    s = s->second == it->second ? SlotNets().erase(s) : std::next(s);
  }
  Nets().erase(it);
  return ffi::Error::Success();
}

ffi::Error AttachNetwork(int64_t slot, int64_t id) {
  std::lock_guard<std::mutex> lock(nets_mu);
  if (id == 0) {
    SlotNets().erase(slot);
    return ffi::Error::Success();
  }
  auto it = Nets().find(id);
  if (it == Nets().end()) return ffi::Error::InvalidArgument(StrCat("jaxccl: no network ", id));
  SlotNets()[slot] = it->second;
  return ffi::Error::Success();
}

std::shared_ptr<Network> NetworkOfSlot(int64_t slot) {
  std::lock_guard<std::mutex> lock(nets_mu);
  auto it = SlotNets().find(slot);
  return it == SlotNets().end() ? nullptr : it->second;
}

}  // namespace jaxccl
