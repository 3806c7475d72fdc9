// The compiled schedule table (docs/schedule-ir.md, "Compiled table (version 1)").
//
// ParseTable checks every word of the flat int32 array and returns either a
// Table (core/table_format.h: the words plus derived per-connection and
// per-message indices and the per-rank programs of core/program_builder.h) or
// an ffi::Error naming the first bad word. Both executors (CPU and CUDA)
// interpret exactly these programs.
#ifndef JAXCCL_XLA_FFI_TABLE_H_
#define JAXCCL_XLA_FFI_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/table_format.h"
#include "xla/ffi/api/ffi.h"

namespace jaxccl {

namespace ffi = xla::ffi;

// Parses and checks a table and builds its per-rank programs; the error names the first bad word.
ffi::ErrorOr<std::shared_ptr<const Table>> ParseTable(const int32_t* words, size_t num_words);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_TABLE_H_
