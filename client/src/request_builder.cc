#include "request_builder.h"

#include <cstring>

#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "dos/wire/dtype.h"
#include "dos/wire/hparams.h"
#include "dos/wire/status_macros.h"

namespace dos::client {
namespace {

// Reads a dtype field as the integer the caller stored. A C caller (or
// ctypes) may store any int there, and loading an out-of-range value through
// the C++ enum type is undefined behaviour, so copy the bytes instead.
int RawDType(const dos_dtype& field) {
  int32_t raw;
  static_assert(sizeof(raw) == sizeof(dos_dtype));
  std::memcpy(&raw, &field, sizeof raw);
  return raw;
}

absl::Status CheckDType(int raw, const std::string& what) {
  if (!IsValidDType(static_cast<uint32_t>(raw))) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " has unsupported dtype ", raw,
        "; use DOS_DTYPE_F32 (1), DOS_DTYPE_BF16 (2) or DOS_DTYPE_F16 (3)"));
  }
  return absl::OkStatus();
}

// Fills `loc` with where [ptr, ptr + bytes) lives: a shm buffer of this
// session, else (with `device`) CUDA device memory. Sets *on_device.
absl::Status Locate(const void* ptr, uint64_t bytes, const std::string& what,
                    const BufferTable& buffers, DeviceMemory* device, v1::MemoryLocation* loc,
                    bool* on_device) {
  *on_device = false;
  if (device != nullptr && ptr != nullptr && !buffers.Contains(ptr)) {
    DOS_ASSIGN_OR_RETURN(std::optional<DeviceRange> range, device->Describe(ptr, bytes, what));
    if (range.has_value()) {
      v1::CudaIpcLocation* c = loc->mutable_cuda_ipc();
      c->set_handle(range->handle);
      c->set_offset(range->offset);
      c->set_alloc_bytes(range->alloc_bytes);
      c->set_device_uuid(range->device_uuid);
      *on_device = true;
      return absl::OkStatus();
    }
  }
  absl::StatusOr<BufferRef> ref = buffers.Resolve(ptr, bytes, what);
  if (!ref.ok()) {
    if (device != nullptr && ptr != nullptr && !buffers.Contains(ptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(ref.status().message(), ", or in CUDA device memory (cudaMalloc)"));
    }
    return ref.status();
  }
  loc->mutable_shm()->set_name(ref->name);
  loc->mutable_shm()->set_offset(ref->offset);
  return absl::OkStatus();
}

}  // namespace

std::string TensorLabel(const dos_tensor& t, size_t index) {
  if (t.name != nullptr && t.name[0] != '\0') {
    return absl::StrCat("tensor ", index, " ('", t.name, "')");
  }
  return absl::StrCat("tensor ", index);
}

TensorDesc DescribeTensor(const dos_tensor& t, size_t index) {
  TensorDesc d;
  d.name = t.name != nullptr ? t.name : absl::StrCat("tensor", index);
  d.param_dtype = static_cast<DType>(RawDType(t.param_dtype));
  d.grad_dtype = static_cast<DType>(RawDType(t.grad_dtype));
  d.numel = t.numel;
  d.group = t.group;
  return d;
}

GroupStepParams StepParams(const dos_hparams& h) {
  return GroupStepParams{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
}

absl::StatusOr<v1::RegisterShardRequest> BuildRegisterRequest(
    absl::Span<const dos_tensor> tensors, absl::Span<const dos_hparams> groups,
    uint64_t subgroup_size, const BufferTable& buffers, DeviceMemory* device) {
  if (tensors.empty()) {
    return absl::InvalidArgumentError("register: no tensors; pass at least one");
  }
  if (groups.empty() || groups.size() > kMaxGroups) {
    return absl::InvalidArgumentError(absl::StrCat("register: ", groups.size(),
                                                   " param groups; between 1 and ", kMaxGroups,
                                                   " are supported"));
  }
  v1::RegisterShardRequest req;
  req.set_subgroup_size(subgroup_size);
  for (size_t g = 0; g < groups.size(); ++g) {
    DOS_RETURN_IF_ERROR(ValidateGroupStepParams(StepParams(groups[g]), g, "register"));
    v1::Hyperparameters* h = req.add_groups();
    h->set_lr(groups[g].lr);
    h->set_beta1(groups[g].beta1);
    h->set_beta2(groups[g].beta2);
    h->set_eps(groups[g].eps);
    h->set_weight_decay(groups[g].weight_decay);
    h->set_decoupled_weight_decay(groups[g].decoupled_weight_decay != 0);
  }
  bool first_on_device = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const dos_tensor& t = tensors[i];
    const std::string label = absl::StrCat("register: ", TensorLabel(t, i));
    DOS_RETURN_IF_ERROR(CheckDType(RawDType(t.param_dtype), absl::StrCat(label, " param")));
    DOS_RETURN_IF_ERROR(CheckDType(RawDType(t.grad_dtype), absl::StrCat(label, " grad")));
    if (t.numel == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, " has 0 elements; leave empty tensors out"));
    }
    if (t.group >= groups.size()) {
      return absl::InvalidArgumentError(absl::StrCat(label, " names group ", t.group, " but only ",
                                                     groups.size(), " groups were passed"));
    }
    const uint64_t pbytes = t.numel * DTypeSize(static_cast<DType>(t.param_dtype));
    const uint64_t gbytes = t.numel * DTypeSize(static_cast<DType>(t.grad_dtype));
    v1::TensorSpec* spec = req.add_tensors();
    bool param_dev = false, grad_dev = false;
    DOS_RETURN_IF_ERROR(Locate(t.param, pbytes, absl::StrCat(label, " param"), buffers, device,
                               spec->mutable_param(), &param_dev));
    DOS_RETURN_IF_ERROR(Locate(t.grad, gbytes, absl::StrCat(label, " grad"), buffers, device,
                               spec->mutable_grad(), &grad_dev));
    if (param_dev != grad_dev || (i > 0 && param_dev != first_on_device)) {
      return absl::InvalidArgumentError(absl::StrCat(
          label, param_dev != grad_dev ? " has its param and grad in different kinds of memory"
                                       : " is in a different kind of memory than tensor 0",
          " (CUDA device memory vs. dos_buffer_alloc shared memory); register either every "
          "tensor on the GPU or every tensor in shared memory"));
    }
    if (i == 0) first_on_device = param_dev;
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.param);
    const uintptr_t q = reinterpret_cast<uintptr_t>(t.grad);
    if (p < q + gbytes && q < p + pbytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(label, " param and grad memory overlap; give them separate ranges"));
    }
    const TensorDesc d = DescribeTensor(t, i);
    spec->set_name(d.name);
    spec->set_param_dtype(static_cast<v1::DType>(d.param_dtype));
    spec->set_grad_dtype(static_cast<v1::DType>(d.grad_dtype));
    spec->set_numel(d.numel);
    spec->set_group(d.group);
  }
  return req;
}

static_assert(DOS_MAX_SKIP_TENSORS == kMaxSkipTensors, "dos.h and the wire format agree");

absl::Status FillStepRequest(const dos_step_args& args, size_t registered_groups,
                             size_t registered_tensors, StepRequest* out) {
  if (args.num_groups != registered_groups) {
    return absl::InvalidArgumentError(absl::StrCat("step: ", args.num_groups,
                                                   " groups passed, but ", registered_groups,
                                                   " were registered; pass one per group"));
  }
  if (args.groups == nullptr) {
    return absl::InvalidArgumentError("step: groups is NULL");
  }
  if (!std::isfinite(args.grad_scale) || args.grad_scale <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: grad_scale = ", args.grad_scale, "; it must be finite and > 0"));
  }
  if (!std::isfinite(args.clip_coef) || args.clip_coef < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("step: clip_coef = ", args.clip_coef, "; it must be finite and >= 0"));
  }
  for (size_t g = 0; g < args.num_groups; ++g) {
    const dos_hparams& h = args.groups[g];
    out->groups[g] = StepParams(h);
    DOS_RETURN_IF_ERROR(ValidateGroupStepParams(out->groups[g], g, "step"));
  }
  out->flags = args.gradients_checked ? kStepGradientsChecked : 0u;
  DOS_RETURN_IF_ERROR(FillSkipMask(args, registered_tensors, out));
  out->num_groups = static_cast<uint32_t>(args.num_groups);
  out->gradient_coef = 1.0f;
  out->grad_scale = args.grad_scale;
  out->clip_coef = args.clip_coef;
  return absl::OkStatus();
}

absl::Status FillSkipMask(const dos_step_args& args, size_t registered_tensors,
                          StepRequest* out) {
  std::memset(out->skip, 0, sizeof(out->skip));
  if (args.num_skip_tensors != 0 && args.skip_tensors == nullptr) {
    return absl::InvalidArgumentError("step: skip_tensors is NULL but num_skip_tensors > 0");
  }
  for (size_t k = 0; k < args.num_skip_tensors; ++k) {
    const uint32_t i = args.skip_tensors[k];
    if (i >= registered_tensors || i >= kMaxSkipTensors) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step: skip_tensors[", k, "] = ", i, " but ", registered_tensors,
          " tensors are registered and only the first ", kMaxSkipTensors,
          " can be skipped; give a parameter without a gradient a zero gradient instead"));
    }
    out->skip[i / 64] |= uint64_t{1} << (i % 64);
    out->flags |= kStepSkipTensors;
  }
  return absl::OkStatus();
}

}  // namespace dos::client
