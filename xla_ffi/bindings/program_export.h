// The dataflow order and meter exports of jaxccl._native (program_export.cc).
#ifndef JAXCCL_XLA_FFI_BINDINGS_PROGRAM_EXPORT_H_
#define JAXCCL_XLA_FFI_BINDINGS_PROGRAM_EXPORT_H_

#include <nanobind/nanobind.h>

namespace jaxccl {

// Adds LOOKAHEAD, ALL_DONE, NONE_READY, ParsedTable, program_rows, next_ready_unit and meter_windows to `m`.
void RegisterProgramExport(nanobind::module_& m);

}  // namespace jaxccl

#endif  // JAXCCL_XLA_FFI_BINDINGS_PROGRAM_EXPORT_H_
