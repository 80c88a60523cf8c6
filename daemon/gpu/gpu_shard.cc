// GpuEngine's per-shard part: page-locking a shard's host state, and the
// resident copies the plan asks for (kept between steps, synchronised back
// before the state is read, dropped after it was replaced).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/gpu/gpu_step.h"

namespace dos::gpu {

GpuEngine::Shard::~Shard() {
  if (cudaSetDevice(device_) != cudaSuccess) return;
  for (void* p : registered) {
    absl::Status st = DOS_CUDA_STATUS(cudaHostUnregister(p));
    if (!st.ok()) DOS_LOG_WARNING("gpu.unregister_failed", "error", st.message());
  }
  for (size_t i = 0; i < resident.size(); ++i) FreeResident(i);
}

void GpuEngine::Shard::FreeResident(size_t i) {
  if (resident[i] == nullptr) return;
  absl::Status st = DOS_CUDA_STATUS(cudaFree(resident[i]));
  if (!st.ok()) DOS_LOG_WARNING("gpu.free_failed", "error", st.message());
  resident[i] = nullptr;
  resident_bytes_->fetch_sub(resident_size[i]);
}

absl::Status GpuEngine::AttachShard(ShardState& shard) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  auto gs = std::make_unique<Shard>(options_.device, &resident_bytes_);
  const absl::Time start = absl::Now();
  uint64_t bytes = 0;
  for (const Subgroup& g : shard.subgroups()) {
    const uint64_t alloc = ShardState::AllocationBytes(g.numel);
    absl::Status st = DOS_CUDA_STATUS(cudaHostRegister(g.master, alloc, cudaHostRegisterDefault));
    if (!st.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "register: cannot page-lock ", FormatBytes(alloc), " of optimizer state for "
          "the GPU path after ", FormatBytes(bytes), " (check `ulimit -l` / LimitMEMLOCK): ",
          st.message()));
    }
    gs->registered.push_back(g.master);
    bytes += alloc;
  }
  gs->resident.assign(shard.subgroups().size(), nullptr);
  gs->resident_size.assign(shard.subgroups().size(), 0);
  DOS_LOG_INFO("gpu.pin", "bytes", bytes, "subgroups", shard.subgroups().size(), "seconds",
               absl::ToDoubleSeconds(absl::Now() - start));
  shard.set_attachment(std::move(gs));
  return absl::OkStatus();
}

absl::Status GpuEngine::SetResident(ShardState& shard, uint32_t count) {
  auto* gs = static_cast<Shard*>(shard.attachment());
  std::span<Subgroup> sgs = shard.subgroups();
  count = std::min<uint32_t>(count, sgs.size());
  for (size_t i = count; i < sgs.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    shard.BeforeWrite(static_cast<uint32_t>(i));  // checkpoint copy-on-write
    DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(sgs[i].master, gs->resident[i], StateBytes(sgs[i]),
                                        cudaMemcpyDeviceToHost));
    gs->FreeResident(i);
  }
  for (size_t i = 0; i < count; ++i) {
    if (gs->resident[i] != nullptr) continue;
    float* p = nullptr;
    absl::Status st = DOS_CUDA_STATUS(cudaMalloc(&p, StateBytes(sgs[i])));
    if (!st.ok()) {
      gs->resident_count = static_cast<uint32_t>(i);
      return absl::ResourceExhaustedError(absl::StrCat(
          "gpu: cannot keep subgroup ", i, " (", FormatBytes(StateBytes(sgs[i])),
          ") resident on the GPU; lower the static fraction or the GPU memory budget: ",
          st.message()));
    }
    gs->resident[i] = p;
    gs->resident_size[i] = StateBytes(sgs[i]);
    resident_bytes_.fetch_add(StateBytes(sgs[i]));
    DOS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(p, sgs[i].master, StateBytes(sgs[i]), cudaMemcpyHostToDevice));
  }
  gs->resident_count = count;
  return absl::OkStatus();
}

absl::Status GpuEngine::SyncResidentToHost(ShardState& shard) {
  absl::MutexLock lock(&step_mu_);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::OkStatus();
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  for (size_t i = 0; i < gs->resident.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(shard.subgroups()[i].master, gs->resident[i],
                                        gs->resident_size[i], cudaMemcpyDeviceToHost));
  }
  return absl::OkStatus();
}

void GpuEngine::DropResident(ShardState& shard) {
  absl::MutexLock lock(&step_mu_);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return;
  if (cudaSetDevice(options_.device) != cudaSuccess) return;
  for (size_t i = 0; i < gs->resident.size(); ++i) gs->FreeResident(i);
  gs->resident_count = 0;
}

}  // namespace dos::gpu
