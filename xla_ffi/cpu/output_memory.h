// The output buffer of a collective, prepared before anything writes it.
//
// A collective writes its output buffer once, and XLA allocates a fresh one for every call. A fresh
// buffer's first write faults in every page: a kernel entry and a zeroed page per 4 KiB, which on a
// CPU costs about as much as the copies themselves (an AllGather of 4 MiB per rank on 8 devices
// faults in 65,536 pages per call). Each rank's handler prepares its own output when it arrives,
// before the launch starts:
//   * Prefault: an output of kPrefaultMinBytes or more whose first page was never touched is faulted
//     in by one madvise(MADV_POPULATE_WRITE) (Linux 5.14): the same zeroed pages without an exception
//     per page, done while the rank waits for the others to arrive.
//   * Huge pages: an output of kHugePagesMinBytes or more is a fresh mapping (glibc maps every
//     allocation above its largest mmap threshold, 32 MiB on 64-bit); asking for transparent huge
//     pages (MADV_HUGEPAGE, honoured in the THP modes "madvise" and "always") makes that one page per
//     2 MiB. Not while the kernel has fewer than twice the huge pages free (/proc/buddyinfo: a fault
//     would wait for compaction), and never in a virtual machine whose balloon device reports free
//     2 MiB blocks to the hypervisor (free page reporting): there a huge page is often a block the
//     host took back, and its first touch waits for the host.
// Memory already in use (a resident first page) is left alone. Both are hints: where the kernel
// refuses one, nothing changes but the speed.
#ifndef JAXCCL_XLA_FFI_OUTPUT_MEMORY_H_
#define JAXCCL_XLA_FFI_OUTPUT_MEMORY_H_

#include <cstddef>

namespace jaxccl {

inline constexpr size_t kPrefaultMinBytes = size_t{8} << 20;
inline constexpr size_t kHugePagesMinBytes = size_t{32} << 20;

// Prepares [data, data + bytes), an output no one wrote yet in this call (see above).
void PrepareOutput(void* data, size_t bytes);

// For tests: maps `bytes` of fresh memory, prepares it as an output and returns the fraction of its
// pages that are resident before anything wrote them (-1 if the memory could not be mapped).
double ResidentAfterPrepare(size_t bytes);

// False in a virtual machine whose host reclaims free 2 MiB blocks (then no buffer gets huge pages).
bool HugePagesUsable();

// Both on by default (off, for comparisons: the system's default for every buffer).
void SetHugePages(bool on);
bool HugePages();
void SetPrefault(bool on);
bool Prefault();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_OUTPUT_MEMORY_H_
