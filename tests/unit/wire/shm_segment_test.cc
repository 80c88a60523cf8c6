#include "dos/wire/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/wire/test_util.h"

namespace dos {
namespace {

using ::dos::testing::UniqueShmName;
using ::testing::HasSubstr;

// Sets the umask for a scope.
class ScopedUmask {
 public:
  explicit ScopedUmask(mode_t mask) : old_(umask(mask)) {}
  ~ScopedUmask() { umask(old_); }

 private:
  mode_t old_;
};

mode_t ModeOf(const std::string& name) {
  struct stat st {};
  if (stat(("/dev/shm" + name).c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

TEST(ShmSegmentTest, CreateThenOpenSharesBytes) {
  const std::string name = UniqueShmName("share");
  auto created = ShmSegment::Create(name, 10000);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ((*created)->name(), name);
  EXPECT_EQ((*created)->size(), 10000u);
  std::memcpy((*created)->data(), "hello", 6);

  auto opened = ShmSegment::Open(name);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->size(), 10000u);  // mapping size = object size
  EXPECT_STREQ(static_cast<const char*>((*opened)->data()), "hello");
  static_cast<char*>((*opened)->data())[9999] = 'x';
  EXPECT_EQ(static_cast<const char*>((*created)->data())[9999], 'x');
}

TEST(ShmSegmentTest, CreateOnTakenNameIsAlreadyExists) {
  const std::string name = UniqueShmName("dup");
  auto first = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = ShmSegment::Create(name, 4096);
  ASSERT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr(name));
  // The failed Create must not have removed the first one's name.
  EXPECT_TRUE(ShmSegment::Open(name).ok());
}

TEST(ShmSegmentTest, OpenMissingIsNotFound) {
  const std::string name = UniqueShmName("missing");
  auto opened = ShmSegment::Open(name);
  ASSERT_EQ(opened.status().code(), absl::StatusCode::kNotFound) << opened.status();
  EXPECT_THAT(opened.status().message(), HasSubstr(name));
}

TEST(ShmSegmentTest, MalformedNamesAreInvalidArgument) {
  const std::string too_long = "/" + std::string(ShmSegment::kMaxNameLength, 'a');
  for (const std::string& bad : {std::string(""), std::string("noslash"), std::string("/"),
                                 std::string("/a/b"), std::string("/.."), too_long}) {
    EXPECT_EQ(ShmSegment::Create(bad, 4096).status().code(), absl::StatusCode::kInvalidArgument)
        << "name: " << bad;
    EXPECT_EQ(ShmSegment::Open(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << "name: " << bad;
  }
  // The longest accepted name works.
  std::string longest = UniqueShmName("long");
  longest.append(ShmSegment::kMaxNameLength - longest.size(), 'z');
  auto created = ShmSegment::Create(longest, 4096);
  EXPECT_TRUE(created.ok()) << created.status();
}

TEST(ShmSegmentTest, ZeroSizeIsRefusedAndLeavesNothing) {
  const std::string name = UniqueShmName("zero");
  EXPECT_EQ(ShmSegment::Create(name, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Open(name).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmSegmentTest, OpenOfUnsizedObjectIsFailedPrecondition) {
  const std::string name = UniqueShmName("unsized");
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  close(fd);
  auto opened = ShmSegment::Open(name);
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kFailedPrecondition) << opened.status();
  shm_unlink(name.c_str());
}

TEST(ShmSegmentTest, DestructorUnlinksUnlessAskedNotTo) {
  const std::string kept = UniqueShmName("kept");
  const std::string dropped = UniqueShmName("dropped");
  {
    auto a = ShmSegment::Create(kept, 4096, {.unlink_on_destroy = false});
    auto b = ShmSegment::Create(dropped, 4096);
    ASSERT_TRUE(a.ok() && b.ok());
  }
  EXPECT_EQ(ShmSegment::Open(dropped).status().code(), absl::StatusCode::kNotFound);
  auto reopened = ShmSegment::Open(kept);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  (*reopened)->Unlink();
  EXPECT_EQ(ShmSegment::Open(kept).status().code(), absl::StatusCode::kNotFound);
}

TEST(ShmSegmentTest, MappingOutlivesUnlink) {
  const std::string name = UniqueShmName("outlive");
  auto creator = ShmSegment::Create(name, 4096);
  ASSERT_TRUE(creator.ok());
  auto peer = ShmSegment::Open(name);
  ASSERT_TRUE(peer.ok());
  (*creator)->Unlink();
  (*creator)->Unlink();  // idempotent
  EXPECT_EQ(ShmSegment::Open(name).status().code(), absl::StatusCode::kNotFound);
  static_cast<int*>((*creator)->data())[0] = 42;
  EXPECT_EQ(static_cast<int*>((*peer)->data())[0], 42);
}

TEST(ShmSegmentTest, ModeIsExactRegardlessOfUmask) {
  for (mode_t mode : {mode_t{0600}, mode_t{0640}, mode_t{0660}, mode_t{0666}}) {
    for (mode_t mask : {mode_t{0}, mode_t{022}, mode_t{077}}) {
      ScopedUmask scoped(mask);
      const std::string name = UniqueShmName("mode");
      auto seg = ShmSegment::Create(name, 4096, {.mode = mode});
      ASSERT_TRUE(seg.ok()) << seg.status();
      EXPECT_EQ(ModeOf(name), mode) << std::oct << "mode " << mode << " umask " << mask;
    }
  }
}

TEST(ShmSegmentTest, FullShmIsResourceExhaustedWithAdvice) {
  struct statvfs fs {};
  ASSERT_EQ(statvfs("/dev/shm", &fs), 0);
  const uint64_t capacity = static_cast<uint64_t>(fs.f_blocks) * fs.f_frsize;
  if (capacity == 0) GTEST_SKIP() << "/dev/shm has no size limit here";
  const std::string name = UniqueShmName("full");
  auto seg = ShmSegment::Create(name, 2 * capacity);
  ASSERT_EQ(seg.status().code(), absl::StatusCode::kResourceExhausted) << seg.status();
  EXPECT_THAT(seg.status().message(), HasSubstr("cannot size " + name));
  EXPECT_THAT(seg.status().message(), HasSubstr("/dev/shm"));
  // The half-made object was removed.
  EXPECT_EQ(ShmSegment::Open(name).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace dos
