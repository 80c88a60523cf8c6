// The C ABI and the dos.hpp wrapper where no daemon is needed.
#include <cstdlib>
#include <string>

#include "dos/dos.h"
#include "dos/dos.hpp"
#include "dos/version.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;

TEST(CApiTest, AttachWithoutDaemonNamesSocketAndFix) {
  dos_attach_options o;
  dos_attach_options_init(&o);
  o.socket_path = "/nonexistent/dosd.sock";
  dos_session* s = reinterpret_cast<dos_session*>(1);
  EXPECT_EQ(dos_attach(&o, &s), DOS_UNAVAILABLE);
  EXPECT_EQ(s, nullptr);
  EXPECT_THAT(dos_last_error(), HasSubstr("/nonexistent/dosd.sock"));
  EXPECT_THAT(dos_last_error(), HasSubstr("DOS_SOCKET"));
}

TEST(CApiTest, VersionIsTheProjectVersion) {
  // One version: CMake's project(VERSION), through the generated dos/version.h.
  EXPECT_STREQ(dos_version(), DOS_VERSION_STRING);
  EXPECT_THAT(std::string(dos_version()), ::testing::MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
}

TEST(CApiTest, NullArguments) {
  EXPECT_EQ(dos_detach(nullptr), DOS_OK);
  void* p;
  EXPECT_EQ(dos_buffer_alloc(nullptr, 64, &p), DOS_INVALID_ARGUMENT);
  EXPECT_THAT(dos_last_error(), HasSubstr("session is NULL"));
  EXPECT_EQ(dos_step(nullptr, nullptr, nullptr), DOS_INVALID_ARGUMENT);
  EXPECT_EQ(dos_session_id(nullptr), 0u);
  EXPECT_EQ(dos_state_read_range(nullptr, 0, 0, 1, nullptr, nullptr, nullptr, nullptr),
            DOS_INVALID_ARGUMENT);
  EXPECT_THAT(dos_last_error(), HasSubstr("state_read_range"));
  EXPECT_EQ(dos_state_write_range(nullptr, 0, 0, 1, nullptr, nullptr, nullptr, 0),
            DOS_INVALID_ARGUMENT);
  EXPECT_THAT(dos_last_error(), HasSubstr("session is NULL"));
}

TEST(CApiTest, DefaultSocketFollowsEnvironment) {
  unsetenv("DOS_SOCKET");
  EXPECT_STREQ(dos_default_socket(), "/run/dos/dosd.sock");
  setenv("DOS_SOCKET", "/tmp/x.sock", 1);
  EXPECT_STREQ(dos_default_socket(), "/tmp/x.sock");
  unsetenv("DOS_SOCKET");
}

TEST(CppWrapperTest, AttachErrorIsAValue) {
  dos::AttachOptions o;
  o.socket_path = "/nonexistent/dosd.sock";
  auto s = dos::Session::Attach(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().code, DOS_UNAVAILABLE);
  EXPECT_THAT(s.error().message, HasSubstr("start the daemon"));
}

}  // namespace
