#include "cpu/output_memory.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace jaxccl {
namespace {
std::atomic<bool> g_huge_pages{true};
std::atomic<bool> g_prefault{true};

// Free blocks of 2 MiB or more, counted in 2 MiB pages, from /proc/buddyinfo (its lines list the free
// blocks of order 0, 1, ... of each memory zone; order 9 is 2 MiB with 4 KiB pages); -1 if unreadable.
int64_t FreeHugePages() {
  std::FILE* f = std::fopen("/proc/buddyinfo", "r");
  if (f == nullptr) return -1;
  int64_t pages = 0;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    const char* p = std::strstr(line, "zone");
    if (p == nullptr) continue;
    p += 4;
    while (*p == ' ') ++p;
    while (*p != ' ' && *p != '\0') ++p;  // the zone's name
    char* end = nullptr;
    for (int order = 0;; ++order) {
      const long long count = std::strtoll(p, &end, 10);
      if (end == p) break;
      if (order >= 9) pages += count << (order - 9);
      p = end;
    }
  }
  std::fclose(f);
  return pages;
}

// Whether a virtio balloon device reports free memory to the hypervisor (free page reporting, feature bit
// 5) in blocks of 2 MiB: the host then takes such blocks back, and the first touch of a huge page made
// of one waits for the host to fault it in again (measured here: calls 4-7x slower at random).
bool HostReclaimsFreeHugePages() {
  const char* kOrder = "/sys/module/page_reporting/parameters/page_reporting_order";
  int order = 9;  // the kernel's default: pageblock order, 2 MiB
  if (std::FILE* f = std::fopen(kOrder, "r")) {
    if (std::fscanf(f, "%d", &order) != 1) order = 9;
    std::fclose(f);
  }
  if (order > 9) return false;
  for (int device = 0; device < 64; ++device) {
    char path[128];
    std::snprintf(path, sizeof(path), "/sys/bus/virtio/drivers/virtio_balloon/virtio%d/features", device);
    std::FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;
    char bits[8] = {0};
    const size_t n = std::fread(bits, 1, 6, f);
    std::fclose(f);
    if (n == 6 && bits[5] == '1') return true;
  }
  return false;
}
}  // namespace

bool HugePagesUsable() {
  static const bool usable = !HostReclaimsFreeHugePages();
  return usable;
}

void SetHugePages(bool on) { g_huge_pages.store(on); }
bool HugePages() { return g_huge_pages.load(); }
void SetPrefault(bool on) { g_prefault.store(on); }
bool Prefault() { return g_prefault.load(); }

void PrepareOutput(void* data, size_t bytes) {
#if defined(__linux__)
  static const long page = sysconf(_SC_PAGESIZE);
  const uintptr_t p = static_cast<uintptr_t>(page);
  if (bytes < kPrefaultMinBytes || (!Prefault() && !HugePages())) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + p - 1) & ~(p - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(p - 1);
  if (end <= begin) return;
  // A resident first page: the memory was used before (a reused allocation); its pages stay as they are.
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(begin), p, &resident) != 0 || (resident & 1u)) return;
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t huge_begin = (begin + kHuge - 1) & ~(kHuge - 1), huge_end = end & ~(kHuge - 1);
  // Only while the kernel has twice the huge pages free (every rank may ask at once): a fault in an
  // advised range may otherwise wait for the kernel to compact memory, which costs more than it saves.
  if (bytes >= kHugePagesMinBytes && HugePages() && HugePagesUsable() && huge_end > huge_begin &&
      FreeHugePages() >= 2 * static_cast<int64_t>((huge_end - huge_begin) / kHuge)) {
    madvise(reinterpret_cast<void*>(huge_begin), huge_end - huge_begin, MADV_HUGEPAGE);  // a hint
  }
#endif
  constexpr int kPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14); older kernels refuse it: EINVAL
  if (Prefault()) madvise(reinterpret_cast<void*>(begin), end - begin, kPopulateWrite);
#else
  (void)data;
  (void)bytes;
#endif
}

double ResidentAfterPrepare(size_t bytes) {
#if defined(__linux__)
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return -1;
  PrepareOutput(p, bytes);
  static const long page = sysconf(_SC_PAGESIZE);
  const size_t pages = (bytes + static_cast<size_t>(page) - 1) / static_cast<size_t>(page);
  std::vector<unsigned char> resident(pages);
  double fraction = -1;
  if (mincore(p, bytes, resident.data()) == 0) {
    size_t n = 0;
    for (unsigned char r : resident) n += r & 1u;
    fraction = static_cast<double>(n) / static_cast<double>(pages);
  }
  munmap(p, bytes);
  return fraction;
#else
  (void)bytes;
  return -1;
#endif
}

}  // namespace jaxccl
