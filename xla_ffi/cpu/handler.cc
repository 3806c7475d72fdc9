#include "cpu/handler.h"

#include "host/common.h"
#include "cpu/executor.h"
#include "host/dtype.h"
#include "cpu/output_memory.h"
#include "host/registry.h"
#include "host/rendezvous.h"

namespace jaxccl {
namespace {

using CpuRendezvous = Rendezvous<CpuArrival, CpuLaunch>;
using Coords = ffi::Buffer<ffi::S32, 1>;  // an alias: the comma would split the handler macro's arguments

CpuRendezvous& TheRendezvous() {
  static auto* r = new CpuRendezvous();  // never destroyed (see Registry::Get)
  return *r;
}

ffi::Error CpuCollective(ffi::RunId run_id, ffi::AnyBuffer x, Coords coords,
                         ffi::Result<ffi::AnyBuffer> out, int64_t slot, int64_t site, int64_t axis_size,
                         int64_t reduce_op) {
  if (coords.element_count() != 2) {
    return ffi::Error::InvalidArgument(
        StrCat("jaxccl_cpu_collective: coords must be int32[2] (rank, group), got ", coords.element_count(),
               " elements"));
  }
  if (axis_size < 1 || axis_size > (1 << 16)) {
    return ffi::Error::InvalidArgument(StrCat("jaxccl_cpu_collective: axis_size must be in 1..65536, got ", axis_size));
  }
  const int32_t rank = coords.typed_data()[0];
  const int32_t group = coords.typed_data()[1];
  if (rank < 0 || rank >= axis_size) {
    return ffi::Error::InvalidArgument(
        StrCat("jaxccl_cpu_collective: rank ", rank, " is outside the axis of size ", axis_size));
  }
  const int32_t n = static_cast<int32_t>(axis_size);
  auto me = ArrivalOf(x, *out, slot, rank, reduce_op);
  if (!me.has_value()) {
    TheRendezvous().Abandon(run_id.run_id, site, group, rank, n, Registry::Get().timeout_s(), me.error().message());
    return std::move(me.error());
  }
  auto launch = TheRendezvous().Arrive(
      run_id.run_id, site, group, rank, n, *me, Registry::Get().timeout_s(),
      [&](const std::vector<CpuArrival>& all) { return CpuLaunch::Start(slot, n, all); });
  if (!launch.has_value()) return std::move(launch.error());
  return (*launch)->WaitRank(rank);
}

}  // namespace

ffi::ErrorOr<CpuArrival> ArrivalOf(ffi::AnyBuffer x, ffi::AnyBuffer out, int64_t slot, int32_t rank,
                                   int64_t reduce_op) {
  auto op = ReduceOpOf(reduce_op);
  if (!op.has_value()) return ErrorResult<CpuArrival>(std::move(op.error()));
  CpuArrival me;
  me.in = x.untyped_data();
  me.out = out.untyped_data();
  me.in_elems = static_cast<int64_t>(x.element_count());
  me.out_elems = static_cast<int64_t>(out.element_count());
  me.in_dtype = x.element_type();
  me.out_dtype = out.element_type();
  PrepareOutput(me.out, out.size_bytes());  // before anything writes it
  me.reduce_op = *op;
  auto seq = Registry::Get().NoteIssued(slot, rank);
  if (!seq.has_value()) return ErrorResult<CpuArrival>(std::move(seq.error()));
  me.seq = *seq;
  return me;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcclCpuCollective, CpuCollective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Coords>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("axis_size")
                                  .Attr<int64_t>("reduce_op"));

size_t CpuPendingRendezvous() { return TheRendezvous().NumPending(); }
size_t CpuOccurrenceEntries() { return TheRendezvous().NumOccurrenceEntries(); }

}  // namespace jaxccl
