// Output buffers in transparent huge pages.
//
// A collective writes its output buffer once, and XLA allocates a fresh one for every call. A buffer of
// kHugePagesMinBytes or more is a fresh mapping that nothing touched yet (glibc maps every allocation
// above its largest mmap threshold, 32 MiB on 64-bit), so the first write faults in every page: one
// kernel entry and one zeroed page per 4 KiB, which on a CPU costs more than the copy itself. Asking for
// transparent huge pages (madvise MADV_HUGEPAGE, honoured where the system's THP mode is "madvise" or
// "always") makes that one fault per 2 MiB. Memory already in use is left alone, and so is every buffer
// while the kernel has fewer than twice its huge pages free (/proc/buddyinfo): a fault in an advised
// range would then wait for the kernel to compact memory. Nor does it advise anything in a virtual machine
// whose balloon device reports free 2 MiB blocks to the hypervisor (free page reporting): huge pages are
// then made of blocks the host took back, and their first touch waits for the host. The advice is only a
// hint: where the kernel has no huge pages to give, nothing changes but the speed.
#ifndef JAXCCL_XLA_FFI_HUGE_PAGES_H_
#define JAXCCL_XLA_FFI_HUGE_PAGES_H_

#include <cstddef>

namespace jaxccl {

inline constexpr size_t kHugePagesMinBytes = size_t{32} << 20;

// Advises huge pages for the whole 2 MiB pages inside [data, data + bytes) when the range is at least
// kHugePagesMinBytes, huge pages are on (SetHugePages), its first such page was never touched and the
// kernel has twice as many huge pages free.
void AdviseHugePages(void* data, size_t bytes);

// False in a virtual machine whose host reclaims free 2 MiB blocks (then no buffer is advised).
bool HugePagesUsable();

// On by default (for comparisons: off leaves every buffer to the system's default).
void SetHugePages(bool on);
bool HugePages();

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_HUGE_PAGES_H_
