// Round trips, layout checks and corruption handling of the checkpoint format
// (daemon/checkpoint). Disk faults are in tests/fault/checkpoint_fault_test.cc.
#include <sys/stat.h>

#include <string>

#include "absl/strings/match.h"
#include "daemon/checkpoint/crc32c.h"
#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/checkpoint_writer.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/checkpoint/checkpoint_test_util.h"
#include "tests/unit/checkpoint/fake_env.h"

namespace dos {
namespace {

using ::dos::testing::Fill;
using ::dos::testing::MakeShard;
using ::dos::testing::Take;
using ::dos::testing::TempDir;
using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  HostMemoryBudget budget_{0};
  TempDir dir_;
  Env* env_ = Env::Default();
};

TEST_F(CheckpointTest, RoundTripRestoresValuesAndSteps) {
  auto src = MakeShard(&budget_);
  Fill(src.get(), 3);
  const std::string path = dir_.File("a.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_, {"train.py", 5, 8}).ok());

  auto dst = MakeShard(&budget_);
  Fill(dst.get(), 9);
  absl::Status s = LoadShard(dst.get(), path, env_);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Take(*dst), Take(*src));
  // Only the checkpoint remains: no temporary files.
  EXPECT_THAT(dir_.List(), ::testing::ElementsAre("a.dosckpt"));
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0037, 0u) << "no write for group, nothing for others";
}

TEST_F(CheckpointTest, LayoutRecordsEverything) {
  auto src = MakeShard(&budget_);
  Fill(src.get(), 1);
  const std::string path = dir_.File("a.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_, {"train.py", 5, 8}).ok());
  auto r = CheckpointReader::Open(path, env_);
  ASSERT_TRUE(r.ok()) << r.status();
  const CheckpointLayout& l = (*r)->layout();
  EXPECT_EQ(l.owner, "train.py");
  EXPECT_EQ(l.rank, 5);
  EXPECT_EQ(l.world_size, 8);
  EXPECT_EQ(l.subgroup_size, 1000u);
  ASSERT_EQ(l.groups.size(), 2u);
  EXPECT_DOUBLE_EQ(l.groups[1].defaults.lr, 3e-4);
  EXPECT_DOUBLE_EQ(l.groups[1].defaults.eps, 1e-6);
  EXPECT_FALSE(l.groups[1].decoupled_weight_decay);
  ASSERT_EQ(l.tensors.size(), src->tensors().size());
  for (size_t i = 0; i < l.tensors.size(); ++i) {
    EXPECT_EQ(l.tensors[i].name, src->tensors()[i].name);
    EXPECT_EQ(l.tensors[i].numel, src->tensors()[i].numel);
    EXPECT_EQ(l.tensors[i].param_dtype, src->tensors()[i].param_dtype);
    EXPECT_EQ(l.tensors[i].grad_dtype, src->tensors()[i].grad_dtype);
    EXPECT_EQ(l.tensors[i].step, src->tensors()[i].step);
  }
  EXPECT_GT((*r)->created_unix_seconds(), 0u);
  EXPECT_TRUE((*r)->VerifyAll().ok());
}

TEST_F(CheckpointTest, LoadsIntoADifferentSubgroupSize) {
  auto src = MakeShard(&budget_, testing::AwkwardSizes(), 1000);
  Fill(src.get(), 4);
  const std::string path = dir_.File("a.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  for (uint64_t sg : {1u, 7u, 333u, 100000u}) {
    auto dst = MakeShard(&budget_, testing::AwkwardSizes(), sg);
    ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok()) << "subgroup_size " << sg;
    EXPECT_EQ(Take(*dst), Take(*src)) << "subgroup_size " << sg;
  }
}

TEST_F(CheckpointTest, SmallChunksRoundTrip) {
  auto src = MakeShard(&budget_);
  Fill(src.get(), 2);
  const std::string path = dir_.File("a.dosckpt");
  CheckpointWriterOptions o;
  o.chunk_bytes = 12;  // three values per chunk: many chunks, partial last ones
  ASSERT_TRUE(SaveShard(*src, path, env_, {}, o).ok());
  auto dst = MakeShard(&budget_);
  ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok());
  EXPECT_EQ(Take(*dst), Take(*src));
}

TEST_F(CheckpointTest, OverwritesThePreviousCheckpoint) {
  auto src = MakeShard(&budget_);
  const std::string path = dir_.File("a.dosckpt");
  Fill(src.get(), 1);
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  Fill(src.get(), 2);
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  auto dst = MakeShard(&budget_);
  ASSERT_TRUE(LoadShard(dst.get(), path, env_).ok());
  EXPECT_EQ(Take(*dst), Take(*src));
}

TEST_F(CheckpointTest, MissingFileIsNotFound) {
  auto dst = MakeShard(&budget_);
  absl::Status s = LoadShard(dst.get(), dir_.File("nope"), env_);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("nope"));
}

TEST_F(CheckpointTest, MissingDirectoryFailsWithThePath) {
  auto src = MakeShard(&budget_);
  absl::Status s = SaveShard(*src, dir_.File("no/such/dir/a.dosckpt"), env_);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("no/such/dir"));
}

TEST_F(CheckpointTest, NotACheckpointIsRefused) {
  const std::string path = dir_.File("junk");
  testing::WriteAll(path, std::string(4096, 'x'));
  auto dst = MakeShard(&budget_);
  absl::Status s = LoadShard(dst.get(), path, env_);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("not a DOS checkpoint"));
}

// --- layout mismatches: FAILED_PRECONDITION naming the field, state untouched ---

struct MismatchCase {
  const char* field;
  std::vector<uint64_t> sizes;
  void (*mutate)(std::vector<TensorDesc>*, std::vector<GroupConfig>*);
};

std::unique_ptr<ShardState> MakeMutated(HostMemoryBudget* budget, const MismatchCase& c) {
  auto base = MakeShard(budget, c.sizes);
  std::vector<TensorDesc> tensors(base->tensors().begin(), base->tensors().end());
  std::vector<GroupConfig> groups(base->groups().begin(), base->groups().end());
  c.mutate(&tensors, &groups);
  auto s = ShardState::Create(std::move(tensors), std::move(groups), 1000, budget, "mutated");
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

TEST_F(CheckpointTest, LayoutMismatchNamesTheFieldAndLeavesStateUntouched) {
  auto src = MakeShard(&budget_);
  Fill(src.get(), 1);
  const std::string path = dir_.File("a.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  std::vector<uint64_t> sizes = testing::AwkwardSizes();
  std::vector<uint64_t> fewer(sizes.begin(), sizes.end() - 1);
  std::vector<uint64_t> bigger = sizes;
  bigger[1] += 1;
  const MismatchCase cases[] = {
      {"the number of tensors", fewer, [](auto*, auto*) {}},
      {"tensors[1].numel", bigger, [](auto*, auto*) {}},
      {"tensors[2].name", sizes, [](auto* t, auto*) { (*t)[2].name = "other"; }},
      {"tensors[3].group", sizes, [](auto* t, auto*) { (*t)[3].group = 0; }},
      {"tensors[0].param_dtype", sizes,
       [](auto* t, auto*) { (*t)[0].param_dtype = DType::kF16; }},
      {"tensors[4].grad_dtype", sizes,
       [](auto* t, auto*) { (*t)[4].grad_dtype = DType::kBF16; }},
      {"the number of param groups", sizes,
       [](auto* t, auto* g) {
         g->push_back(GroupConfig{});
         (void)t;
       }},
      {"groups[0].decoupled_weight_decay", sizes,
       [](auto*, auto* g) { (*g)[0].decoupled_weight_decay = false; }},
  };
  for (const MismatchCase& c : cases) {
    auto dst = MakeMutated(&budget_, c);
    Fill(dst.get(), 7);
    const auto before = Take(*dst);
    absl::Status s = LoadShard(dst.get(), path, env_);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.field << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.field));
    EXPECT_THAT(s.message(), HasSubstr(path));
    EXPECT_EQ(Take(*dst), before) << c.field;
  }
}

TEST_F(CheckpointTest, HyperparametersMayDiffer) {
  auto src = MakeShard(&budget_);
  Fill(src.get(), 1);
  const std::string path = dir_.File("a.dosckpt");
  ASSERT_TRUE(SaveShard(*src, path, env_).ok());
  MismatchCase c{"lr", testing::AwkwardSizes(),
                 [](auto*, auto* g) { (*g)[0].defaults.lr = 0.5; }};
  auto dst = MakeMutated(&budget_, c);
  EXPECT_TRUE(LoadShard(dst.get(), path, env_).ok());
  EXPECT_EQ(Take(*dst), Take(*src));
}

// --- corruption and truncation: DATA_LOSS, state untouched ---

class CorruptionTest : public CheckpointTest {
 protected:
  void SetUp() override {
    src_ = MakeShard(&budget_);
    Fill(src_.get(), 1);
    CheckpointWriterOptions o;
    o.chunk_bytes = 1024;  // several chunks per section
    ASSERT_TRUE(SaveShard(*src_, path_, env_, {}, o).ok());
    good_ = testing::ReadAll(path_);
    ASSERT_FALSE(good_.empty());
  }
  // Loads `bytes` into a shard filled with another pattern; returns the status
  // and checks the shard was not touched.
  absl::Status LoadBytes(const std::string& bytes) {
    testing::WriteAll(bad_, bytes);
    auto dst = MakeShard(&budget_);
    Fill(dst.get(), 8);
    const auto before = Take(*dst);
    absl::Status s = LoadShard(dst.get(), bad_, env_);
    EXPECT_EQ(Take(*dst), before) << s;
    return s;
  }

  std::unique_ptr<ShardState> src_;
  const std::string path_ = dir_.File("good.dosckpt");
  const std::string bad_ = dir_.File("bad.dosckpt");
  std::string good_;
};

TEST_F(CorruptionTest, EveryFlippedByteIsRefused) {
  // Every byte of the file, stepping through it; each flip must be caught.
  int checked = 0;
  for (size_t off = 0; off < good_.size(); off += (off < 512 ? 1 : 97)) {
    std::string bytes = good_;
    bytes[off] ^= 0x10;
    absl::Status s = LoadBytes(bytes);
    ASSERT_FALSE(s.ok()) << "flip at " << off << " was loaded";
    EXPECT_TRUE(s.code() == absl::StatusCode::kDataLoss ||
                s.code() == absl::StatusCode::kFailedPrecondition)
        << off << ": " << s;
    if (off >= 8) {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << off << ": " << s;
    }
    ++checked;
  }
  RecordProperty("flips_checked", checked);
}

TEST_F(CorruptionTest, DataCorruptionNamesSectionAndOffset) {
  std::string bytes = good_;
  const size_t off = good_.size() - kTrailerBytes - 100;  // inside the last section's data
  bytes[off] ^= 1;
  absl::Status s = LoadBytes(bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("section tensors[5] 'layer5.weight'.exp_avg_sq"));
  EXPECT_THAT(s.message(), HasSubstr("at offset"));
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  EXPECT_THAT(s.message(), HasSubstr(bad_));
}

TEST_F(CorruptionTest, SwappedChunksAreRefused) {
  // Two equally sized data chunks of one section exchanged: each chunk's own
  // CRC still matches, but its offset is bound into it.
  auto r = CheckpointReader::Open(path_, env_);
  ASSERT_TRUE(r.ok());
  std::string layout = EncodeLayout((*r)->layout());
  const size_t first_chunk = kFileHeaderBytes + layout.size() + kSectionHeaderBytes;
  // tensors[0] has 7 values (one chunk); use tensors[1] (2203 values, 1024-byte chunks).
  size_t t1 = first_chunk - kSectionHeaderBytes + 3 * (kSectionHeaderBytes + 7 * 4 + 4);
  size_t c0 = t1 + kSectionHeaderBytes, c1 = c0 + 1024 + 4;
  std::string bytes = good_;
  std::string a = bytes.substr(c0, 1028), b = bytes.substr(c1, 1028);
  bytes.replace(c0, 1028, b);
  bytes.replace(c1, 1028, a);
  absl::Status s = LoadBytes(bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("tensors[1]"));
}

TEST_F(CorruptionTest, EveryTruncationIsRefused) {
  for (size_t len = 0; len < good_.size(); len += (len < 256 ? 1 : 61)) {
    absl::Status s = LoadBytes(good_.substr(0, len));
    ASSERT_EQ(s.code(), absl::StatusCode::kDataLoss) << "length " << len << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr("truncated")) << len;
  }
}

TEST_F(CorruptionTest, TrailingBytesAreRefused) {
  absl::Status s = LoadBytes(good_ + "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("trailing bytes"));
}

TEST_F(CorruptionTest, OtherVersionIsRefused) {
  std::string bytes = good_;
  PutU32(bytes.data() + 8, kCheckpointVersion + 1);
  PutU32(bytes.data() + 44, 0);
  // Recompute the header CRC so only the version differs.
  auto crc = [](const std::string& b) {
    return ::dos::crc32c::Value(b.data(), 44);
  };
  PutU32(bytes.data() + 44, crc(bytes));
  absl::Status s = LoadBytes(bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("version"));
}

// --- writer misuse ---

TEST_F(CheckpointTest, WriterEnforcesSectionOrderAndCounts) {
  testing::MemEnv mem;
  CheckpointLayout l;
  l.subgroup_size = 10;
  l.groups.resize(1);
  l.tensors.push_back({.name = "a", .numel = 3});
  auto w = CheckpointWriter::Create("/x/a", l, &mem);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->BeginSection(0, StateArray::kExpAvg).code(),
            absl::StatusCode::kFailedPrecondition);
  // The first error sticks and the temporary file is gone.
  EXPECT_FALSE((*w)->BeginSection(0, StateArray::kMaster).ok());
  EXPECT_TRUE(mem.Files().empty());

  auto w2 = CheckpointWriter::Create("/x/a", l, &mem);
  ASSERT_TRUE(w2.ok());
  float v[4] = {1, 2, 3, 4};
  ASSERT_TRUE((*w2)->BeginSection(0, StateArray::kMaster).ok());
  ASSERT_TRUE((*w2)->Append(v, 2).ok());
  absl::Status s = (*w2)->EndSection();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("after 2 of 3 values"));
}

TEST_F(CheckpointTest, UncommittedWriterLeavesNothingBehind) {
  testing::MemEnv mem;
  mem.Put("/x/a", "previous");
  CheckpointLayout l;
  l.subgroup_size = 10;
  l.groups.resize(1);
  l.tensors.push_back({.name = "a", .numel = 3});
  {
    auto w = CheckpointWriter::Create("/x/a", l, &mem);
    ASSERT_TRUE(w.ok());
    float v[3] = {1, 2, 3};
    ASSERT_TRUE((*w)->BeginSection(0, StateArray::kMaster).ok());
    ASSERT_TRUE((*w)->Append(v, 3).ok());
    EXPECT_EQ(mem.Files().size(), 2u);
  }
  EXPECT_THAT(mem.Files(), ::testing::ElementsAre("/x/a"));
  EXPECT_EQ(*mem.Get("/x/a"), "previous");
}

TEST_F(CheckpointTest, InvalidLayoutIsRefusedByTheWriter) {
  testing::MemEnv mem;
  CheckpointLayout l;
  l.subgroup_size = 10;
  l.groups.resize(1);
  l.tensors.push_back({.name = "a", .numel = 3, .group = 4});
  auto w = CheckpointWriter::Create("/x/a", l, &mem);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(), HasSubstr("tensors[0].group"));
}

}  // namespace
}  // namespace dos
