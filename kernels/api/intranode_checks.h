// Input checks of the intranode entry points, one copy for both backends (kernels/api/intranode_api.cc for CUDA,
// kernels/host_backend/host_intranode.cc for the host backend), so that both refuse exactly the same input with the
// same message. Errors are InvalidArgument naming the field and its value.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "epfabric/kernels/intranode.h"

namespace epfabric::kernels::intranode_checks {

// What differs between the backends: the GPU needs 16-byte aligned tensors (vector loads) and a status word.
enum class Backend { kCuda, kHost };

// The kernels' limits, also enforced on the host so that both backends accept the same calls.
inline constexpr int kMaxTopk = 32;             // one lane per top-k slot
inline constexpr int kMaxLayoutExperts = 8192;  // the layout kernel's shared-memory histogram
inline constexpr int kMaxLayoutRanks = 64;      // the layout kernel's rank bit mask
inline constexpr int kFp8ScaleBlock = 128;

// The group (rank, regions, status, timeout); returns the region layout the call will use.
absl::StatusOr<IntranodeRegionLayout> CheckGroup(const IntranodeGroup& group, Backend backend);
absl::Status CheckLayout(const DispatchLayoutParams& params);
absl::Status CheckNotify(const IntranodeGroup& group, const IntranodeNotifyParams& params);
absl::Status CheckDispatch(const IntranodeGroup& group, const IntranodeDispatchParams& params,
                           const IntranodeHandle* handle, Backend backend);
absl::Status CheckCombine(const IntranodeGroup& group, const IntranodeCombineParams& params,
                          const IntranodeHandle& handle, Backend backend);

}  // namespace epfabric::kernels::intranode_checks
