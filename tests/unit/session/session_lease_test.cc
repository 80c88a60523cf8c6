// A session's GPU lease through its control block (issue 14), on the fake GPU
// engine: the lease bell rings for every step, after a lowered lease was
// given back; the tier follows the lease up and down while the results stay
// bitwise those of the all-host run (checked on the weights every step and on
// the whole state after the session gives it up, which brings resident state
// home); growth stops where the device is full; several sessions each hold
// their own lease.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "tests/unit/session/session_fixture.h"

namespace dos {
namespace {

constexpr uint64_t kSgBytes = 1000 * 12;      // a subgroup's state (the fixture's size)
constexpr uint64_t kStaging = 2 * kSgBytes;   // the engine's staging slots (2, the default)

GpuLease Lease(uint64_t resident_subgroups) {
  return GpuLease{.reported = true,
                  .lease_bytes = kStaging + resident_subgroups * kSgBytes,
                  .budget_bytes = 80,
                  .peak_bytes = 20};
}

PlannerOptions NoCap() { return PlannerOptions{}; }

class SessionLeaseTest : public SessionFixture {
 protected:
  SessionLeaseTest() : SessionFixture(NoCap()) {}
};

class FullDeviceTest : public SessionFixture {
 protected:
  FullDeviceTest()
      : SessionFixture(NoCap(), FakeEngine::Options{.gpu = true, .device_bytes = 2 * kSgBytes}) {}
};

std::vector<float> StateOf(ShardState& shard) {
  std::vector<float> all;
  for (uint32_t t = 0; t < shard.tensors().size(); ++t) {
    for (int which = 0; which < 3; ++which) {
      std::vector<float> v(shard.tensors()[t].numel);
      shard.ReadTensor(t, which, v.data());
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  return all;
}

TEST_F(SessionLeaseTest, WithoutALeaseNothingIsResidentAndTheBellStillRings) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  EXPECT_EQ(Step(*s).status_code, 0);  // Step waits for the lease bell too
  EXPECT_EQ(gpu_.plans().back().resident, 0u);
  EXPECT_EQ(s->stats().last.gpu_lease_bytes, 0u);
}

TEST_F(SessionLeaseTest, TheTierFollowsTheLeaseAndTheResultsStayExact) {
  auto host = NewSession("auto");
  ASSERT_TRUE(host->Register(HostSpec(*host)).ok());
  auto dev = NewSession("auto");
  ASSERT_TRUE(dev->Register(DeviceSpec()).ok());
  const uint64_t leases[] = {2, 4, 4, 1, 0, 3, 2};
  for (uint64_t n : leases) {
    const GpuLease lease = Lease(n);
    StepResult r = Step(*dev, 1e-8, 0, &lease);
    ASSERT_EQ(r.status_code, 0) << r.message;
    EXPECT_EQ(gpu_.plans().back().resident, n);
    EXPECT_EQ(gpu_.resident_bytes(), n * 1000 * 12 - (n == 4 ? 200 * 12 : 0));
    ASSERT_EQ(Step(*host).status_code, 0);
    EXPECT_EQ(std::memcmp(shm_->data(), params_.data(), 4 * kTotal), 0);
    const SessionStatsSnapshot st = dev->stats();
    EXPECT_EQ(st.last.gpu_lease_bytes, lease.lease_bytes);
    EXPECT_EQ(st.last.trainer_gpu_budget_bytes, 80u);
    EXPECT_EQ(st.last.trainer_gpu_peak_bytes, 20u);
  }
  EXPECT_GT(gpu_.resident_bytes(), 0u);
  // Giving the state up brings resident subgroups home (the fake poisons
  // their host copies meanwhile) and frees the "device".
  dev->Stop();
  host->Stop();
  std::unique_ptr<ShardState> a = dev->TakeShard();
  std::unique_ptr<ShardState> b = host->TakeShard();
  EXPECT_EQ(gpu_.resident_bytes(), 0u);
  EXPECT_EQ(StateOf(*a), StateOf(*b));
}

TEST_F(SessionLeaseTest, ALowerLeaseIsGivenBackBeforeTheBellRings) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  const GpuLease big = Lease(3);
  ASSERT_EQ(Step(*s, 1e-8, 0, &big).status_code, 0);
  EXPECT_EQ(gpu_.resident_bytes(), 3 * kSgBytes);
  // The client's side of a lowered lease: publish, wait for the lease bell
  // only, and find the memory already given back (the step may still run).
  std::unique_ptr<ShmSegment> seg =
      *ShmSegment::Adopt(UniqueFd(fcntl(s->control_fd(), F_DUPFD_CLOEXEC, 0)), "control block");
  auto* block = static_cast<ControlBlock*>(seg->data());
  ControlBlockChannel channel(block);
  block->request.flags = kStepGpuLease;
  block->request.gpu_lease_bytes = Lease(1).lease_bytes;
  const uint32_t seq = channel.PublishRequest();
  ASSERT_TRUE(channel.WaitLeaseApplied(seq, absl::Seconds(30)).ok());
  EXPECT_LE(gpu_.resident_bytes(), kSgBytes);
  ASSERT_TRUE(channel.WaitResult(seq, absl::Seconds(30)).ok());
  EXPECT_EQ(block->result.status_code, 0) << block->result.message;
  EXPECT_EQ(gpu_.resident_bytes(), kSgBytes);
}

TEST_F(SessionLeaseTest, StateExportAndImportSeeResidentState) {
  auto host = NewSession("auto");
  ASSERT_TRUE(host->Register(HostSpec(*host)).ok());
  auto dev = NewSession("auto");
  ASSERT_TRUE(dev->Register(DeviceSpec()).ok());
  const GpuLease lease = Lease(4);
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(Step(*dev, 1e-8, 0, &lease).status_code, 0);
    ASSERT_EQ(Step(*host).status_code, 0);
  }
  // Export through a sealed memfd buffer, as the client does.
  auto Export = [](Session& s, uint32_t tensor, uint64_t offset, uint64_t count) {
    std::unique_ptr<ShmSegment> buf = *ShmSegment::Create("export", 12 * count);
    std::vector<std::unique_ptr<ShmSegment>> segs;
    segs.push_back(*ShmSegment::Adopt(UniqueFd(fcntl(buf->fd(), F_DUPFD_CLOEXEC, 0)), "buf"));
    const uint64_t id = (*s.inbox()->AddAll(std::move(segs)))[0];
    EXPECT_TRUE(s.ExportState(tensor, offset, count, SegmentRef(id, 0)).ok());
    const float* p = static_cast<const float*>(buf->data());
    return std::vector<float>(p, p + 3 * count);
  };
  // A ranged import into part of a resident subgroup (whose host copy is
  // stale) keeps the rest of it.
  auto Import = [](Session& s, uint32_t tensor, uint64_t offset, std::vector<float> v) {
    std::unique_ptr<ShmSegment> buf = *ShmSegment::Create("import", 4 * v.size());
    std::memcpy(buf->data(), v.data(), 4 * v.size());
    std::vector<std::unique_ptr<ShmSegment>> segs;
    segs.push_back(*ShmSegment::Adopt(UniqueFd(fcntl(buf->fd(), F_DUPFD_CLOEXEC, 0)), "buf"));
    const uint64_t id = (*s.inbox()->AddAll(std::move(segs)))[0];
    EXPECT_TRUE(s.ImportState(tensor, offset, v.size() / 3, SegmentRef(id, 0), 3).ok());
  };
  const std::vector<float> piece(3 * 10, 0.125f);
  Import(*dev, 0, 100, piece);
  Import(*host, 0, 100, piece);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(Step(*dev, 1e-8, 0, &lease).status_code, 0);
    ASSERT_EQ(Step(*host).status_code, 0);
  }
  EXPECT_EQ(Export(*dev, 1, 0, kNumel[1]), Export(*host, 1, 0, kNumel[1]));
  EXPECT_EQ(Export(*dev, 0, 0, kNumel[0]), Export(*host, 0, 0, kNumel[0]));
}

// A state transfer refused (bad range, bad step, too small a buffer) gives
// its buffer segment back at once: unmapped, and its uid's charge with it.
TEST_F(SessionLeaseTest, ARefusedStateTransferGivesItsBufferBack) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(HostSpec(*s)).ok());
  ASSERT_EQ(Step(*s).status_code, 0);
  int unmapped = 0;
  auto Send = [&](uint64_t bytes) {
    std::unique_ptr<ShmSegment> buf = *ShmSegment::Create("transfer", bytes);
    std::vector<std::unique_ptr<ShmSegment>> segs;
    segs.push_back(*ShmSegment::Adopt(UniqueFd(fcntl(buf->fd(), F_DUPFD_CLOEXEC, 0)), "buf"));
    segs.back()->SetOnUnmap([&unmapped] { ++unmapped; });
    return (*s->inbox()->AddAll(std::move(segs)))[0];
  };
  const uint64_t n = kNumel[0];
  EXPECT_EQ(s->ExportState(0, n, 1, SegmentRef(Send(12), 0)).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(s->ExportState(9, 0, 1, SegmentRef(Send(12), 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s->ImportState(0, 0, 4, SegmentRef(Send(12), 0), 1).code(),
            absl::StatusCode::kInvalidArgument);  // 4 elements need 48 bytes
  EXPECT_EQ(s->ImportState(0, 0, 1, SegmentRef(Send(12), 0), -1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unmapped, 4);
  EXPECT_EQ(s->inbox()->pending(), 0u);
  // And one that succeeds too, once the call returns.
  EXPECT_TRUE(s->ExportState(0, 0, 1, SegmentRef(Send(12), 0)).ok());
  EXPECT_EQ(unmapped, 5);
  EXPECT_EQ(s->inbox()->pending(), 0u);
}

TEST_F(FullDeviceTest, GrowthStopsWhereTheDeviceIsFull) {
  auto s = NewSession("auto");
  ASSERT_TRUE(s->Register(DeviceSpec()).ok());
  const GpuLease lease = Lease(4);
  StepResult r = Step(*s, 1e-8, 0, &lease);
  ASSERT_EQ(r.status_code, 0) << r.message;
  EXPECT_EQ(gpu_.plans().back().resident, 2u);
}

TEST_F(SessionLeaseTest, SeveralSessionsOnOneGpuEachHoldTheirOwnLease) {
  // Both update the same lent memory: only their plans matter here.
  auto a = NewSession("auto");
  auto b = NewSession("auto");
  ASSERT_TRUE(a->Register(DeviceSpec()).ok());
  ASSERT_TRUE(b->Register(DeviceSpec()).ok());
  const GpuLease la = Lease(1), lb = Lease(3);
  ASSERT_EQ(Step(*a, 1e-8, 0, &la).status_code, 0);
  EXPECT_EQ(gpu_.plans().back().resident, 1u);
  ASSERT_EQ(Step(*b, 1e-8, 0, &lb).status_code, 0);
  EXPECT_EQ(gpu_.plans().back().resident, 3u);
  EXPECT_EQ(gpu_.resident_bytes(), 4 * kSgBytes);
  ASSERT_EQ(Step(*a).status_code, 0);  // no flag: a keeps its lease
  EXPECT_EQ(gpu_.plans().back().resident, 1u);
  a->Stop();
  EXPECT_EQ(b->stats().last.resident_budget_bytes, 3 * kSgBytes);
}

}  // namespace
}  // namespace dos
