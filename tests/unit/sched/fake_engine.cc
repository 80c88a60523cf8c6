#include "tests/unit/sched/fake_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "daemon/cpu/delayed_update.h"
#include "daemon/cpu/subgroup_spans.h"
#include "daemon/transport/shm_transport.h"

namespace dos {
namespace {

// Shared memory as the host transport maps it; lent "device" memory from the
// engine; either fails when the engine says so.
class FakeTransport final : public Transport {
 public:
  explicit FakeTransport(FakeEngine* engine) : engine_(engine) {}
  absl::StatusOr<void*> Map(const MemoryRef& ref, uint64_t bytes,
                            absl::string_view what) override {
    if (absl::Status st = engine_->map_fault(); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    }
    if (ref.is_cuda_ipc()) return engine_->Resolve(ref, bytes, what);
    return shm_.Map(ref, bytes, what);
  }

 private:
  FakeEngine* const engine_;
  ShmTransport shm_;
};

int event_token = 0;  // the address is the fake event

}  // namespace

class FakeEngine::Resident final : public ShardAttachment {
 public:
  explicit Resident(std::atomic<uint64_t>* total) : total_(total) {}
  ~Resident() override {
    for (size_t i = 0; i < copies.size(); ++i) Free(i);
  }
  void Free(size_t i) {
    total_->fetch_sub(copies[i].size() * sizeof(float));
    copies[i] = {};
  }
  std::vector<std::vector<float>> copies;  // per subgroup; empty: not resident

 private:
  std::atomic<uint64_t>* total_;
};

FakeEngine::Resident* FakeEngine::ResidentOf(ShardState& shard) {
  if (shard.attachment() == nullptr) {
    auto r = std::make_unique<Resident>(&resident_bytes_);
    r->copies.resize(shard.subgroups().size());
    shard.set_attachment(std::move(r));
  }
  return static_cast<Resident*>(shard.attachment());
}

uint64_t FakeEngine::resident_bytes() const { return resident_bytes_.load(); }

absl::StatusOr<uint32_t> FakeEngine::SetResident(ShardState& shard, uint32_t count, bool grow) {
  if (!options_.gpu) return 0u;
  Resident* r = ResidentOf(shard);
  std::span<Subgroup> sgs = shard.subgroups();
  count = std::min<uint32_t>(count, sgs.size());
  for (size_t i = count; i < sgs.size(); ++i) {
    if (r->copies[i].empty()) continue;
    shard.BeforeWrite(static_cast<uint32_t>(i));
    std::memcpy(sgs[i].master, r->copies[i].data(), r->copies[i].size() * sizeof(float));
    r->Free(i);
  }
  if (grow) {
    for (size_t i = 0; i < count; ++i) {
      if (!r->copies[i].empty()) continue;
      const uint64_t floats = sgs[i].state_bytes() / sizeof(float);  // 12 or 8 bytes a param
      if (options_.device_bytes != 0 &&
          resident_bytes_.load() + floats * sizeof(float) > options_.device_bytes) {
        break;  // the "device" is full: growth stops here
      }
      r->copies[i].assign(sgs[i].master, sgs[i].master + floats);
      resident_bytes_.fetch_add(floats * sizeof(float));
      shard.BeforeWrite(static_cast<uint32_t>(i));
      std::fill(sgs[i].master, sgs[i].master + floats, std::nanf(""));
    }
  }
  uint32_t held = 0;
  while (held < sgs.size() && !r->copies[held].empty()) ++held;
  return std::min(held, count);
}

absl::Status FakeEngine::SyncResidentToHost(ShardState& shard) {
  if (shard.attachment() == nullptr) return absl::OkStatus();
  Resident* r = ResidentOf(shard);
  for (size_t i = 0; i < r->copies.size(); ++i) {
    if (r->copies[i].empty()) continue;
    std::memcpy(shard.subgroups()[i].master, r->copies[i].data(),
                r->copies[i].size() * sizeof(float));
  }
  return absl::OkStatus();
}

void FakeEngine::DropResident(ShardState& shard) {
  if (shard.attachment() == nullptr) return;
  Resident* r = ResidentOf(shard);
  for (size_t i = 0; i < r->copies.size(); ++i) r->Free(i);
}

FakeEngine::FakeEngine(Options options)
    : options_(options), cpu_(cpu::CpuUpdaterOptions{.threads = 1}) {}

void FakeEngine::LendDeviceMemory(const std::string& handle, void* base, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  device_memory_[handle] = {static_cast<char*>(base), bytes};
}

void FakeEngine::FailExecuteAfter(uint32_t subgroups, absl::Status status) {
  absl::MutexLock lock(&mu_);
  fail_execute_after_ = status.ok() ? std::nullopt : std::optional<uint32_t>(subgroups);
  execute_fault_ = std::move(status);
}
void FakeEngine::FailAllFinite(absl::Status status) {
  absl::MutexLock lock(&mu_);
  all_finite_fault_ = std::move(status);
}
void FakeEngine::FailAttach(absl::Status status) {
  absl::MutexLock lock(&mu_);
  attach_fault_ = std::move(status);
}
void FakeEngine::FailMap(absl::Status status) {
  absl::MutexLock lock(&mu_);
  map_fault_ = std::move(status);
}
void FakeEngine::FailOpenEvent(absl::Status status) {
  absl::MutexLock lock(&mu_);
  event_fault_ = std::move(status);
}
absl::Status FakeEngine::map_fault() const {
  absl::MutexLock lock(&mu_);
  return map_fault_;
}

std::vector<StepPlan> FakeEngine::plans() const {
  absl::MutexLock lock(&mu_);
  return plans_;
}
int FakeEngine::attached() const {
  absl::MutexLock lock(&mu_);
  return attached_;
}
int FakeEngine::open_events() const {
  absl::MutexLock lock(&mu_);
  return open_events_;
}
std::string FakeEngine::waits() const {
  absl::MutexLock lock(&mu_);
  return waits_;
}
std::vector<uint32_t> FakeEngine::awaited_captures() const {
  absl::MutexLock lock(&mu_);
  return awaited_;
}

std::vector<uint32_t> FakeEngine::done_subgroups() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

std::unique_ptr<Transport> FakeEngine::NewTransport() {
  return std::make_unique<FakeTransport>(this);
}

absl::StatusOr<void*> FakeEngine::Resolve(const MemoryRef& ref, uint64_t bytes,
                                          absl::string_view what) {
  absl::MutexLock lock(&mu_);
  auto it = device_memory_.find(ref.cuda_ipc_handle);
  if (it == device_memory_.end() || ref.offset + bytes > it->second.second) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": no lent device memory holds ", bytes, " bytes at ", ref.offset));
  }
  return static_cast<void*>(it->second.first + ref.offset);
}

absl::Status FakeEngine::AttachShard(ShardState&, RegisterProgress*) {
  absl::MutexLock lock(&mu_);
  if (!attach_fault_.ok()) return attach_fault_;
  ++attached_;
  return absl::OkStatus();
}

absl::StatusOr<void*> FakeEngine::OpenTrainerEvent(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  if (!options_.gpu) return absl::InvalidArgumentError("fake host engine: no events");
  if (!event_fault_.ok()) return event_fault_;
  if (handle.empty()) return absl::InvalidArgumentError("empty event handle");
  ++open_events_;
  return static_cast<void*>(&event_token);
}

void FakeEngine::CloseTrainerEvent(void* event) {
  absl::MutexLock lock(&mu_);
  if (event == &event_token) --open_events_;
}

absl::Status FakeEngine::WaitTrainerEvent(void* event) {
  if (event != &event_token) return absl::InvalidArgumentError("not a fake event");
  absl::MutexLock lock(&mu_);
  waits_ += 'w';
  return absl::OkStatus();
}

absl::Status FakeEngine::SyncTrainerEvent(void* event) {
  if (event != &event_token) return absl::InvalidArgumentError("not a fake event");
  absl::MutexLock lock(&mu_);
  waits_ += 'e';
  return absl::OkStatus();
}

absl::Status FakeEngine::CopyToHost(void* dst, const void* trainer_src, uint64_t bytes) {
  std::memcpy(dst, trainer_src, bytes);
  return absl::OkStatus();
}

absl::Status FakeEngine::CopyToTrainer(void* trainer_dst, const void* src, uint64_t bytes) {
  std::memcpy(trainer_dst, src, bytes);
  return absl::OkStatus();
}

absl::StatusOr<bool> FakeEngine::AllFinite(const ShardState& shard,
                                           std::span<const TensorBinding> bindings) {
  {
    absl::MutexLock lock(&mu_);
    if (!all_finite_fault_.ok()) return all_finite_fault_;
  }
  {
    absl::MutexLock lock(&mu_);
    waits_ += 's';
  }
  std::vector<cpu::CpuUpdater::GradRun> runs;
  for (size_t t = 0; t < shard.tensors().size(); ++t) {
    runs.push_back({bindings[t].grad, shard.tensors()[t].grad_dtype, shard.tensors()[t].numel});
  }
  return cpu_.AllFinite(runs);
}

std::vector<std::pair<uint32_t, char>> FakeEngine::Order(const StepPlan& plan) {
  std::vector<std::pair<uint32_t, char>> order;
  auto resident = [&] {
    for (uint32_t i : plan.resident_order) order.emplace_back(i, 'r');
  };
  if (plan.resident_first) resident();
  for (uint32_t i : plan.gpu_only) order.emplace_back(i, 'g');
  // Shared subgroups: alternately from the front (GPU) and the back (CPU),
  // as the two sides claim them.
  size_t front = 0, back = plan.shared.size();
  for (bool gpu = true; front < back; gpu = !gpu) {
    order.emplace_back(gpu ? plan.shared[front++] : plan.shared[--back], gpu ? 'g' : 'c');
  }
  for (uint32_t i : plan.cpu_only) order.emplace_back(i, 'c');
  if (!plan.resident_first) resident();
  return order;
}

void FakeEngine::Measure(uint32_t sg, char path, uint64_t numel, StepMeasurements* m) const {
  const double n = static_cast<double>(numel);
  TimelineEntry e{.subgroup = sg, .path = path};
  if (path == 'c') {
    m->cpu_params += numel;
    m->cpu_kernel_us += n / options_.cpu_params_per_s * 1e6;
    m->cpu_loop_us += n / options_.cpu_params_per_s * 1e6;
  } else {
    m->gpu_params += numel;
    m->gpu_kernel_us += n / options_.gpu_params_per_s * 1e6;
  }
  if (path == 'g') {
    m->streamed_params += numel;
    m->gpu_h2d_bytes += 12 * numel;
    m->gpu_d2h_bytes += 12 * numel;
    m->h2d_us += 12 * n / options_.copy_bytes_per_s * 1e6;
    m->d2h_us += 12 * n / options_.copy_bytes_per_s * 1e6;
    m->gpu_loop_us += 12 * n / options_.copy_bytes_per_s * 1e6;
  }
  m->entries.push_back(e);
}

absl::Status FakeEngine::Execute(const StepPlan& plan, ShardState& shard,
                                 std::span<const TensorBinding> bindings,
                                 std::span<const cpu::AdamScalars> scalars, const StepSync& sync,
                                 StepMeasurements* measured) {
  std::optional<uint32_t> fail_after;
  absl::Status fault;
  {
    absl::MutexLock lock(&mu_);
    plans_.push_back(plan);
    done_.clear();
    fail_after = fail_execute_after_;
    fault = execute_fault_;
  }
  absl::StatusOr<uint32_t> held = SetResident(shard, plan.resident, true);
  if (!held.ok()) return held.status();
  if (*held != plan.resident) {
    return absl::ResourceExhaustedError(absl::StrCat("fake: the plan keeps ", plan.resident,
                                                     " subgroups resident, the device holds ",
                                                     *held));
  }
  if (plan.resident_order.size() != plan.resident) {
    return absl::InternalError(absl::StrCat("fake: the plan orders ", plan.resident_order.size(),
                                            " of its ", plan.resident, " resident subgroups"));
  }
  uint32_t updated = 0;
  for (auto [sg, path] : Order(plan)) {
    if (fail_after && updated == *fail_after) return fault;
    // The readiness contract (engine.h): a subgroup's gradients are read
    // only once they are final, and a failed wait ends the step.
    if (plan.wait_ready) {
      if (!sync.wait_ready) return absl::InternalError("fake: a plan waits but wait_ready is unset");
      if (absl::Status ready = sync.wait_ready(sg); !ready.ok()) return ready;
    }
    const Subgroup& g = shard.subgroups()[sg];
    float* state = path == 'r' ? ResidentOf(shard)->copies[sg].data() : g.master;
    std::vector<cpu::CpuUpdater::Item> items;
    absl::Status st = cpu::ForEachSegmentSpan(
        shard.tensors(), g, state,
        [&](const SubgroupSegment& seg, const TensorDesc& t) {
          return cpu::TrainerIo(t, seg, bindings[seg.tensor].grad, bindings[seg.tensor].param);
        },
        [&](const SubgroupSegment& seg, const cpu::AdamSpan& span) {
          items.push_back({scalars[seg.tensor], span});
          return absl::OkStatus();
        });
    if (!st.ok()) return st;
    shard.BeforeWrite(sg);
    cpu_.Run(items);
    Measure(sg, path, g.numel, measured);
    if (sync.subgroup_done) sync.subgroup_done(sg);
    {
      absl::MutexLock lock(&mu_);
      done_.push_back(sg);
    }
    ++updated;
  }
  if (!plan.delayed.empty()) {
    if (sync.delayed == nullptr) return absl::InternalError("fake: a delayed plan without buffers");
    if (plan.wait_ready) return absl::InternalError("fake: a delayed plan that waits per subgroup");
    absl::Status st =
        options_.pipelined_captures
            ? PipelinedCaptures(plan, shard, bindings, sync)
            : cpu::CopyDelayedHost(shard, bindings, *sync.delayed, plan.delayed, true);
    if (!st.ok()) return st;
    if (options_.slow_update_ms > 0 && !options_.pipelined_captures) {
      sync.delayed->await_capture = [ms = options_.slow_update_ms](uint32_t) {
        absl::SleepFor(absl::Milliseconds(ms));
        return absl::OkStatus();
      };
    }
    if (sync.delayed_captured && !options_.pipelined_captures) sync.delayed_captured();
    for (uint32_t sg : plan.delayed) {
      measured->entries.push_back(TimelineEntry{.subgroup = sg, .path = 'd'});
      if (sync.subgroup_done) sync.subgroup_done(sg);
      absl::MutexLock lock(&mu_);
      done_.push_back(sg);
    }
  }
  measured->wall_us = measured->cpu_loop_us + measured->gpu_loop_us;
  return absl::OkStatus();
}

absl::StatusOr<HostBuffer> FakeEngine::AllocStaging(uint64_t bytes) {
  return HostBuffer(new char[bytes], [](char* p) { delete[] p; });
}

absl::Status FakeEngine::InstallDelayed(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        const DelayedHost& delayed,
                                        std::span<const uint32_t> subgroups) {
  return cpu::CopyDelayedHost(shard, bindings, delayed, subgroups, false);
}

absl::Status FakeEngine::CaptureDelayed(const ShardState& shard,
                                        std::span<const TensorBinding> bindings,
                                        const DelayedHost& delayed,
                                        std::span<const uint32_t> subgroups) {
  return cpu::CopyDelayedHost(shard, bindings, delayed, subgroups, true);
}

absl::Status FakeEngine::PipelinedCaptures(const StepPlan& plan, const ShardState& shard,
                                           std::span<const TensorBinding> bindings,
                                           const StepSync& sync) {
  // One notification a subgroup: its copies are in.
  auto copied = std::make_shared<std::vector<absl::Notification>>(shard.subgroups().size());
  sync.delayed->await_capture = [this, copied](uint32_t sg) {
    {
      absl::MutexLock lock(&mu_);
      awaited_.push_back(sg);
    }
    (*copied)[sg].WaitForNotification();
    return absl::OkStatus();
  };
  if (sync.delayed_captured) sync.delayed_captured();
  absl::Status status;
  for (uint32_t sg : plan.delayed) {
    absl::SleepFor(absl::Milliseconds(1));
    if (status.ok()) {
      status = cpu::CopyDelayedHost(shard, bindings, *sync.delayed,
                                    std::span<const uint32_t>(&sg, 1), true);
    }
    (*copied)[sg].Notify();  // also after a failure: the update must not wait forever
  }
  return status;
}

absl::Status FakeEngine::UpdateDelayed(ShardState& shard, const DelayedHost& delayed,
                                       double* kernel_us) {
  return cpu::UpdateDelayed(&cpu_, shard, delayed, kernel_us);
}

}  // namespace dos
