// UserFolders (daemon/session/user_folders.h): the per-uid folders of the
// checkpoint store. Which folders are trusted, what a uid holds, how a save
// beyond --checkpoint_quota prunes (oldest first, never the newest, never in
// vain) or is refused, and what a delete removes.
#include "daemon/session/user_folders.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/checkpoint/checkpoint_test_util.h"

namespace dos {
namespace {

namespace fs = std::filesystem;
using ::dos::testing::ReadOnlyBind;
using ::dos::testing::TempDir;
using ::dos::testing::WriteAll;
using ::testing::HasSubstr;

class UserFoldersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto s = StoreEnv::Open(base_.File("store"));
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = *std::move(s);
  }
  std::unique_ptr<UserFolders> Folders(uint64_t quota, bool prune = true) {
    UserFoldersOptions o;
    o.quota_bytes = quota;
    o.prune = prune;
    return std::make_unique<UserFolders>(store_.get(), o);
  }
  // A file of `bytes` under uid 7's folder, modified `age_s` seconds ago.
  void Put(const std::string& name, size_t bytes, int age_s) {
    const std::string path = dir_ + "/" + name;
    WriteAll(path, std::string(bytes, 'x'));
    const auto t = fs::file_time_type::clock::now() - std::chrono::seconds(age_s);
    fs::last_write_time(path, t);
  }

  TempDir base_;
  std::unique_ptr<StoreEnv> store_;
  const std::string dir_ = base_.File("store") + "/uid-7";
};

TEST_F(UserFoldersTest, ASaveBeyondTheQuotaPrunesTheOldestButNeverTheNewest) {
  auto f = Folders(1000);
  ASSERT_TRUE(f->Trust(7, true).ok());
  Put("a", 300, 30);
  Put("b", 300, 20);
  Put("c", 300, 10);
  // 900 held; 500 more: a and b go (oldest first), c (the newest) stays.
  ASSERT_TRUE(f->MakeRoom(7, 500, dir_ + "/d").ok());
  EXPECT_FALSE(fs::exists(dir_ + "/a"));
  EXPECT_FALSE(fs::exists(dir_ + "/b"));
  EXPECT_TRUE(fs::exists(dir_ + "/c"));
  EXPECT_EQ(f->Usage()[7].bytes, 300u);
  EXPECT_EQ(f->Usage()[7].files, 1u);
}

TEST_F(UserFoldersTest, ASaveThatCannotFitIsRefusedAndDeletesNothing) {
  auto f = Folders(1000);
  ASSERT_TRUE(f->Trust(7, true).ok());
  Put("a", 300, 30);
  Put("b", 600, 10);
  // Even without a, b and 500 do not fit: nothing is deleted.
  absl::Status st = f->MakeRoom(7, 500, dir_ + "/c");
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("uid 7's checkpoints use 900 bytes"));
  EXPECT_THAT(st.message(), HasSubstr("the quota is 1000 bytes per uid (--checkpoint_quota)"));
  EXPECT_THAT(st.message(), HasSubstr("so none was deleted"));
  EXPECT_TRUE(fs::exists(dir_ + "/a"));
  // Replacing b itself fits (its bytes are freed by the rename).
  EXPECT_TRUE(f->MakeRoom(7, 650, dir_ + "/b").ok());
  EXPECT_TRUE(fs::exists(dir_ + "/a"));
}

TEST_F(UserFoldersTest, WithoutPruningASaveBeyondTheQuotaIsRefused) {
  auto f = Folders(1000, /*prune=*/false);
  ASSERT_TRUE(f->Trust(7, true).ok());
  Put("a", 600, 10);
  absl::Status st = f->MakeRoom(7, 500, dir_ + "/b");
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr("dosctl checkpoint delete"));
  EXPECT_TRUE(fs::exists(dir_ + "/a"));
  EXPECT_TRUE(Folders(0, false)->MakeRoom(7, 1 << 30, dir_ + "/b").ok());  // no quota
}

TEST_F(UserFoldersTest, OnlyTheFolderDosdMadeForTheUidIsTrusted) {
  auto f = Folders(0);
  ASSERT_TRUE(f->Trust(8, true).ok());  // made, with its marker
  EXPECT_TRUE(f->Trust(8, false).ok());
  EXPECT_TRUE(f->Trust(9, false).ok());  // missing: nothing to distrust
  // uid 8's folder renamed to uid 7's.
  fs::rename(base_.File("store") + "/uid-8", dir_);
  absl::Status st = f->Trust(7, true);
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_THAT(st.message(), HasSubstr(dir_ + " was made for uid 8"));
  fs::remove_all(dir_);
  // A folder with files and no marker; one open to others.
  fs::create_directories(dir_);
  ::chmod(dir_.c_str(), 0700);
  WriteAll(dir_ + "/x.dckpt", "x");
  EXPECT_THAT(f->Trust(7, false).message(), HasSubstr("has no marker .dos-owner"));
  ::chmod(dir_.c_str(), 0755);
  EXPECT_THAT(f->Trust(7, false).message(), HasSubstr("has mode 0755"));
  // An empty folder without a marker (dosd stopped before writing it) is adopted.
  fs::remove_all(dir_);
  fs::create_directories(dir_);
  ::chmod(dir_.c_str(), 0700);
  EXPECT_TRUE(f->Trust(7, false).ok());
  EXPECT_TRUE(fs::exists(dir_ + "/.dos-owner"));
}

TEST_F(UserFoldersTest, DeleteRemovesFilesAndFoldersButNotTheMarker) {
  auto f = Folders(0);
  ASSERT_TRUE(f->Trust(7, true).ok());
  fs::create_directories(dir_ + "/job.r0");
  Put("job.r0/step-1.dckpt", 10, 2);
  Put("job.r0/step-2.dckpt", 20, 1);
  Put("keep.dckpt", 5, 1);
  auto one = f->Delete(7, dir_ + "/keep.dckpt");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->bytes, 5u);
  auto all = f->Delete(7, dir_ + "/.");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->paths.size(), 2u);
  EXPECT_EQ(all->bytes, 30u);
  EXPECT_FALSE(fs::exists(dir_ + "/job.r0"));
  EXPECT_TRUE(fs::exists(dir_ + "/.dos-owner"));
  EXPECT_TRUE(absl::IsNotFound(f->Delete(7, dir_ + "/gone").status()));
  EXPECT_TRUE(absl::IsInvalidArgument(f->Delete(7, dir_ + "/.dos-owner").status()));
  EXPECT_EQ(f->Usage()[7].bytes, 0u);
}

// A file's delete takes the folders it leaves empty with it (up to, not
// including, the uid's folder), so save-and-delete cycles into deep fresh
// folders leave nothing the quota (file bytes) does not count and the
// restart scan would have to walk.
TEST_F(UserFoldersTest, ADeleteLeavesNoEmptyFoldersBehind) {
  auto f = Folders(0);
  ASSERT_TRUE(f->Trust(7, true).ok());
  fs::create_directories(dir_ + "/a/b/c/d");
  fs::create_directories(dir_ + "/a/other");
  Put("a/b/c/d/x.dckpt", 10, 1);
  Put("a/other/y.dckpt", 10, 1);
  ASSERT_TRUE(f->Delete(7, dir_ + "/a/b/c/d/x.dckpt").ok());
  EXPECT_FALSE(fs::exists(dir_ + "/a/b"));             // emptied: gone
  EXPECT_TRUE(fs::exists(dir_ + "/a/other/y.dckpt"));  // not empty: kept
  ASSERT_TRUE(f->Delete(7, dir_ + "/a/other").ok());
  EXPECT_FALSE(fs::exists(dir_ + "/a"));
  EXPECT_TRUE(fs::exists(dir_));
  EXPECT_TRUE(fs::exists(dir_ + "/.dos-owner"));
}

// A folder whose files cannot go (a store remounted read-only) is no
// success: the delete fails naming how many stayed and why (it answered
// "freed 0 B", exit 0).
TEST_F(UserFoldersTest, AFolderDeleteThatLeavesFilesFailsNamingThem) {
  ASSERT_TRUE(Folders(0)->Trust(7, true).ok());
  fs::create_directories(dir_ + "/job.r0");
  Put("job.r0/step-1.dckpt", 10, 2);
  const std::string ro = base_.File("ro");
  fs::create_directories(ro);
  const ReadOnlyBind bind(base_.File("store"), ro);
  if (!bind.bound()) GTEST_SKIP() << bind.why();
  ASSERT_TRUE(bind.read_only()) << bind.why();
  auto store = StoreEnv::Open(ro);
  ASSERT_TRUE(store.ok()) << store.status();
  UserFolders folders(store->get(), UserFoldersOptions{});
  const absl::StatusOr<UserFolders::Deleted> d = folders.Delete(7, ro + "/uid-7/job.r0");
  ASSERT_FALSE(d.ok());
  EXPECT_THAT(d.status().message(), HasSubstr("1 file(s) under " + ro +
                                              "/uid-7/job.r0 could "
                                              "not be deleted"));
  EXPECT_THAT(d.status().message(), HasSubstr("Read-only file system"));
  EXPECT_TRUE(fs::exists(dir_ + "/job.r0/step-1.dckpt"));
}

TEST(JobFolderNameTest, DistinctClientNamesGetDistinctSafeFolders) {
  EXPECT_EQ(JobFolderName("train.py"), "train.py");
  EXPECT_EQ(JobFolderName("my_job-2"), "my_job-2");
  // They once both became "exp_1", and one job's checkpoint replaced the other's.
  EXPECT_EQ(JobFolderName("exp/1"), "exp%2F1");
  EXPECT_EQ(JobFolderName("exp_1"), "exp_1");
  EXPECT_EQ(JobFolderName("a%2F"), "a%252F");
  EXPECT_EQ(JobFolderName(".."), "%2E.");
  EXPECT_EQ(JobFolderName(""), "%");
  const std::string a(200, 'a');
  const std::string b = a + "b";
  EXPECT_EQ(JobFolderName(a).size(), 117u);
  EXPECT_EQ(JobFolderName(a).substr(0, 101), std::string(100, 'a') + "~");
  EXPECT_NE(JobFolderName(a), JobFolderName(b));
  for (const std::string& n : {std::string("a/b"), std::string("\xff\x01"), a}) {
    const std::string f = JobFolderName(n);
    EXPECT_EQ(f.find('/'), std::string::npos) << f;
    EXPECT_NE(f[0], '.') << f;
    EXPECT_LE(f.size(), 128u) << f;
  }
}

}  // namespace
}  // namespace dos
