// Checkpoints of compact state (bf16 moments) and the conversions between
// the two state formats: compact -> compact is bitwise, compact -> fp32
// widens exactly, fp32 -> compact rounds the moments to nearest even bf16;
// fp32 checkpoints keep file version 1 (what earlier releases read).
#include <string>

#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/checkpoint/checkpoint_test_util.h"

namespace dos {
namespace {

using ::dos::testing::Fill;
using ::dos::testing::MakeShard;
using ::dos::testing::Take;
using ::dos::testing::TempDir;
using ::testing::HasSubstr;

constexpr StateFormat kFp32 = StateFormat::kFp32;
constexpr StateFormat kCompact = StateFormat::kCompact;

// Fill() then moments that bf16 cannot hold exactly (so rounding shows).
void FillOdd(ShardState* shard, uint32_t seed) {
  Fill(shard, seed);
  for (uint32_t t = 0; t < shard->tensors().size(); ++t) {
    std::vector<float> buf(shard->tensors()[t].numel);
    for (int a = 1; a < 3; ++a) {
      for (size_t i = 0; i < buf.size(); ++i) {
        buf[i] = (a == 1 ? -1.0f : 1.0f) * (1.0f + static_cast<float>(i % 977) * 1.2345e-4f) *
                 static_cast<float>(seed + t + 1) * 1e-3f;
      }
      shard->WriteTensor(t, a, buf.data());
    }
  }
}

uint32_t FileVersionOf(const std::string& path) {
  const std::string bytes = testing::ReadAll(path);
  return bytes.size() >= 12 ? GetU32(bytes.data() + 8) : 0;
}

class CompactCheckpointTest : public ::testing::Test {
 protected:
  HostMemoryBudget budget_{0};
  TempDir dir_;
  Env* env_ = Env::Default();
};

TEST_F(CompactCheckpointTest, CompactRoundTripIsBitwise) {
  auto src = MakeShard(&budget_, testing::AwkwardSizes(), 1000, kCompact);
  FillOdd(src.get(), 3);
  const std::string path = dir_.File("c.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  EXPECT_EQ(FileVersionOf(path), 2u);
  auto r = CheckpointReader::Open(path, env_);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->layout().state_format, kCompact);
  EXPECT_TRUE((*r)->VerifyAll().ok());
  for (uint64_t sg : {1000u, 7u, 100000u}) {  // any subgroup size
    auto dst = MakeShard(&budget_, testing::AwkwardSizes(), sg, kCompact);
    ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok()) << sg;
    EXPECT_EQ(Take(*dst), Take(*src)) << sg;
    for (size_t i = 0; i < dst->subgroups().size() && sg == 1000; ++i) {
      const Subgroup& a = src->subgroups()[i];
      const Subgroup& b = dst->subgroups()[i];
      ASSERT_EQ(std::memcmp(a.master, b.master, a.state_bytes()), 0) << "subgroup " << i;
    }
  }
}

TEST_F(CompactCheckpointTest, CompactFileIsTwoThirdsTheSize) {
  auto fp32 = MakeShard(&budget_, {100000}, 1000, kFp32);
  auto compact = MakeShard(&budget_, {100000}, 1000, kCompact);
  const std::string a = dir_.File("a"), b = dir_.File("b");
  ASSERT_TRUE(SaveShard(*fp32, a, env_).ok());
  ASSERT_TRUE(SaveShard(*compact, b, env_).ok());
  EXPECT_EQ(FileVersionOf(a), 1u) << "fp32 checkpoints stay version 1";
  const double ratio = static_cast<double>(testing::ReadAll(b).size()) /
                       static_cast<double>(testing::ReadAll(a).size());
  EXPECT_NEAR(ratio, 8.0 / 12.0, 0.01);
}

TEST_F(CompactCheckpointTest, CompactLoadsIntoFp32Exactly) {
  auto src = MakeShard(&budget_, testing::AwkwardSizes(), 1000, kCompact);
  FillOdd(src.get(), 4);
  const std::string path = dir_.File("c.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  auto dst = MakeShard(&budget_, testing::AwkwardSizes(), 333, kFp32);
  Fill(dst.get(), 9);
  ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok());
  // ReadTensor widens compact moments exactly, so the fp32 state equals the
  // compact state's view of itself.
  EXPECT_EQ(Take(*dst), Take(*src));
  // And saving the fp32 shard again and loading it into compact is lossless.
  const std::string back = dir_.File("f.dosckpt");
  ASSERT_TRUE(SaveShard(*dst, back, env_).ok());
  auto again = MakeShard(&budget_, testing::AwkwardSizes(), 1000, kCompact);
  ASSERT_TRUE(LoadShard(again.get(), back, env_).ok());
  EXPECT_EQ(Take(*again), Take(*src));
}

TEST_F(CompactCheckpointTest, Fp32LoadsIntoCompactRoundingMomentsToNearest) {
  auto src = MakeShard(&budget_, testing::AwkwardSizes(), 1000, kFp32);
  FillOdd(src.get(), 5);
  const std::string path = dir_.File("f.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  auto dst = MakeShard(&budget_, testing::AwkwardSizes(), 1000, kCompact);
  ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok());
  const testing::Snapshot want = Take(*src);
  const testing::Snapshot got = Take(*dst);
  ASSERT_EQ(got.values.size(), want.values.size());
  EXPECT_EQ(got.steps, want.steps);
  size_t rounded = 0;
  for (size_t k = 0; k < want.values.size(); ++k) {
    const bool master = k % 3 == 0;
    for (size_t i = 0; i < want.values[k].size(); ++i) {
      const float w = want.values[k][i];
      const float expect = master ? w : BF16ToFloat(FloatToBF16(w));
      ASSERT_EQ(FloatToBits(got.values[k][i]), FloatToBits(expect)) << "array " << k << " i " << i;
      rounded += expect != w;
    }
  }
  EXPECT_GT(rounded, 0u) << "the moments were chosen to need rounding";
}

TEST_F(CompactCheckpointTest, WriterRefusesTheWrongElementType) {
  auto shard = MakeShard(&budget_, {3}, 1000, kCompact);
  auto w = CheckpointWriter::Create(dir_.File("x"), LayoutOf(*shard), env_);
  ASSERT_TRUE(w.ok()) << w.status();
  const float f[3] = {1, 2, 3};
  const uint16_t h[3] = {1, 2, 3};
  ASSERT_TRUE((*w)->BeginSection(0, StateArray::kMaster).ok());
  ASSERT_FALSE((*w)->AppendBf16(h, 3).ok());
  auto w2 = CheckpointWriter::Create(dir_.File("y"), LayoutOf(*shard), env_);
  ASSERT_TRUE(w2.ok());
  ASSERT_TRUE((*w2)->BeginSection(0, StateArray::kMaster).ok());
  ASSERT_TRUE((*w2)->Append(f, 3).ok());
  ASSERT_TRUE((*w2)->EndSection().ok());
  ASSERT_TRUE((*w2)->BeginSection(0, StateArray::kExpAvg).ok());
  absl::Status s = (*w2)->Append(f, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("bf16"));
}

TEST_F(CompactCheckpointTest, LayoutEncodesTheFormatOnlyInVersion2) {
  CheckpointLayout l = LayoutOf(*MakeShard(&budget_, {5}, 1000, kCompact));
  const std::string v2 = EncodeLayout(l);
  auto back = DecodeLayout(v2, 2);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->state_format, kCompact);
  // A version-1 reader of the same bytes finds 4 bytes too many.
  EXPECT_EQ(DecodeLayout(v2, 1).status().code(), absl::StatusCode::kDataLoss);
  l.state_format = kFp32;
  const std::string v1 = EncodeLayout(l);
  EXPECT_EQ(v1.size() + 4, v2.size());
  ASSERT_TRUE(DecodeLayout(v1, 1).ok());
  // An unknown format value is refused.
  std::string bad = v2;
  PutU32(bad.data() + bad.size() - 4, 7);
  absl::StatusOr<CheckpointLayout> b = DecodeLayout(bad, 2);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(b.status().message(), HasSubstr("state_format"));
}

}  // namespace
}  // namespace dos
