#include "daemon/session/shard_spec.h"

#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "dos/wire/status_macros.h"
#include "daemon/sched/device_selection.h"
#include "dos/wire/control_block.h"
#include "dos/wire/hparams.h"

namespace dos {
namespace {

// One session's steps run on one engine: INVALID_ARGUMENT naming the first
// tensor whose CUDA memory is on another device than tensor 0's param.
// (shm locations are skipped; a mix of both is refused by CheckTensor.)
absl::Status CheckOneDevice(const ShardSpec& spec) {
  const TensorSpec& t0 = spec.tensors[0];
  const std::string first = FormatDeviceUuid(t0.param.device_uuid);
  for (uint32_t i = 0; i < spec.tensors.size(); ++i) {
    const TensorSpec& t = spec.tensors[i];
    for (auto [ref, part] : {std::pair{&t.param, "param"}, std::pair{&t.grad, "grad"}}) {
      if (!ref->is_cuda_ipc()) continue;
      const std::string uuid = FormatDeviceUuid(ref->device_uuid);
      if (uuid == first) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          TensorWhat(i, t.desc.name, part), " lives on GPU ",
          uuid.empty() ? "(no UUID sent)" : uuid, " but tensor 0",
          t0.desc.name.empty() ? "" : absl::StrCat(" (", t0.desc.name, ")"), " param lives on GPU ",
          first.empty() ? "(no UUID sent)" : first,
          "; all tensors of a session must be on one device (the rank's GPU): move them "
          "there, or attach one session per device"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const ShardSpec& spec, uint32_t i, bool device) {
  const TensorSpec& t = spec.tensors[i];
  const TensorDesc& d = t.desc;
  if (d.numel == 0) {
    return absl::InvalidArgumentError(TensorWhat(i, d.name, "has 0 elements; leave it out"));
  }
  if (d.group >= spec.groups.size()) {
    return absl::InvalidArgumentError(TensorWhat(
        i, d.name, absl::StrCat("names param group ", d.group, " but only ", spec.groups.size(),
                                " groups were given")));
  }
  constexpr uint64_t kMaxNumel = uint64_t{1} << 40;
  if (d.numel > kMaxNumel) {
    return absl::InvalidArgumentError(TensorWhat(
        i, d.name, absl::StrCat("has ", d.numel, " elements, more than the ", kMaxNumel,
                                " supported")));
  }
  for (auto [ref, dtype, part] : {std::tuple{&t.param, d.param_dtype, "param"},
                                  std::tuple{&t.grad, d.grad_dtype, "grad"}}) {
    if (ref->offset % DTypeSize(dtype) != 0) {
      return absl::InvalidArgumentError(TensorWhat(
          i, d.name, absl::StrCat(part, " offset ", ref->offset, " is not a multiple of the ",
                                  DTypeName(dtype), " element size")));
    }
  }
  if (t.param.is_cuda_ipc() != device || t.grad.is_cuda_ipc() != device) {
    return absl::InvalidArgumentError(TensorWhat(
        i, d.name, "mixes CUDA IPC and shared-memory locations; a session registers either "
                   "all tensors in GPU memory or all in shared memory"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string TensorWhat(uint32_t index, const std::string& name, absl::string_view part) {
  return absl::StrCat("register: tensor ", index, name.empty() ? "" : absl::StrCat(" (", name, ")"),
                      " ", part);
}

absl::Status CheckTensorName(uint32_t index, size_t bytes) {
  if (bytes <= kMaxTensorNameBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("register: tensor ", index, "'s name has ", bytes,
                                                 " bytes; at most ", kMaxTensorNameBytes,
                                                 " are kept: give it a shorter name"));
}

absl::Status ValidateShardSpec(const ShardSpec& spec) {
  if (spec.groups.empty() || spec.groups.size() > kMaxGroups) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", spec.groups.size(),
                                                   " param groups given; 1 to ", kMaxGroups,
                                                   " are supported"));
  }
  for (size_t g = 0; g < spec.groups.size(); ++g) {
    DOS_RETURN_IF_ERROR(ValidateGroupStepParams(spec.groups[g].defaults, g, "register"));
  }
  if (spec.tensors.empty()) {
    return absl::InvalidArgumentError("register: no tensors given");
  }
  // GPU mode when the client sent CUDA IPC locations; one session is all one
  // or all the other (the step runs wholly on one engine).
  const bool device = InDeviceMemory(spec);
  if (!spec.cuda_ipc_event.empty() && !device) {
    return absl::InvalidArgumentError(
        "register: cuda_ipc_event was sent but the tensors are in shared memory; send an "
        "event only with CUDA IPC tensors");
  }
  if (device) DOS_RETURN_IF_ERROR(CheckOneDevice(spec));
  for (uint32_t i = 0; i < spec.tensors.size(); ++i) {
    DOS_RETURN_IF_ERROR(CheckTensorName(i, spec.tensors[i].desc.name.size()));
    DOS_RETURN_IF_ERROR(CheckTensor(spec, i, device));
  }
  return absl::OkStatus();
}

}  // namespace dos
