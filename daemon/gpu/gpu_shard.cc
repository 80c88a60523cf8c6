// GpuEngine's per-shard part: page-locking a shard's host state, and the
// resident copies the plan asks for (kept between steps, synchronised back
// before the state is read, dropped after it was replaced).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

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
  for (cudaEvent_t ev : {last_end, delayed_end}) {
    if (ev != nullptr) cudaEventDestroy(ev);
  }
  for (cudaEvent_t ev : delayed_copied) cudaEventDestroy(ev);
}

void GpuEngine::Shard::FreeResident(size_t i) {
  if (resident[i] == nullptr) return;
  absl::Status st = DOS_CUDA_STATUS(cudaFree(resident[i]));
  if (!st.ok()) DOS_LOG_WARNING("gpu.free_failed", "error", st.message());
  resident[i] = nullptr;
  resident_bytes_->fetch_sub(resident_size[i]);
}

absl::Status GpuEngine::AttachShard(ShardState& shard, RegisterProgress* progress) {
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  auto gs = std::make_unique<Shard>(options_.device, &resident_bytes_);
  const absl::Time start = absl::Now();
  const HostArena& arena = shard.arena();
  // What to page-lock: each subgroup's slot, or (pin_whole) the one mapping.
  struct Range {
    void* p;
    uint64_t bytes;
  };
  std::vector<Range> ranges;
  if (options_.pin_whole) {
    // From the first slot to the end of the last (the alignment gaps between
    // slots, under 2 MiB each, are pinned too).
    const size_t last = arena.num_slots() - 1;
    char* begin = static_cast<char*>(arena.slot(0));
    ranges.push_back({begin, static_cast<uint64_t>(static_cast<char*>(arena.slot(last)) +
                                                   arena.slot_bytes(last) - begin)});
  } else {
    for (size_t i = 0; i < arena.num_slots(); ++i) {
      ranges.push_back({arena.slot(i), arena.slot_bytes(i)});
    }
  }
  uint64_t total = 0;
  for (const Range& r : ranges) total += r.bytes;
  if (progress != nullptr) progress->BeginPhase(kRegisterPinning, total);
  // Measured on nvidia-h200 (bench/register, 72 GB in 2 MiB pages, already
  // touched): 1.7-1.8 s whichever way: one call for the whole shard, one per
  // subgroup from 16 threads, or one after another (the driver serialises the
  // work); with 4 KiB pages 3.3 s. Per subgroup is the default because the
  // progress then moves. Every range is attempted; the first error is reported.
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = std::max(1, std::min<int>(options_.pin_threads > 0 ? options_.pin_threads
                                                                         : std::min(hw, 16),
                                                static_cast<int>(ranges.size())));
  std::vector<absl::Status> results(ranges.size());
  std::atomic<size_t> next{0};
  auto worker = [&] {
    if (absl::Status st = DOS_CUDA_STATUS(cudaSetDevice(options_.device)); !st.ok()) {
      for (size_t i = next.fetch_add(ranges.size()); i < ranges.size(); ++i) results[i] = st;
      return;
    }
    for (size_t i = next.fetch_add(1); i < ranges.size(); i = next.fetch_add(1)) {
      results[i] = DOS_CUDA_STATUS(
          cudaHostRegister(ranges[i].p, ranges[i].bytes, cudaHostRegisterDefault));
      if (results[i].ok() && progress != nullptr) progress->Add(ranges[i].bytes);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      pthread_setname_np(pthread_self(), absl::StrCat("dos-pin-", t).c_str());
      worker();
    });
  }
  worker();
  for (std::thread& th : pool) th.join();
  uint64_t pinned = 0;
  absl::Status first_error;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (results[i].ok()) {
      gs->registered.push_back(ranges[i].p);  // unregistered with the shard
      pinned += ranges[i].bytes;
    } else if (first_error.ok()) {
      first_error = results[i];
    }
  }
  if (!first_error.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "register: cannot page-lock ", FormatBytes(total), " of optimizer state for the GPU "
        "path (", FormatBytes(pinned), " succeeded; check `ulimit -l` / LimitMEMLOCK): ",
        first_error.message()));
  }
  gs->resident.assign(shard.subgroups().size(), nullptr);
  gs->resident_size.assign(shard.subgroups().size(), 0);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  DOS_LOG_INFO("gpu.pin", "bytes", total, "subgroups", shard.subgroups().size(), "ranges",
               ranges.size(), "threads", threads, "huge_pages", arena.huge_pages(), "seconds",
               seconds, "gb_per_s", seconds > 0 ? total / seconds * 1e-9 : 0.0);
  shard.set_attachment(std::move(gs));
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> GpuEngine::SetResident(ShardState& shard, uint32_t count, bool grow) {
  shard.BeforeWritesFrom(count);  // what a shrink writes back, off step_mu_
  absl::MutexLock lock(&step_mu_);
  if (shard.attachment() == nullptr) return 0u;
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  return ResizeResident(shard, count, grow);
}

absl::StatusOr<uint32_t> GpuEngine::ResizeResident(ShardState& shard, uint32_t count, bool grow) {
  auto* gs = static_cast<Shard*>(shard.attachment());
  std::span<Subgroup> sgs = shard.subgroups();
  count = std::min<uint32_t>(count, sgs.size());
  uint64_t freed = 0;
  for (size_t i = count; i < sgs.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    shard.BeforeWrite(static_cast<uint32_t>(i));  // checkpoint copy-on-write
    DOS_CUDA_RETURN_IF_ERROR(cudaMemcpy(sgs[i].master, gs->resident[i], StateBytes(sgs[i]),
                                        cudaMemcpyDeviceToHost));
    freed += gs->resident_size[i];
    gs->FreeResident(i);
  }
  gs->resident_count = std::min(gs->resident_count, count);
  if (freed > 0) {
    DOS_LOG_INFO("gpu.resident_shrink", "device", options_.device, "subgroups", count,
                 "freed_bytes", freed);
  }
  if (!grow) return gs->resident_count;
  uint64_t added = 0;
  for (size_t i = 0; i < count; ++i) {
    if (gs->resident[i] != nullptr) continue;
    float* p = nullptr;
    if (cudaMalloc(&p, StateBytes(sgs[i])) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear it
      DOS_LOG_WARNING("gpu.resident_grow_stopped", "device", options_.device, "subgroup", i,
                      "wanted", count, "bytes", StateBytes(sgs[i]), "reason",
                      "device memory exhausted");
      count = static_cast<uint32_t>(i);
      break;
    }
    gs->resident[i] = p;
    gs->resident_size[i] = StateBytes(sgs[i]);
    resident_bytes_.fetch_add(StateBytes(sgs[i]));
    added += StateBytes(sgs[i]);
    DOS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(p, sgs[i].master, StateBytes(sgs[i]), cudaMemcpyHostToDevice));
  }
  // Resident are the leading subgroups that hold a copy.
  uint32_t held = 0;
  while (held < sgs.size() && gs->resident[held] != nullptr) ++held;
  gs->resident_count = std::min(held, count);
  if (added > 0) {
    DOS_LOG_INFO("gpu.resident_grow", "device", options_.device, "subgroups",
                 gs->resident_count, "added_bytes", added);
  }
  return gs->resident_count;
}

absl::Status GpuEngine::SyncResidentToHost(ShardState& shard) {
  if (shard.snapshot_in_progress()) {  // copy or wait for the writer off step_mu_
    std::vector<uint32_t> resident;
    {
      absl::MutexLock lock(&step_mu_);
      auto* gs = static_cast<Shard*>(shard.attachment());
      for (size_t i = 0; gs != nullptr && i < gs->resident.size(); ++i) {
        if (gs->resident[i] != nullptr) resident.push_back(static_cast<uint32_t>(i));
      }
    }
    // Callers hold the session (no step of its own changes them meanwhile).
    shard.BeforeWrites(resident);
  }
  absl::MutexLock lock(&step_mu_);
  auto* gs = static_cast<Shard*>(shard.attachment());
  if (gs == nullptr) return absl::OkStatus();
  DOS_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  for (size_t i = 0; i < gs->resident.size(); ++i) {
    if (gs->resident[i] == nullptr) continue;
    shard.BeforeWrite(static_cast<uint32_t>(i));  // checkpoint copy-on-write
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
