// Disk faults during a checkpoint, injected through the Env seam
// (tests/unit/checkpoint/fake_env.h) over a real temporary directory. Each
// test checks that nothing was lost: the previous checkpoint still loads and
// holds the previous state, no temporary file is left, and the error says
// what happened to which path.
#include <cerrno>
#include <string>

#include "daemon/checkpoint/shard_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/checkpoint/checkpoint_test_util.h"
#include "tests/unit/checkpoint/fake_env.h"

namespace dos {
namespace {

using ::dos::testing::FaultInjectionEnv;
using ::dos::testing::Fill;
using ::dos::testing::MakeShard;
using ::dos::testing::Snapshot;
using ::dos::testing::Take;
using ::dos::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class CheckpointFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shard_ = MakeShard(&budget_);
    Fill(shard_.get(), 1);
    ASSERT_TRUE(SaveShard(*shard_, path_, &env_, {}, Options()).ok());
    previous_ = Take(*shard_);
    previous_bytes_ = testing::ReadAll(path_);
    Fill(shard_.get(), 2);  // the state a failed checkpoint tries to write
  }

  static CheckpointWriterOptions Options() {
    CheckpointWriterOptions o;
    o.chunk_bytes = 4096;
    return o;
  }

  // Nothing but the previous checkpoint is in the directory, and it loads.
  void ExpectPreviousIntact() {
    EXPECT_THAT(dir_.List(), ElementsAre("ckpt"));
    ExpectPreviousLoads();
  }
  // The previous checkpoint's bytes are unchanged and it loads.
  void ExpectPreviousLoads() {
    EXPECT_EQ(testing::ReadAll(path_), previous_bytes_);
    env_.ClearFaults();
    auto fresh = MakeShard(&budget_);
    absl::Status s = LoadShard(fresh.get(), path_, &env_);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(Take(*fresh), previous_);
  }

  absl::Status Save() { return SaveShard(*shard_, path_, &env_, {}, Options()); }

  HostMemoryBudget budget_{0};
  TempDir dir_;
  const std::string path_ = dir_.File("ckpt");
  FaultInjectionEnv env_{Env::Default()};
  std::unique_ptr<ShardState> shard_;
  Snapshot previous_;
  std::string previous_bytes_;
};

TEST_F(CheckpointFaultTest, DiskFullAtAnyByteKeepsThePreviousCheckpoint) {
  const uint64_t size = previous_bytes_.size();
  int injected = 0;
  for (uint64_t at : {uint64_t{0}, uint64_t{1}, uint64_t{47}, uint64_t{48}, uint64_t{100},
                      size / 3, size / 2, size - 33, size - 32, size - 1}) {
    SCOPED_TRACE(at);
    env_.ClearFaults();
    env_.FailWritesAfter(at, ENOSPC);
    env_.ReportFreeBytes(size);  // passes the up-front check; the disk fills meanwhile
    absl::Status s = Save();
    ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(s.message(), HasSubstr(path_));
    EXPECT_THAT(s.message(), HasSubstr("bytes free on " + dir_.path()));
    EXPECT_THAT(s.message(), HasSubstr("previous checkpoint is intact"));
    ExpectPreviousIntact();
    ++injected;
  }
  RecordProperty("faults_injected", injected);
}

TEST_F(CheckpointFaultTest, QuotaExceededIsResourceExhaustedToo) {
  env_.FailWritesAfter(5000, EDQUOT);
  env_.ReportFreeBytes(1u << 30);
  absl::Status s = Save();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, NotEnoughFreeSpaceIsRefusedBeforeWriting) {
  env_.ReportFreeBytes(previous_bytes_.size() - 1);
  const uint64_t before = env_.bytes_written();
  absl::Status s = Save();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("needs ", previous_bytes_.size(), " bytes")));
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(previous_bytes_.size() - 1, " bytes are free")));
  EXPECT_EQ(env_.bytes_written(), before);
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, ShortWritesProduceTheSameFile) {
  for (size_t n : {1u, 3u, 7u, 4095u}) {
    SCOPED_TRACE(n);
    env_.ClearFaults();
    env_.LimitWriteSize(n);
    Fill(shard_.get(), 1);  // same state and time as the previous checkpoint...
    CheckpointWriterOptions o = Options();
    ASSERT_TRUE(SaveShard(*shard_, path_, &env_, {}, o).ok());
    // ...so only the creation time may differ (bytes 32..39 and the header CRC).
    std::string now = testing::ReadAll(path_);
    ASSERT_EQ(now.size(), previous_bytes_.size());
    EXPECT_EQ(now.substr(48), previous_bytes_.substr(48));
    auto fresh = MakeShard(&budget_);
    ASSERT_TRUE(LoadShard(fresh.get(), path_, &env_).ok());
    EXPECT_EQ(Take(*fresh), previous_);
  }
}

TEST_F(CheckpointFaultTest, WritesThatMakeNoProgressFailInsteadOfSpinning) {
  env_.StallWrites();
  absl::Status s = Save();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("accepted 0 of"));
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, FsyncFailureKeepsThePreviousCheckpoint) {
  env_.FailSync(EIO);
  absl::Status s = Save();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("fsync failed"));
  EXPECT_THAT(s.message(), HasSubstr(path_));
  EXPECT_EQ(env_.renames(), 1) << "only the setup's checkpoint was renamed into place";
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, CloseFailureKeepsThePreviousCheckpoint) {
  env_.FailClose(EIO);
  absl::Status s = Save();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("close failed"));
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, RenameFailureKeepsThePreviousCheckpoint) {
  env_.FailRename(EXDEV);
  absl::Status s = Save();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("rename failed"));
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, DirectoryFsyncFailureIsReportedButTheNewFileIsComplete) {
  env_.FailSyncDir(EIO);
  absl::Status s = Save();
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("may not survive a power loss"));
  env_.ClearFaults();
  auto fresh = MakeShard(&budget_);
  ASSERT_TRUE(LoadShard(fresh.get(), path_, &env_).ok());
  EXPECT_EQ(Take(*fresh), Take(*shard_));
}

TEST_F(CheckpointFaultTest, SuccessfulSaveFsyncsFileAndDirectory) {
  const int syncs = env_.syncs(), dir_syncs = env_.dir_syncs();
  ASSERT_TRUE(Save().ok());
  EXPECT_EQ(env_.syncs(), syncs + 1);
  EXPECT_EQ(env_.dir_syncs(), dir_syncs + 1);
}

TEST_F(CheckpointFaultTest, ReadErrorDuringLoadLeavesStateUntouched) {
  for (uint64_t at : {uint64_t{0}, uint64_t{60}, previous_bytes_.size() / 2,
                      previous_bytes_.size() - 5}) {
    SCOPED_TRACE(at);
    env_.ClearFaults();
    env_.FailReadsAfter(at, EIO);
    const Snapshot before = Take(*shard_);
    absl::Status s = LoadShard(shard_.get(), path_, &env_);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr("Input/output error"));
    EXPECT_EQ(Take(*shard_), before);
  }
}

// A checkpoint that a crash cut short (the daemon killed mid-write): the
// temporary file is left, the real one is the previous checkpoint.
TEST_F(CheckpointFaultTest, CrashMidWriteLeavesOnlyATemporaryFile) {
  env_.FailWritesAfter(previous_bytes_.size() / 2, EIO);
  ASSERT_FALSE(Save().ok());
  ExpectPreviousIntact();
}

TEST_F(CheckpointFaultTest, StaleTemporariesOfAKilledWriterAreRemovedAtStartup) {
  // What a daemon SIGKILLed mid-checkpoint leaves behind.
  testing::WriteAll(path_ + ".tmp.999999.0", "half a checkpoint");
  testing::WriteAll(dir_.File("other.tmp.12.3"), "x");
  testing::WriteAll(dir_.File("keep.tmp.notapid.1"), "y");  // not ours: kept
  auto removed = RemoveStaleCheckpointTemporaries(dir_.path(), &env_);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(*removed, 2);
  EXPECT_THAT(dir_.List(), ::testing::UnorderedElementsAre("ckpt", "keep.tmp.notapid.1"));
  ExpectPreviousLoads();
}

}  // namespace
}  // namespace dos
