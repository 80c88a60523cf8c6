// StoreEnv (daemon/checkpoint/store_env.h): every file operation of the
// checkpoint store goes through the store's directory descriptor, one folder
// at a time with O_NOFOLLOW. A folder swapped for a link to an outside folder
// (before an operation, or between the checks of a save and its writes)
// makes the operation fail naming the link and the fix; nothing outside is
// written, read or deleted.
#include "daemon/checkpoint/store_env.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>

#include "daemon/checkpoint/checkpoint_reader.h"
#include "daemon/checkpoint/shard_checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/checkpoint/checkpoint_test_util.h"

namespace dos {
namespace {

namespace fs = std::filesystem;
using ::dos::testing::Fill;
using ::dos::testing::MakeShard;
using ::dos::testing::ReadAll;
using ::dos::testing::ReadOnlyBind;
using ::dos::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

class StoreEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = base_.File("store");
    outside_ = base_.File("outside");
    fs::create_directories(outside_);
    dos::testing::WriteAll(outside_ + "/auto-000000000001.dckpt", "outside 1");
    dos::testing::WriteAll(outside_ + "/victim", "precious");
    auto s = StoreEnv::Open(root_);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
    job_ = root_ + "/uid-1000/job.r0";
    ASSERT_TRUE(store_->CreateDirs(job_, 0700).ok());
  }

  // The session's folder becomes a link to `outside_` (its real contents
  // moved aside), as a hostile swap would leave it.
  void SwapJobForLink() {
    fs::rename(job_, base_.File("moved"));
    fs::create_directory_symlink(outside_, job_);
  }

  // What is outside, name -> contents.
  std::map<std::string, std::string> Outside() const {
    std::map<std::string, std::string> out;
    for (const auto& e : fs::directory_iterator(outside_)) {
      out[e.path().filename()] = ReadAll(e.path());
    }
    return out;
  }

  void ExpectRefusedNamingTheLink(const absl::Status& st) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(job_ + " is a symlink"));
    EXPECT_THAT(std::string(st.message()), HasSubstr("remove " + job_));
  }

  TempDir base_;
  std::string root_, outside_, job_;
  std::unique_ptr<StoreEnv> store_;
  HostMemoryBudget budget_{0};
};

TEST_F(StoreEnvTest, CreatesPrivateFoldersAndRefusesPathsOutside) {
  struct stat st;
  ASSERT_EQ(::stat(root_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  auto shard = MakeShard(&budget_);
  Fill(shard.get(), 2);
  ASSERT_TRUE(SaveShard(*shard, job_ + "/a.dckpt", store_.get()).ok());
  EXPECT_EQ(*store_->KindOf(job_ + "/a.dckpt"), StoreEnv::Kind::kFile);
  EXPECT_EQ(*store_->KindOf(job_), StoreEnv::Kind::kDirectory);
  EXPECT_EQ(*store_->KindOf(job_ + "/none/x"), StoreEnv::Kind::kMissing);
  EXPECT_GT(*store_->FileSize(job_ + "/a.dckpt"), 0u);
  auto back = MakeShard(&budget_);
  ASSERT_TRUE(LoadShard(back.get(), job_ + "/a.dckpt", store_.get()).ok());
  EXPECT_EQ(dos::testing::Take(*back), dos::testing::Take(*shard));
  // Listing the root twice sees it twice (no directory offset is shared).
  for (int i = 0; i < 2; ++i) {
    auto top = store_->GetChildren(root_);
    ASSERT_TRUE(top.ok()) << top.status();
    EXPECT_THAT(*top, ::testing::ElementsAre("uid-1000")) << i;
  }
  auto names = store_->List(job_);
  ASSERT_TRUE(names.ok());
  ASSERT_EQ(names->size(), 1u);
  EXPECT_EQ((*names)[0].name, "a.dckpt");
  for (const std::string& bad : {outside_ + "/x", root_ + "/../outside/x", std::string("/etc/x"),
                                 std::string("relative/x")}) {
    absl::Status st = store_->NewWritableFile(bad, 0600).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("outside dosd's checkpoint store"));
  }
}

TEST_F(StoreEnvTest, AFolderSwappedForALinkIsNeverFollowed) {
  const auto before = Outside();
  SwapJobForLink();
  ExpectRefusedNamingTheLink(store_->NewWritableFile(job_ + "/new.dckpt", 0600).status());
  ExpectRefusedNamingTheLink(store_->NewReadableFile(job_ + "/victim").status());
  ExpectRefusedNamingTheLink(store_->DeleteFile(job_ + "/auto-000000000001.dckpt"));
  ExpectRefusedNamingTheLink(store_->RenameFile(job_ + "/victim", job_ + "/stolen"));
  ExpectRefusedNamingTheLink(store_->List(job_).status());
  ExpectRefusedNamingTheLink(store_->CreateDirs(job_ + "/deeper", 0700));
  ExpectRefusedNamingTheLink(store_->SyncDir(job_));
  ExpectRefusedNamingTheLink(store_->FreeBytes(job_).status());
  ExpectRefusedNamingTheLink(store_->KindOf(job_ + "/victim").status());
  EXPECT_FALSE(store_->FileExists(job_ + "/victim"));
  // The link itself is reported as what it is, not followed.
  EXPECT_EQ(*store_->KindOf(job_), StoreEnv::Kind::kOther);
  auto shard = MakeShard(&budget_);
  ExpectRefusedNamingTheLink(SaveShard(*shard, job_ + "/step.dckpt", store_.get()));
  ExpectRefusedNamingTheLink(LoadShard(shard.get(), job_ + "/victim", store_.get()));
  EXPECT_EQ(Outside(), before);
}

// An Env that swaps the session's folder for a link just before the call
// `at` reaches the store: after every check a save makes, between the
// creation of the temporary and its rename, and so on.
class SwappingEnv : public Env {
 public:
  SwappingEnv(StoreEnv* store, std::string at, std::function<void()> swap)
      : store_(store), at_(std::move(at)), swap_(std::move(swap)) {}
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& p,
                                                                uint32_t mode) override {
    Maybe("create");
    return store_->NewWritableFile(p, mode);
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& p) override {
    Maybe("open");
    return store_->NewReadableFile(p);
  }
  bool FileExists(const std::string& p) override { return store_->FileExists(p); }
  absl::StatusOr<std::vector<std::string>> GetChildren(const std::string& d) override {
    return store_->GetChildren(d);
  }
  absl::Status RenameFile(const std::string& a, const std::string& b) override {
    Maybe("rename");
    return store_->RenameFile(a, b);
  }
  absl::Status DeleteFile(const std::string& p) override { return store_->DeleteFile(p); }
  absl::Status SyncDir(const std::string& d) override { return store_->SyncDir(d); }
  absl::StatusOr<uint64_t> FreeBytes(const std::string& d) override {
    return store_->FreeBytes(d);
  }

 private:
  void Maybe(const std::string& call) {
    if (call == at_ && swap_) std::exchange(swap_, nullptr)();
  }
  StoreEnv* const store_;
  const std::string at_;
  std::function<void()> swap_;
};

TEST_F(StoreEnvTest, ASwapBetweenTheChecksAndTheWritesRedirectsNothing) {
  const auto before = Outside();
  auto shard = MakeShard(&budget_);
  Fill(shard.get(), 4);
  for (const std::string at : {"create", "rename"}) {
    SCOPED_TRACE(at);
    fs::remove_all(base_.File("moved"));
    fs::remove(job_);
    ASSERT_TRUE(store_->CreateDirs(job_, 0700).ok());
    SwappingEnv env(store_.get(), at, [this] { SwapJobForLink(); });
    absl::Status st = SaveShard(*shard, job_ + "/auto-000000000001.dckpt", &env);
    ExpectRefusedNamingTheLink(st);
    EXPECT_EQ(Outside(), before) << "written through the link";
  }
  // Reading: a load whose folder is swapped after its checks reads nothing
  // outside (the file there is not a checkpoint; a read would say so).
  fs::remove_all(base_.File("moved"));
  fs::remove(job_);
  ASSERT_TRUE(store_->CreateDirs(job_, 0700).ok());
  ASSERT_TRUE(SaveShard(*shard, job_ + "/victim", store_.get()).ok());
  SwappingEnv env(store_.get(), "open", [this] { SwapJobForLink(); });
  ExpectRefusedNamingTheLink(LoadShard(shard.get(), job_ + "/victim", &env));
  EXPECT_EQ(Outside(), before);
}

TEST_F(StoreEnvTest, TheRootMayBeALinkTheOperatorMade) {
  // --checkpoint_dir itself may point at another disk; only below it no link
  // is followed.
  const std::string link = base_.File("linked-store");
  fs::create_directory_symlink(root_, link);
  auto s = StoreEnv::Open(link);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*(*s)->KindOf(link + "/uid-1000/job.r0"), StoreEnv::Kind::kDirectory);
  auto notdir = StoreEnv::Open(outside_ + "/victim");
  EXPECT_EQ(notdir.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(notdir.status().message()), HasSubstr("--checkpoint_dir="));
}

// A store on a file system mounted (or remounted after errors) read-only,
// already dosd's alone: dosd starts on it (its checkpoints restore), and a
// save fails naming the read-only file system. Needs root (a bind mount).
TEST_F(StoreEnvTest, AReadOnlyStoreOpensAndRefusesWritesNamingWhy) {
  const std::string ro = base_.File("ro-store");
  fs::create_directories(ro);
  ReadOnlyBind bind(root_, ro);
  if (!bind.bound()) GTEST_SKIP() << bind.why();
  ASSERT_TRUE(bind.read_only()) << bind.why();
  ASSERT_EQ(::chmod(root_.c_str(), 0700), 0);
  auto s = StoreEnv::Open(ro);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(*(*s)->KindOf(ro + "/uid-1000/job.r0"), StoreEnv::Kind::kDirectory);
  const absl::Status st = (*s)->CreateDirs(ro + "/uid-1000/other.r0", 0700);
  EXPECT_FALSE(st.ok());
  EXPECT_THAT(std::string(st.message()), HasSubstr("read-only file system")) << st;
  // A read-only store that others could write is still refused.
  ASSERT_TRUE(bind.Unmount());
  ASSERT_EQ(::chmod(root_.c_str(), 0777), 0);
  const ReadOnlyBind again(root_, ro);
  ASSERT_TRUE(again.read_only()) << again.why();
  EXPECT_EQ(StoreEnv::Open(ro).status().code(), absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace dos
