// jaxccl_cpu_mp_collective: this process's ranks meet in the in-process rendezvous (keyed by their index
// among the local ranks), the last one starts a launch whose remote connections go through the process
// group's transport (transport/proxy.h), and each rank runs its threadblocks as in one process.
#include "transport/handler.h"

#include "host/common.h"
#include "cpu/executor.h"
#include "cpu/handler.h"
#include "host/registry.h"
#include "host/rendezvous.h"
#include "transport/proxy.h"

namespace jaxccl {
namespace {

using Coords = ffi::Buffer<ffi::S32, 1>;

Rendezvous<CpuArrival, CpuLaunch>& TheRendezvous() {
  static auto* r = new Rendezvous<CpuArrival, CpuLaunch>();  // never destroyed (see Registry::Get)
  return *r;
}

ffi::Error CpuMpCollective(ffi::RunId run_id, ffi::AnyBuffer x, Coords coords, ffi::Result<ffi::AnyBuffer> out,
                           int64_t slot, int64_t site, int64_t axis_size, int64_t reduce_op) {
  if (coords.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxccl_cpu_mp_collective: coords must be int32[2] (rank, group)");
  }
  auto found = ProcessGroupOf(coords.typed_data()[1]);
  if (!found.has_value()) return std::move(found.error());
  const std::shared_ptr<const ProcessGroup> group = *found;
  const int32_t rank = coords.typed_data()[0];
  const int32_t rgroup = coords.typed_data()[1];
  if (ffi::Error e = CheckLocalRank(*group, rgroup, rank, axis_size); e.failure()) return e;
  auto me = ArrivalOf(x, *out, slot, rank, reduce_op);
  if (!me.has_value()) {
    TheRendezvous().Abandon(run_id.run_id, site, rgroup, group->local_index[rank], group->num_local,
                            Registry::Get().timeout_s(), me.error().message());
    return std::move(me.error());
  }
  const int32_t n = static_cast<int32_t>(axis_size);
  auto launch = TheRendezvous().Arrive(
      run_id.run_id, site, rgroup, group->local_index[rank], group->num_local, *me, Registry::Get().timeout_s(),
      [&](const std::vector<CpuArrival>& local) {
        std::vector<CpuArrival> all(n);
        for (int32_t r = 0; r < n; ++r) {
          if (group->Local(r)) all[r] = local[group->local_index[r]];
        }
        return CpuLaunch::Start(slot, n, all, group);
      });
  if (!launch.has_value()) return std::move(launch.error());
  return (*launch)->WaitRank(rank);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcclCpuMpCollective, CpuMpCollective,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Coords>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("axis_size")
                                  .Attr<int64_t>("reduce_op"));

}  // namespace jaxccl
