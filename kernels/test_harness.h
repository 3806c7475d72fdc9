// The CUDA executor's test entry (test_harness.cu): every rank of a table on one GPU, in one kernel
// (tests/gpu/check_core.py).
#ifndef JAXCCL_KERNELS_TEST_HARNESS_H_
#define JAXCCL_KERNELS_TEST_HARNESS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/measurement_format.h"
#include "core/reduce.h"

namespace jaxccl {
namespace cuda {

struct TestRunResult {
  std::string error;         // empty on success
  int64_t version = 0;       // the table version the launch ran (acquired at the agreed sequence number)
  int64_t seq = 0;           // that sequence number
  int32_t tiles = 1;
  double kernel_ms = 0;      // the interpreter kernel's time (CUDA events)
  std::vector<char> outputs;  // [num_ranks][output bytes]
  std::vector<MeasurementRecord> records;
};

// Runs one call of schedule slot `slot` with all `num_ranks` ranks on the current GPU: each rank issues
// the call (note_issued), the launch acquires the table for the largest sequence number, as the FFI
// handler does, and one kernel runs every rank's program (grid y = rank). `inputs`: [num_ranks][in_elems]
// elements of `esize` bytes; `reduction`: element type and operator (none() for collectives without reduction);
// `tiles` 0 = the executor's choice. With `measure`, the meter runs with `host_of_rank` (empty: one host).
TestRunResult TestRunRanks(int64_t slot, const char* inputs, int32_t num_ranks, int64_t in_elems, int32_t esize,
                           Reduction reduction, int32_t tiles, bool measure, const std::vector<int32_t>& host_of_rank);

}  // namespace cuda
}  // namespace jaxccl

#endif  // JAXCCL_KERNELS_TEST_HARNESS_H_
