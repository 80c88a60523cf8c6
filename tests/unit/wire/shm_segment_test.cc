#include "dos/wire/shm_segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/wire/test_util.h"

namespace dos {
namespace {

using ::dos::testing::ForkPeer;
using ::dos::testing::WaitExit;
using ::testing::HasSubstr;

// Number of /dev/shm entries whose name starts with `prefix`.
int DevShmEntries(const std::string& prefix) {
  int n = 0;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return 0;
  while (dirent* e = readdir(d)) n += std::string(e->d_name).rfind(prefix, 0) == 0;
  closedir(d);
  return n;
}

UniqueFd Dup(int fd) { return UniqueFd(fcntl(fd, F_DUPFD_CLOEXEC, 0)); }

TEST(ShmSegmentTest, CreateMapsASealedMemfdAndNamesNothingInDevShm) {
  const int before = DevShmEntries("dos");
  auto seg = ShmSegment::Create("dos.test.create", 10000);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_GE((*seg)->size(), 10000u);
  EXPECT_GE((*seg)->fd(), 0);
  std::memset((*seg)->data(), 0x5a, 10000);
  EXPECT_EQ(fcntl((*seg)->fd(), F_GET_SEALS) & ShmSegment::kRequiredSeals,
            ShmSegment::kRequiredSeals);
  EXPECT_TRUE(ShmSegment::CheckSealed((*seg)->fd(), "seg").ok());
  EXPECT_EQ(DevShmEntries("dos"), before);
}

TEST(ShmSegmentTest, AdoptSharesBytesAndDropsTheDescriptor) {
  auto created = ShmSegment::Create("dos.test.adopt", 8192);
  ASSERT_TRUE(created.ok()) << created.status();
  auto adopted = ShmSegment::Adopt(Dup((*created)->fd()), "peer");
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  EXPECT_EQ((*adopted)->size(), 8192u);
  EXPECT_EQ((*adopted)->fd(), -1);
  static_cast<char*>((*created)->data())[100] = 42;
  EXPECT_EQ(static_cast<char*>((*adopted)->data())[100], 42);
}

// The SIGBUS a peer could cause by shrinking shared memory under a mapping:
// the seals make it impossible, here and across a fork.
TEST(ShmSegmentTest, SealedSegmentCannotBeResized) {
  auto seg = ShmSegment::Create("dos.test.seal", 4096);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(ftruncate((*seg)->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(ftruncate((*seg)->fd(), 1 << 20), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(fcntl((*seg)->fd(), F_ADD_SEALS, F_SEAL_WRITE), -1);  // F_SEAL_SEAL
  const int fd = (*seg)->fd();
  pid_t peer = ForkPeer([fd] { return ftruncate(fd, 0) == -1 && errno == EPERM ? 0 : 1; });
  EXPECT_EQ(WaitExit(peer), 0);
  static_cast<char*>((*seg)->data())[4095] = 1;  // still mapped, no SIGBUS
}

TEST(ShmSegmentTest, UnsealedMemfdIsRefusedNamingTheSeal) {
  UniqueFd fd(memfd_create("dos.test.unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(ftruncate(fd.get(), 4096), 0);
  auto a = ShmSegment::Adopt(Dup(fd.get()), "segment 0");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(), HasSubstr("F_SEAL_SHRINK"));
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  a = ShmSegment::Adopt(Dup(fd.get()), "segment 0");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(), HasSubstr("F_SEAL_SEAL"));
  // Not sealable at all (no MFD_ALLOW_SEALING: born with F_SEAL_SEAL only).
  UniqueFd plain(memfd_create("dos.test.plain", MFD_CLOEXEC));
  ASSERT_EQ(ftruncate(plain.get(), 4096), 0);
  EXPECT_EQ(ShmSegment::Adopt(std::move(plain), "plain").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(ShmSegmentTest, WriteSealedAndEmptyMemfdsAreRefused) {
  UniqueFd fd(memfd_create("dos.test.ro", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(ftruncate(fd.get(), 4096), 0);
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, ShmSegment::kRequiredSeals | F_SEAL_WRITE), 0);
  auto a = ShmSegment::Adopt(std::move(fd), "ro");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(a.status().message(), HasSubstr("writes"));
  UniqueFd empty(memfd_create("dos.test.empty", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(fcntl(empty.get(), F_ADD_SEALS, ShmSegment::kRequiredSeals), 0);
  EXPECT_EQ(ShmSegment::Adopt(std::move(empty), "empty").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// A read-only descriptor of a sealed memfd (such as dosd's own state view,
// sent back as a buffer) is refused up front, naming why, instead of failing
// later as an unexplained mapping error.
TEST(ShmSegmentTest, AReadOnlyDescriptorIsRefusedNamingIt) {
  UniqueFd fd(memfd_create("dos.test.rdonly", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(ftruncate(fd.get(), 4096), 0);
  ASSERT_EQ(fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  UniqueFd ro(::open(("/proc/self/fd/" + std::to_string(fd.get())).c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(ro.valid());
  const absl::Status st = ShmSegment::CheckSealed(ro.get(), "segment 0");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("read-only"), std::string::npos) << st;
  EXPECT_TRUE(ShmSegment::CheckSealed(fd.get(), "segment 0").ok());
}

TEST(ShmSegmentTest, FilesPipesAndSocketsAreNotMemfds) {
  char path[] = "/tmp/dos_shm_test.XXXXXX";
  UniqueFd file(mkstemp(path));
  ASSERT_TRUE(file.valid());
  unlink(path);
  ASSERT_EQ(ftruncate(file.get(), 4096), 0);
  EXPECT_EQ(ShmSegment::Adopt(std::move(file), "file").status().code(),
            absl::StatusCode::kInvalidArgument);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd r(p[0]), w(p[1]);
  auto a = ShmSegment::Adopt(std::move(r), "pipe");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("memfd"));
  EXPECT_EQ(ShmSegment::Adopt(UniqueFd(), "none").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ShmSegmentTest, ZeroAndHugeSizesAreRefused) {
  EXPECT_EQ(ShmSegment::Create("dos.test.zero", 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShmSegment::Create("dos.test.huge", ~uint64_t{0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dos
