#include "daemon/state/shard_state.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "dos/wire/state_map.h"
#include "dos/wire/status_macros.h"

namespace dos {
namespace {
uint64_t RoundUpTo(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }
}  // namespace

uint64_t ShardState::AllocatedBytes(uint64_t params, uint64_t subgroup_size,
                                    StateFormat format) {
  if (subgroup_size == 0 || params == 0) return 0;
  // Each subgroup's three arrays are one page-aligned allocation (the GPU
  // path page-locks each on its own); its bookkeeping is small beside a page.
  auto pages = [format](uint64_t numel) { return AllocationBytes(numel, format); };
  const uint64_t full = params / subgroup_size;
  const uint64_t tail = params % subgroup_size;
  return full * pages(subgroup_size) + (tail > 0 ? pages(tail) : 0);
}

absl::StatusOr<std::unique_ptr<ShardState>> ShardState::Create(std::vector<TensorDesc> tensors,
                                                                std::vector<GroupConfig> groups,
                                                                uint64_t subgroup_size,
                                                                HostMemoryBudget* budget,
                                                                absl::string_view what,
                                                                const StateAllocOptions& alloc) {
  if (subgroup_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": subgroup_size must be positive"));
  }
  if (tensors.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": no tensors to register"));
  }
  std::unique_ptr<ShardState> s(new ShardState());
  uint64_t params = 0;
  for (const TensorDesc& t : tensors) params += t.numel;
  // Map alignment (see kMapAlignElems): large tensors start on a boundary of
  // the flat space, which then ends on one, so each run of theirs starts on a
  // page in every state array and the owner can map them whole.
  const bool align = subgroup_size % kMapAlignElems == 0 && params >= kMapAlignMinParams;
  uint64_t flat = 0;
  for (const TensorDesc& t : tensors) {
    if (align && t.numel >= kMapAlignMinNumel) flat = RoundUpTo(flat, kMapAlignElems);
    s->flat_offsets_.push_back(flat);
    flat += t.numel;
  }
  if (align) flat = RoundUpTo(flat, kMapAlignElems);
  s->tensors_ = std::move(tensors);
  s->groups_ = std::move(groups);
  s->total_params_ = params;
  s->flat_size_ = flat;
  s->subgroup_size_ = subgroup_size;
  s->format_ = alloc.format;
  s->budget_ = budget;
  const uint64_t allocated = AllocatedBytes(flat, subgroup_size, alloc.format);
  DOS_RETURN_IF_ERROR(budget->Reserve(allocated, what));
  s->reserved_bytes_ = allocated;

  // Cut the flat space into subgroups and record which tensor runs each
  // covers (the padding between tensors belongs to none).
  std::vector<uint64_t> slot_bytes;
  uint32_t first = 0;
  const auto num_tensors = static_cast<uint32_t>(s->tensors_.size());
  for (uint64_t begin = 0; begin < flat; begin += subgroup_size) {
    Subgroup g;
    g.format = alloc.format;
    g.flat_begin = begin;
    g.numel = std::min(subgroup_size, flat - begin);
    const uint64_t end = begin + g.numel;
    auto tensor_end = [&](uint32_t t) { return s->flat_offsets_[t] + s->tensors_[t].numel; };
    while (first < num_tensors && tensor_end(first) <= begin) ++first;
    for (uint32_t t = first; t < num_tensors && s->flat_offsets_[t] < end; ++t) {
      const uint64_t lo = std::max(begin, s->flat_offsets_[t]);
      const uint64_t hi = std::min(end, tensor_end(t));
      if (hi > lo) g.segments.push_back({t, lo - s->flat_offsets_[t], lo - begin, hi - lo});
    }
    slot_bytes.push_back(AllocationBytes(g.numel, alloc.format));
    s->subgroups_.push_back(std::move(g));
  }
  DOS_ASSIGN_OR_RETURN(s->arena_,
                       HostArena::Create(slot_bytes, {.huge_pages = alloc.huge_pages}, what));
  if (alloc.progress != nullptr) {
    alloc.progress->BeginPhase(kRegisterAllocating, s->arena_->mapped_bytes());
  }
  DOS_RETURN_IF_ERROR(s->arena_->Touch(alloc.progress));
  for (size_t i = 0; i < s->subgroups_.size(); ++i) {
    Subgroup& g = s->subgroups_[i];
    g.master = static_cast<float*>(s->arena_->slot(i));
    if (alloc.format == StateFormat::kCompact) {
      g.exp_avg_bf16 = reinterpret_cast<uint16_t*>(g.master + g.numel);
      g.exp_avg_sq_bf16 = g.exp_avg_bf16 + g.numel;
    } else {
      g.exp_avg = g.master + g.numel;
      g.exp_avg_sq = g.exp_avg + g.numel;
    }
  }
  // Value-initialised: every subgroup kReleased, no snapshot in flight.
  s->copy_state_ = std::make_unique<std::atomic<uint32_t>[]>(s->subgroups_.size());
  s->snapshot_copies_.resize(s->subgroups_.size());
  return s;
}

ShardState::~ShardState() {
  EndSnapshot();        // copies go back to their pool (a writer ends it before this)
  attachment_.reset();  // unpins / frees GPU copies while the memory still exists
  // Memory its owner was handed (state_dict()'s views) lives on while mapped:
  // it stays charged until nothing views it.
  UniqueFd lease = arena_ != nullptr ? arena_->TakeLeaseFd() : UniqueFd();
  arena_.reset();
  if (budget_ != nullptr) {
    budget_->HoldWhileViewed(std::move(lease), reserved_bytes_, std::move(views_charge_),
                             std::move(state_charge_));
  }
}

std::vector<ShardState::MasterRun> ShardState::MasterRuns(uint32_t tensor) {
  std::vector<MasterRun> runs;
  ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& seg) {
    const auto k = static_cast<uint32_t>(&g - subgroups_.data());
    const Subgroup& sg = subgroups_[k];
    void* moments = sg.format == StateFormat::kCompact
                        ? static_cast<void*>(sg.exp_avg_bf16 + seg.subgroup_offset)
                        : static_cast<void*>(sg.exp_avg + seg.subgroup_offset);
    runs.push_back({sg.master + seg.subgroup_offset, moments, seg.tensor_offset, seg.count, k});
  });
  return runs;
}

namespace {
// Copies n fp32 values of array `which` of `g`, from element `from` of the
// subgroup, into `out` (widening compact moments exactly).
void ReadArray(const Subgroup& g, int which, uint64_t from, uint64_t n, float* out) {
  if (which == 0 || g.format == StateFormat::kFp32) {
    const float* base = which == 0 ? g.master : which == 1 ? g.exp_avg : g.exp_avg_sq;
    std::memcpy(out, base + from, n * sizeof(float));
    return;
  }
  const uint16_t* base = (which == 1 ? g.exp_avg_bf16 : g.exp_avg_sq_bf16) + from;
  for (uint64_t i = 0; i < n; ++i) out[i] = BF16ToFloat(base[i]);
}

// The reverse: n fp32 values into array `which` from element `to`, compact
// moments rounded to nearest even.
void WriteArray(const Subgroup& g, int which, uint64_t to, uint64_t n, const float* in) {
  if (which == 0 || g.format == StateFormat::kFp32) {
    float* base = which == 0 ? g.master : which == 1 ? g.exp_avg : g.exp_avg_sq;
    std::memcpy(base + to, in, n * sizeof(float));
    return;
  }
  uint16_t* base = (which == 1 ? g.exp_avg_bf16 : g.exp_avg_sq_bf16) + to;
  for (uint64_t i = 0; i < n; ++i) base[i] = FloatToBF16(in[i]);
}

// The part of `seg` inside the tensor range [offset, offset + n): its first
// element within the tensor and its length (0 when they do not meet).
std::pair<uint64_t, uint64_t> Clip(const SubgroupSegment& seg, uint64_t offset, uint64_t n) {
  const uint64_t begin = std::max(seg.tensor_offset, offset);
  const uint64_t end = std::min(seg.tensor_offset + seg.count, offset + n);
  return {begin, end > begin ? end - begin : 0};
}
}  // namespace

void ShardState::ReadTensor(uint32_t tensor, int which, float* buf) const {
  ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& seg) {
    ReadArray(g, which, seg.subgroup_offset, seg.count, buf + seg.tensor_offset);
  });
}

void ShardState::WriteTensor(uint32_t tensor, int which, const float* buf) {
  ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& seg) {
    WriteArray(g, which, seg.subgroup_offset, seg.count, buf + seg.tensor_offset);
  });
}

void ShardState::ReadTensorRange(uint32_t tensor, int which, uint64_t offset, uint64_t n,
                                 float* buf) const {
  ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& seg) {
    auto [begin, count] = Clip(seg, offset, n);
    if (count == 0) return;
    ReadArray(g, which, seg.subgroup_offset + (begin - seg.tensor_offset), count,
              buf + (begin - offset));
  });
}

void ShardState::WriteTensorRange(uint32_t tensor, int which, uint64_t offset, uint64_t n,
                                  const float* buf) {
  ForEachRun(tensor, [&](const Subgroup& g, const SubgroupSegment& seg) {
    auto [begin, count] = Clip(seg, offset, n);
    if (count == 0) return;
    WriteArray(g, which, seg.subgroup_offset + (begin - seg.tensor_offset), count,
               buf + (begin - offset));
  });
}

void ShardState::BeginSnapshot(SnapshotPool* pool) {
  EndSnapshot();  // none in flight unless its writer failed to end it
  snapshot_pool_ = pool;
  snapshot_released_ = 0;
  copied_by_writers_.store(0, std::memory_order_relaxed);
  for (size_t i = 0; i < subgroups_.size(); ++i) {
    copy_state_[i].store(kPending, std::memory_order_relaxed);
  }
  // Writers of this step boundary's successors see this through the owner's
  // lock; the release pairs with BeforeWrite's acquire for any other thread.
  snapshot_active_.store(true, std::memory_order_release);
}

bool ShardState::CopyForSnapshot(uint32_t i, uint32_t* seen) {
  std::atomic<uint32_t>& st = copy_state_[i];
  const Subgroup& from = subgroups_[i];
  SnapshotPool::Buffer buf = snapshot_pool_ != nullptr ? snapshot_pool_->TryTake(from.state_bytes())
                                                       : SnapshotPool::Buffer();
  if (!buf || !st.compare_exchange_strong(*seen, kCopying, std::memory_order_acquire)) {
    return false;  // no room, or another thread took it first (buf goes back)
  }
  // [master | exp_avg | exp_avg_sq] are one allocation per subgroup.
  std::memcpy(buf.data(), from.master, from.state_bytes());
  SnapshotCopy& copy = snapshot_copies_[i];
  copy.view = Subgroup();
  copy.view.flat_begin = from.flat_begin;
  copy.view.numel = from.numel;
  copy.view.format = from.format;
  copy.view.master = static_cast<float*>(buf.data());
  if (from.format == StateFormat::kCompact) {
    copy.view.exp_avg_bf16 = reinterpret_cast<uint16_t*>(copy.view.master + from.numel);
    copy.view.exp_avg_sq_bf16 = copy.view.exp_avg_bf16 + from.numel;
  } else {
    copy.view.exp_avg = copy.view.master + from.numel;
    copy.view.exp_avg_sq = copy.view.exp_avg + from.numel;
  }
  copy.buffer = std::move(buf);
  st.store(kCopied, std::memory_order_release);  // publishes the copy
  st.notify_all();
  *seen = kCopied;
  return true;
}

void ShardState::CopyBeforeWrite(uint32_t i) {
  std::atomic<uint32_t>& st = copy_state_[i];
  uint32_t seen = st.load(std::memory_order_acquire);
  if (seen == kReleased || seen == kCopied) return;
  const auto start = std::chrono::steady_clock::now();
  while (seen != kReleased && seen != kCopied) {
    if (seen == kPending) {
      if (CopyForSnapshot(i, &seen)) {
        copied_by_writers_.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      if (seen != kPending) continue;  // another thread moved it on
    }
    // The pool is spent (pending: the writer will read it live and let it
    // go), or another thread is copying it, or the writer is reading it.
    st.wait(seen, std::memory_order_acquire);
    seen = st.load(std::memory_order_acquire);
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  write_wait_ns_.fetch_add(static_cast<uint64_t>(ns), std::memory_order_relaxed);
}

const Subgroup& ShardState::SnapshotAcquire(uint32_t i) {
  std::atomic<uint32_t>& st = copy_state_[i];
  uint32_t seen = st.load(std::memory_order_acquire);
  while (true) {
    switch (seen) {
      case kReading:
        return subgroups_[i];
      case kCopied:
        return snapshot_copies_[i].view;
      case kPending:
        if (st.compare_exchange_strong(seen, kReading, std::memory_order_acquire)) {
          st.notify_all();  // steps waiting for room now wait for the release
          return subgroups_[i];
        }
        break;
      case kCopying:
        st.wait(kCopying, std::memory_order_acquire);
        seen = st.load(std::memory_order_acquire);
        break;
      default:  // kReleased: the writer went back (a bug); steps may write it
        DOS_LOG_ERROR("checkpoint.snapshot_order", "subgroup", i, "released_below",
                      snapshot_released_);
        return subgroups_[i];
    }
  }
}

void ShardState::ReleaseForSnapshot(uint32_t i) {
  std::atomic<uint32_t>& st = copy_state_[i];
  uint32_t seen = st.load(std::memory_order_acquire);
  while (seen != kReleased) {
    if (seen == kCopying) {
      st.wait(kCopying, std::memory_order_acquire);
      seen = st.load(std::memory_order_acquire);
      continue;
    }
    // Only this thread moves a subgroup on from kCopied or kReading.
    if (seen == kCopied) snapshot_copies_[i].buffer.Reset();
    if (st.compare_exchange_strong(seen, kReleased, std::memory_order_acq_rel)) {
      st.notify_all();
      return;
    }
  }
}

void ShardState::SnapshotReleaseBelow(uint32_t end) {
  end = std::min<uint32_t>(end, static_cast<uint32_t>(subgroups_.size()));
  for (; snapshot_released_ < end; ++snapshot_released_) ReleaseForSnapshot(snapshot_released_);
}

uint32_t ShardState::EndSnapshot() {
  if (!snapshot_active_.load(std::memory_order_acquire)) return 0;
  SnapshotReleaseBelow(static_cast<uint32_t>(subgroups_.size()));
  // `snapshot_pool_` stays: a step still in CopyBeforeWrite may read it (its
  // buffer goes back when it finds the subgroup released); the next
  // BeginSnapshot sets it under the owner's lock.
  snapshot_active_.store(false, std::memory_order_release);
  return copied_by_writers_.load(std::memory_order_relaxed);
}

void ShardState::BeforeWrites(std::span<const uint32_t> subgroups) {
  if (!snapshot_active_.load(std::memory_order_acquire)) return;
  for (auto i = subgroups.rbegin(); i != subgroups.rend(); ++i) CopyBeforeWrite(*i);
}

void ShardState::BeforeWritesFrom(uint32_t from) {
  if (!snapshot_active_.load(std::memory_order_acquire)) return;
  for (auto i = static_cast<uint32_t>(subgroups_.size()); i-- > from;) CopyBeforeWrite(i);
}

double ShardState::TakeWriteWaitUs() {
  return static_cast<double>(write_wait_ns_.exchange(0, std::memory_order_relaxed)) / 1e3;
}

}  // namespace dos

namespace dos {

absl::StatusOr<ShardState::StateMemory> ShardState::ExportStateMemory() const {
  const uint64_t moment_bytes = format_ == StateFormat::kCompact ? 2 : 4;
  std::vector<statemap::StateMapTensor> tensors;
  std::vector<statemap::StateMapRun> runs;
  for (uint32_t t = 0; t < tensors_.size(); ++t) {
    statemap::StateMapTensor rec{tensors_[t].numel, tensors_[t].step, runs.size(), 0};
    ForEachRun(t, [&](const Subgroup& g, const SubgroupSegment& seg) {
      const uint64_t base = arena_->file_offset(static_cast<size_t>(&g - subgroups_.data()));
      const uint64_t o = seg.subgroup_offset;
      runs.push_back({{base + o * 4, base + g.numel * 4 + o * moment_bytes,
                       base + g.numel * (4 + moment_bytes) + o * moment_bytes},
                      seg.tensor_offset,
                      seg.count});
      ++rec.num_runs;
    });
    tensors.push_back(rec);
  }
  const statemap::StateMapHeader header{statemap::kMagic,
                                        statemap::kVersion,
                                        static_cast<uint32_t>(tensors.size()),
                                        static_cast<uint32_t>(moment_bytes),
                                        runs.size(),
                                        arena_->file_bytes()};
  std::string bytes(reinterpret_cast<const char*>(&header), sizeof header);
  bytes.append(reinterpret_cast<const char*>(tensors.data()),
               tensors.size() * sizeof(statemap::StateMapTensor));
  bytes.append(reinterpret_cast<const char*>(runs.data()),
               runs.size() * sizeof(statemap::StateMapRun));
  UniqueFd map(static_cast<int>(::memfd_create("dos-state-map", MFD_CLOEXEC | MFD_ALLOW_SEALING)));
  if (!map.valid()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("state map: memfd_create: ", std::strerror(errno)));
  }
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(map.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("state map: write: ", std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
  if (::fcntl(map.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) !=
      0) {
    return absl::InternalError(absl::StrCat("state map: seal: ", std::strerror(errno)));
  }
  DOS_ASSIGN_OR_RETURN(UniqueFd state, arena_->ReadOnlyFd());
  return StateMemory{std::move(state), std::move(map)};
}

}  // namespace dos
