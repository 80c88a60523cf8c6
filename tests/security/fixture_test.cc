// The fixture itself: dosd runs as its own user with the unit's umask, a
// trainer of the group attaches, registers and steps, a user outside the
// group cannot reach the socket.
#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"

namespace dos::testing {
namespace {

std::string ProcStatusField(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return line.substr(key.size() + 1);
  }
  return "";
}

TEST(SecurityFixture, DaemonRunsAsItsUserAndOnlyTheGroupReachesIt) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  std::istringstream uid(ProcStatusField(d->pid(), "Uid"));
  uid_t real = 0;
  uid >> real;
  EXPECT_EQ(real, User("dos-sec-d").uid);
  struct stat st;
  ASSERT_EQ(::stat(d->socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, Group("dos-sec"));
  EXPECT_EQ(st.st_mode & 0777, 0660u);

  const std::string a = RunAs(User("dos-sec-a"), d->socket(),
                              {"attach:name=fixture", "register:numel=256", "step:n=2"});
  EXPECT_NE(a.find("OK step step=2"), std::string::npos) << a << d->log();
  const std::string c = RunAs(User("dos-sec-c"), d->socket(), {"attach:name=outsider"});
  EXPECT_NE(c.find("ERR attach"), std::string::npos) << c;
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

}  // namespace
}  // namespace dos::testing
