// The fixture of the session tests: sessions over one fake GPU engine (a
// CUDA IPC "device" lent from host vectors) and the host engine, stepped
// through their control blocks as a client would.
#pragma once

#include <gtest/gtest.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/cpu/host_engine.h"
#include "daemon/sched/executor_set.h"
#include "daemon/session/session.h"
#include "dos/wire/control_channel.h"
#include "dos/wire/shm_segment.h"
#include "tests/unit/sched/fake_engine.h"

namespace dos {

inline constexpr char kUuid[] = "GPU-11111111-2222-3333-4444-555555555555";
inline constexpr uint64_t kNumel[] = {2500, 1300};  // subgroups of 1000 cross the boundary
inline constexpr uint64_t kTotal = 3800;

inline GroupStepParams Hyper(double eps = 1e-8) { return GroupStepParams{1e-2, 0.9, 0.999, eps, 0.01}; }

inline PlannerOptions OneResidentSubgroup() {
  PlannerOptions planner;
  planner.budgets.gpu_resident_bytes = 1000 * 12;  // auto keeps one subgroup resident
  return planner;
}

class SessionFixture : public testing::Test {
 protected:
  // `host_memory_limit`: budget_'s (dosd's --host_memory_limit; 0: none).
  explicit SessionFixture(PlannerOptions planner = OneResidentSubgroup(),
                          FakeEngine::Options gpu = FakeEngine::Options{.gpu = true},
                          uint64_t host_memory_limit = 0)
      : cpu_(cpu::CpuUpdaterOptions{.threads = 1}), host_engine_(&cpu_), gpu_(gpu), executors_(&host_engine_),
        budget_(host_memory_limit) {
    executors_.AddGpu({0, kUuid, "fake"}, &gpu_, planner);
    for (uint64_t i = 0; i < kTotal; ++i) {
      params_[i] = 0.25f + 1e-3f * static_cast<float>(i % 101);
      grads_[i] = 1e-2f * static_cast<float>(static_cast<int>(i % 17) - 8);
    }
    gpu_.LendDeviceMemory("params", params_.data(), 4 * kTotal);
    gpu_.LendDeviceMemory("grads", grads_.data(), 4 * kTotal);
  }

  std::unique_ptr<Session> NewSession(const char* policy, int32_t pid = getpid(),
                                      std::function<void(uint64_t)> gone = nullptr) {
    SessionIdentity id;
    id.id = ++next_id_;
    id.token = "token";
    id.pid = pid;
    SessionOptions options;
    options.default_subgroup_size = 1000;
    options.liveness_interval = absl::Milliseconds(10);
    options.early_ready_timeout = early_ready_timeout_;
    options.ledger = ledger_;
    absl::StatusOr<std::unique_ptr<Session>> s = Session::Create(
        id, options, *ParsePolicy(policy), &executors_, &budget_, std::move(gone));
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  // GPU-mode tensors in the fake engine's lent memory.
  static ShardSpec DeviceSpec(double eps = 1e-8) {
    ShardSpec spec;
    spec.groups.push_back(GroupConfig{Hyper(eps), true});
    uint64_t off = 0;
    for (uint64_t n : kNumel) {
      TensorSpec t;
      t.desc.name = absl::StrCat("t", spec.tensors.size());
      t.desc.numel = n;
      for (auto [ref, handle] : {std::pair{&t.param, "params"}, std::pair{&t.grad, "grads"}}) {
        ref->cuda_ipc_handle = handle;
        ref->offset = 4 * off;
        ref->alloc_bytes = 4 * kTotal;
        ref->device_uuid = kUuid;
      }
      spec.tensors.push_back(t);
      off += n;
    }
    return spec;
  }

  // The same tensors in shared memory (host engine): one sealed memfd, filed
  // in the session's inbox as the descriptor socket would.
  ShardSpec HostSpec(Session& s) {
    shm_ = *ShmSegment::Create(absl::StrCat("dos-session-test-", ++next_id_), 8 * kTotal);
    std::memcpy(shm_->data(), params_.data(), 4 * kTotal);
    std::memcpy(static_cast<char*>(shm_->data()) + 4 * kTotal, grads_.data(), 4 * kTotal);
    std::vector<std::unique_ptr<ShmSegment>> segs;
    segs.push_back(*ShmSegment::Adopt(UniqueFd(fcntl(shm_->fd(), F_DUPFD_CLOEXEC, 0)), "test"));
    const uint64_t id = (*s.inbox()->AddAll(std::move(segs)))[0];
    ShardSpec spec = DeviceSpec();
    uint64_t off = 0;
    for (TensorSpec& t : spec.tensors) {
      t.param = SegmentRef(id, 4 * off);
      t.grad = SegmentRef(id, 4 * (kTotal + off));
      off += t.desc.numel;
    }
    return spec;
  }

  // Rings one step through the control block and waits for its result.
  // With `lease`, the step carries it (kStepGpuLease) and the lease bell
  // must ring for it.
  static StepResult Step(Session& s, double eps = 1e-8, uint32_t flags = 0,
                         const GpuLease* lease = nullptr) {
    std::unique_ptr<ShmSegment> seg =
        *ShmSegment::Adopt(UniqueFd(fcntl(s.control_fd(), F_DUPFD_CLOEXEC, 0)), "control block");
    auto* block = static_cast<ControlBlock*>(seg->data());
    ControlBlockChannel channel(block);
    block->request.flags = flags;
    block->request.num_groups = 1;
    block->request.grad_scale = 1;
    block->request.clip_coef = 1;
    block->request.groups[0] = Hyper(eps);
    if (lease != nullptr) {
      block->request.flags |= kStepGpuLease;
      block->request.gpu_lease_bytes = lease->lease_bytes;
      block->request.gpu_budget_bytes = lease->budget_bytes;
      block->request.gpu_peak_bytes = lease->peak_bytes;
    }
    const uint32_t seq = channel.PublishRequest();
    EXPECT_TRUE(channel.WaitLeaseApplied(seq, absl::Seconds(30)).ok());
    EXPECT_TRUE(channel.WaitResult(seq, absl::Seconds(30)).ok());
    EXPECT_EQ(channel.DoneWord(kMaxTrackedSubgroups - 1)->load(), seq);  // nobody left waiting
    return block->result;
  }

  cpu::CpuUpdater cpu_;
  cpu::HostEngine host_engine_;
  FakeEngine gpu_;
  ExecutorSet executors_;
  UidLedger shared_ledger_{UidLimits{}};  // outlives budget_, which may hold its charges
  UidLedger* ledger_ = nullptr;           // new sessions' (dosd's shared one); null: each its own
  HostMemoryBudget budget_;
  std::vector<float> params_ = std::vector<float>(kTotal);
  std::vector<float> grads_ = std::vector<float>(kTotal);
  std::unique_ptr<ShmSegment> shm_;
  uint64_t next_id_ = 0;
  absl::Duration early_ready_timeout_ = absl::Minutes(10);  // SessionOptions' for new sessions
};

}  // namespace dos
