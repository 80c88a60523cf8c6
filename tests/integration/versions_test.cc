// Versions through the real dosd: a client that claims an older or a newer
// protocol is refused at Attach with FAILED_PRECONDITION naming both releases,
// both protocols and what to install; ListSessions and dos_daemon_probe report
// the daemon's release and protocol; a registration's progress is readable
// (C ABI, ListSessions) while it runs and idle after.
#include <grpcpp/grpcpp.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "dos/dos.h"
#include "dos/wire/control_block.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/dos/v1/dos.grpc.pb.h"
#include "tests/support/daemon_fixture.h"

namespace dos::testing {
namespace {

using ::testing::HasSubstr;

class VersionsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.Start()) << daemon_.log(); }
  void TearDown() override {
    unsetenv("DOS_TEST_CLAIM_PROTOCOL_VERSION");
    unsetenv("DOS_TEST_CLAIM_CLIENT_VERSION");
  }
  dos_status Attach(dos_session** s) {
    return AttachClient(daemon_.socket(), "versions_test", s);
  }
  std::string DaemonVersion() {
    dos_daemon_info info{};
    EXPECT_EQ(dos_daemon_probe(daemon_.socket().c_str(), 5000, &info), DOS_OK) << dos_last_error();
    return info.version != nullptr ? info.version : "";
  }
  DaemonProcess daemon_{{"--checkpoint_dir="}};
};

TEST_F(VersionsTest, ProbeReportsBothSidesOfOneRelease) {
  dos_daemon_info info{};
  ASSERT_EQ(dos_daemon_probe(daemon_.socket().c_str(), 5000, &info), DOS_OK) << dos_last_error();
  EXPECT_EQ(info.pid, daemon_.pid());
  EXPECT_EQ(info.protocol_version, kProtocolVersion);
  EXPECT_EQ(info.client_protocol_version, kProtocolVersion);
  EXPECT_STREQ(info.version, info.client_version);  // one build, one release
  EXPECT_STREQ(info.health, "SERVING");
  // Nothing listening: UNAVAILABLE naming the socket and the fix.
  const std::string none = daemon_.dir() + "/none.sock";
  EXPECT_EQ(dos_daemon_probe(none.c_str(), 1000, &info), DOS_UNAVAILABLE);
  EXPECT_THAT(dos_last_error(), HasSubstr(none));
  EXPECT_THAT(dos_last_error(), HasSubstr("start the daemon"));
}

TEST_F(VersionsTest, OlderClientIsRefusedNamingBothVersionsAndTheFix) {
  const std::string daemon_version = DaemonVersion();
  setenv("DOS_TEST_CLAIM_PROTOCOL_VERSION", absl::StrCat(kProtocolVersion - 1).c_str(), 1);
  setenv("DOS_TEST_CLAIM_CLIENT_VERSION", "0.0.9", 1);
  dos_session* s = nullptr;
  ASSERT_EQ(Attach(&s), DOS_FAILED_PRECONDITION);
  const std::string msg = dos_last_error();
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("libdos_client 0.0.9 (protocol ", kProtocolVersion - 1)));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("dosd ", daemon_version, " (protocol ",
                                          kProtocolVersion, ")")));
  EXPECT_THAT(msg, HasSubstr("older than the daemon"));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("pip install dos-optimizer==", daemon_version)));
}

TEST_F(VersionsTest, NewerClientIsRefusedNamingBothVersionsAndTheFix) {
  const std::string daemon_version = DaemonVersion();
  setenv("DOS_TEST_CLAIM_PROTOCOL_VERSION", absl::StrCat(kProtocolVersion + 1).c_str(), 1);
  setenv("DOS_TEST_CLAIM_CLIENT_VERSION", "9.9.9", 1);
  dos_session* s = nullptr;
  ASSERT_EQ(Attach(&s), DOS_FAILED_PRECONDITION);
  const std::string msg = dos_last_error();
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("libdos_client 9.9.9 (protocol ", kProtocolVersion + 1)));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("dosd ", daemon_version)));
  EXPECT_THAT(msg, HasSubstr("newer than the daemon"));
  EXPECT_THAT(msg, HasSubstr("Upgrade dosd on this node to the client's release"));
  EXPECT_THAT(msg, HasSubstr("dos package of 9.9.9"));
}

TEST_F(VersionsTest, RawAttachWithoutAReleaseIsCalledOlderThanTheFirst) {
  auto stub = v1::Dos::NewStub(grpc::CreateChannel(absl::StrCat("unix:", daemon_.socket()),
                                                   grpc::InsecureChannelCredentials()));
  v1::AttachRequest req;
  req.set_pid(getpid());
  req.set_protocol_version(1);
  v1::AttachResponse resp;
  grpc::ClientContext ctx;
  grpc::Status st = stub->Attach(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("a client library older than DOS 0.1.0 (protocol 1)"));
  v1::ListSessionsResponse list;
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub->ListSessions(&ctx2, v1::ListSessionsRequest(), &list).ok());
  EXPECT_EQ(list.protocol_version(), kProtocolVersion);
  EXPECT_EQ(list.sessions_size(), 0);  // nothing attached
}

TEST_F(VersionsTest, RegistrationProgressIsReadableWhileItRunsAndIdleAfter) {
  dos_session* s = nullptr;
  ASSERT_EQ(Attach(&s), DOS_OK) << dos_last_error();
  constexpr uint64_t kNumel = uint64_t{48} << 20;  // 576 MiB of state
  void *p = nullptr, *g = nullptr;
  ASSERT_EQ(dos_buffer_alloc(s, kNumel * 2, &p), DOS_OK);
  ASSERT_EQ(dos_buffer_alloc(s, kNumel * 2, &g), DOS_OK);
  dos_tensor t{"w", DOS_DTYPE_BF16, p, DOS_DTYPE_BF16, g, kNumel, 0};
  dos_hparams h;
  dos_hparams_init_adamw(&h);
  auto stub = v1::Dos::NewStub(grpc::CreateChannel(absl::StrCat("unix:", daemon_.socket()),
                                                   grpc::InsecureChannelCredentials()));
  std::atomic<bool> done{false};
  int samples = 0, listed = 0;
  std::string bad;
  std::thread watcher([&] {
    while (!done.load()) {
      dos_register_progress pr{};
      if (dos_register_progress_read(s, &pr) != DOS_OK) bad = dos_last_error();
      if (pr.phase != 0) {
        ++samples;
        if (pr.bytes_done > pr.bytes_total || pr.phase > 3 || pr.phase_name[0] == '\0' ||
            pr.total_seconds + 1e-9 < pr.phase_seconds) {
          bad = absl::StrCat("inconsistent progress: phase ", pr.phase, " ", pr.bytes_done, "/",
                             pr.bytes_total);
        }
      }
      v1::ListSessionsResponse list;
      grpc::ClientContext ctx;
      if (stub->ListSessions(&ctx, v1::ListSessionsRequest(), &list).ok() &&
          list.sessions_size() == 1 && list.sessions(0).state() == "registering") {
        const v1::RegisterProgress& rp = list.sessions(0).register_progress();
        if (rp.phase().empty() || rp.bytes_done() > rp.bytes_total()) bad = "bad ListSessions";
        ++listed;
      }
    }
  });
  const auto t0 = std::chrono::steady_clock::now();
  const dos_status st = dos_register(s, &t, 1, &h, 1, nullptr);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  done = true;
  watcher.join();
  ASSERT_EQ(st, DOS_OK) << dos_last_error();
  EXPECT_EQ(bad, "");
  // Whether a sample fell inside the registration depends on the machine's
  // speed; one that took this long was seen.
  if (secs > 0.5) {
    EXPECT_GT(samples, 0) << secs << " s";
  }
  std::printf("registration %.2f s: %d progress samples, %d ListSessions while registering\n",
              secs, samples, listed);
  dos_register_progress after{};
  ASSERT_EQ(dos_register_progress_read(s, &after), DOS_OK);
  EXPECT_EQ(after.phase, 0);
  EXPECT_STREQ(after.phase_name, "");
  dos_detach(s);
}

}  // namespace
}  // namespace dos::testing
