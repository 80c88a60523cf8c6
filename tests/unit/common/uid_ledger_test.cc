#include "daemon/common/uid_ledger.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dos {
namespace {

using ::testing::HasSubstr;

constexpr size_t kMapped = static_cast<size_t>(UidResource::kMappedBytes);
constexpr size_t kConnections = static_cast<size_t>(UidResource::kConnections);

TEST(UidLedgerTest, ChargesPerSessionAndPerUidAndGivesBackOnDestruction) {
  UidLimits limits;
  limits.per_uid[kMapped] = 10;
  limits.per_session[kMapped] = 6;
  UidLedger ledger(limits);
  auto a = ledger.OpenAccount(1000, 1);
  auto b = ledger.OpenAccount(1000, 2);
  absl::StatusOr<LedgerCharge> a1 = a->Charge(UidResource::kMappedBytes, 5, "segment");
  ASSERT_TRUE(a1.ok()) << a1.status();
  absl::StatusOr<LedgerCharge> a2 = a->Charge(UidResource::kMappedBytes, 2, "segment");
  EXPECT_EQ(a2.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(a2.status().message(), HasSubstr("--max_mapped_bytes_per_session=6 B"));
  absl::StatusOr<LedgerCharge> b1 = b->Charge(UidResource::kMappedBytes, 6, "segment");
  EXPECT_EQ(b1.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b1.status().message(), HasSubstr("uid 1000 holds 5 B"));
  EXPECT_THAT(b1.status().message(), HasSubstr("--max_mapped_bytes_per_uid=10 B"));
  // Another uid has its own share.
  auto c = ledger.OpenAccount(1001, 3);
  EXPECT_TRUE(c->Charge(UidResource::kMappedBytes, 6, "segment").ok());
  EXPECT_EQ(ledger.Snapshot()[1000].used[kMapped], 5u);
  EXPECT_EQ(ledger.Snapshot()[1000].accounts, 2u);
  a1->Reset();
  EXPECT_EQ(a->used(UidResource::kMappedBytes), 0u);
  EXPECT_TRUE(b->Charge(UidResource::kMappedBytes, 6, "segment").ok());  // given back: fits
}

TEST(UidLedgerTest, AChargeOutlivesItsAccountAndUidsWithNothingDisappear) {
  UidLimits limits;
  limits.per_uid[kConnections] = 1;
  UidLedger ledger(limits);
  {
    absl::StatusOr<LedgerCharge> conn = ledger.Charge(7, UidResource::kConnections, 1, "socket");
    ASSERT_TRUE(conn.ok());
    EXPECT_EQ(ledger.Charge(7, UidResource::kConnections, 1, "socket").status().code(),
              absl::StatusCode::kResourceExhausted);
    LedgerCharge moved = *std::move(conn);
    EXPECT_EQ(ledger.Snapshot()[7].used[kConnections], 1u);
  }
  EXPECT_TRUE(ledger.Snapshot().empty());
  LedgerCharge kept;
  {
    auto account = ledger.OpenAccount(8, 1);
    kept = *account->Charge(UidResource::kTensors, 3, "register");
  }
  EXPECT_EQ(ledger.Snapshot()[8].used[static_cast<size_t>(UidResource::kTensors)], 3u);
  kept.Reset();
  EXPECT_TRUE(ledger.Snapshot().empty());
}

}  // namespace
}  // namespace dos
