// Issue 11, item 4: identity from the kernel on every call. A session belongs
// to the uid that attached it; only that uid or an operator (root, dosd's uid,
// --operator_gids) may act on it, whatever the caller knows (id, token); the
// TCP listener, which carries no identity, only reads.
#include <unistd.h>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"
#include "tests/support/loopback.h"

namespace dos::testing {
namespace {

constexpr int kPermissionDenied = 7;
constexpr int kInvalidArgument = 3;

SecUser Root() {
  SecUser r;
  r.name = "root";
  return r;
}

// A trainer of dos-sec-a holding a registered session until the test ends.
class IdentityTest : public SecureDaemonTest {
 protected:
  void StartVictim(std::vector<std::string> flags = {}) {
    ASSERT_NO_FATAL_FAILURE(StartDaemon(std::move(flags)));
    victim_ = std::make_unique<UserProcess>(
        User("dos-sec-a"), daemon_->socket(),
        std::vector<std::string>{"attach:name=victim", "register:numel=256", "step:n=2", "wait"});
    const std::string attach = victim_->Await("attach");
    ASSERT_EQ(Code(attach), 0) << attach << daemon_->log();
    id_ = Field(attach, "id");
    token_ = Field(attach, "token");
    ASSERT_EQ(Code(victim_->Await("step")), 0) << victim_->output() << daemon_->log();
    ASSERT_EQ(Code(victim_->Await("wait")), 0);
  }
  void TearDown() override {
    victim_.reset();
    SecureDaemonTest::TearDown();
  }
  // The victim's step count as its owner reads it (stats are public).
  std::string Line(const SecUser& u, const std::string& op) {
    const std::string out = RunAs(u, daemon_->socket(), {op});
    return out.substr(0, out.find('\n'));
  }

  std::unique_ptr<UserProcess> victim_;
  std::string id_;
  std::string token_;
};

TEST_F(IdentityTest, AnotherUserCannotSaveOrLoadASessionById) {
  DOS_SECURITY_REQUIRE();
  StartVictim();
  const SecUser b = User("dos-sec-b");
  const std::string save = Line(b, "rpc_save:id=" + id_);
  EXPECT_EQ(Code(save), kPermissionDenied) << save;
  EXPECT_NE(save.find("belongs to uid " + std::to_string(User("dos-sec-a").uid)),
            std::string::npos) << save;
  EXPECT_NE(save.find("--operator_gids"), std::string::npos) << save;
  const std::string load = Line(b, "rpc_load:id=" + id_ + ",path=.");
  EXPECT_EQ(Code(load), kPermissionDenied) << load;
  // The victim's own save still works and its state is untouched.
  EXPECT_EQ(Code(Line(User("dos-sec-a"), "rpc_save:id=" + id_)), 0) << daemon_->log();
}

TEST_F(IdentityTest, AStolenTokenIsUselessToAnotherUser) {
  DOS_SECURITY_REQUIRE();
  StartVictim();
  const SecUser b = User("dos-sec-b");
  for (const std::string op : {"rpc_policy", "rpc_detach", "rpc_export", "rpc_import"}) {
    const std::string line = Line(b, op + ":id=" + id_ + ",token=" + token_);
    EXPECT_EQ(Code(line), kPermissionDenied) << op << ": " << line;
  }
  const std::string policy = Line(b, "rpc_policy:id=" + id_ + ",policy=cpu");
  EXPECT_EQ(Code(policy), kPermissionDenied) << policy;
  // Still attached.
  EXPECT_NE(victim_->output().find("OK wait"), std::string::npos);
  const std::string list = Line(Root(), "rpc_list");
  EXPECT_EQ(Field(list, "sessions"), "1") << list << daemon_->log();
}

TEST_F(IdentityTest, TheOwnerAndOperatorsMayActOnASession) {
  DOS_SECURITY_REQUIRE();
  StartVictim({"--operator_gids=dos-sec-op"});
  // Another process of the same user (dosctl, a second tool).
  EXPECT_EQ(Code(Line(User("dos-sec-a"), "rpc_policy:id=" + id_ + ",policy=cpu")), 0);
  // An operator by group, root, and the daemon's own user.
  EXPECT_EQ(Code(Line(User("dos-sec-o"), "rpc_save:id=" + id_)), 0) << daemon_->log();
  EXPECT_EQ(Code(Line(Root(), "rpc_load:id=" + id_ + ",path=.")), 0) << daemon_->log();
  EXPECT_EQ(Code(Line(User("dos-sec-d"), "rpc_policy:id=" + id_ + ",policy=auto")), 0);
}

TEST_F(IdentityTest, CallsOnEverySessionNeedAnOperator) {
  DOS_SECURITY_REQUIRE();
  StartVictim({"--operator_gids=dos-sec-op"});
  const SecUser b = User("dos-sec-b");
  const std::string save_all = Line(b, "rpc_save:id=0");
  EXPECT_EQ(Code(save_all), kPermissionDenied) << save_all;
  EXPECT_NE(save_all.find("needs an operator"), std::string::npos) << save_all;
  EXPECT_EQ(Code(Line(b, "rpc_policy:id=0,policy=cpu")), kPermissionDenied);
  EXPECT_EQ(Code(Line(b, "rpc_load:id=0,path=.")), kPermissionDenied);
  EXPECT_EQ(Code(Line(User("dos-sec-o"), "rpc_save:id=0")), 0) << daemon_->log();
  EXPECT_EQ(Code(Line(User("dos-sec-o"), "rpc_policy:id=0,policy=auto")), 0);
}

TEST_F(IdentityTest, ResumeByAnotherUserIsRefused) {
  DOS_SECURITY_REQUIRE();
  StartVictim({"--session_lease=60s"});
  victim_->Kill();  // the trainer dies; its state waits for a resume
  ASSERT_TRUE(WaitFor([&] {
    return daemon_->log().find("session.orphaned") != std::string::npos;
  }, 10000)) << daemon_->log();
  const std::string b = Line(User("dos-sec-b"), "rpc_resume:id=" + id_ + ",token=" + token_);
  EXPECT_EQ(Code(b), kPermissionDenied) << b;
  EXPECT_NE(b.find("resumed by the user who attached it"), std::string::npos) << b;
  const std::string a = Line(User("dos-sec-a"), "rpc_resume:id=" + id_ + ",token=" + token_);
  EXPECT_EQ(Code(a), 0) << a << daemon_->log();
}

TEST_F(IdentityTest, TheTcpListenerOnlyReads) {
  DOS_SECURITY_REQUIRE();
  const std::string tcp = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
  StartVictim({"--tcp_listen=" + tcp});
  const SecUser c = User("dos-sec-c");  // outside the group: only TCP reaches dosd
  const std::string target = "tcp:" + tcp;
  const std::string out = RunAs(c, target,
                                {"rpc_stats", "rpc_list", "rpc_save:id=" + id_,
                                 "rpc_load:id=" + id_ + ",path=.", "rpc_policy:id=" + id_,
                                 "rpc_attach:name=tcp"});
  EXPECT_NE(out.find("OK rpc_stats"), std::string::npos) << out;
  EXPECT_NE(out.find("ERR rpc_list code=7"), std::string::npos) << out;  // job names, pids
  EXPECT_NE(out.find("ERR rpc_save code=7"), std::string::npos) << out;
  EXPECT_NE(out.find("ERR rpc_load code=7"), std::string::npos) << out;
  EXPECT_NE(out.find("ERR rpc_policy code=7"), std::string::npos) << out;
  EXPECT_NE(out.find("ERR rpc_attach code=7"), std::string::npos) << out;
  EXPECT_NE(out.find("--tcp_operator_calls"), std::string::npos) << out;
}

TEST_F(IdentityTest, TcpOperatorCallsOnlyWhenConfigured) {
  DOS_SECURITY_REQUIRE();
  const std::string tcp = "127.0.0.1:" + std::to_string(FreeLoopbackPort());
  StartVictim({"--tcp_listen=" + tcp, "--tcp_operator_calls"});
  const std::string out = RunAs(User("dos-sec-c"), "tcp:" + tcp, {"rpc_save:id=" + id_});
  EXPECT_NE(out.find("OK rpc_save"), std::string::npos) << out << daemon_->log();
}

TEST_F(IdentityTest, DosctlOfAnotherUserIsRefusedWithTheFix) {
  DOS_SECURITY_REQUIRE();
  StartVictim();
  const std::string dosctl = ReachableBinary(DOS_DOSCTL_PATH);
  const std::string out =
      RunCommandAs(User("dos-sec-b"), {dosctl, "--socket=" + daemon_->socket(), "checkpoint",
                                       "save", id_});
  EXPECT_NE(out.find("belongs to uid " + std::to_string(User("dos-sec-a").uid)),
            std::string::npos) << out;
  EXPECT_NE(out.find("neither its owner nor an operator"), std::string::npos) << out;
  const std::string policy =
      RunCommandAs(User("dos-sec-b"), {dosctl, "--socket=" + daemon_->socket(), "policy", "set",
                                       id_, "cpu"});
  EXPECT_NE(policy.find("belongs to uid"), std::string::npos) << policy;
  // Reading is open to the group: status and sessions work.
  const std::string sessions =
      RunCommandAs(User("dos-sec-b"), {dosctl, "--socket=" + daemon_->socket(), "sessions"});
  EXPECT_NE(sessions.find("victim"), std::string::npos) << sessions;
}

// The allow lists are judged on the attaching process's kernel credentials
// (its descriptor socket Hello, SO_PEERCRED + SO_PEERGROUPS), supplementary
// groups included; everyone else is refused naming the lists, and a ticket
// of an allowed process is no use to another user.
TEST(AllowLists, SupplementaryGroupsAdmitAndOthersAreRefusedNamingTheLists) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--allow_gids=" + std::to_string(Group("dos-sec-op"))});
  ASSERT_TRUE(d->Start()) << d->log();
  // dos-sec-o is in dos-sec-op by supplementary membership only.
  const std::string o = RunAs(User("dos-sec-o"), d->socket(), {"attach", "register:numel=256"});
  EXPECT_NE(o.find("OK register"), std::string::npos) << o << d->log();
  const std::string a = RunAs(User("dos-sec-a"), d->socket(), {"attach"});
  EXPECT_EQ(Code(a), kPermissionDenied) << a;
  EXPECT_NE(a.find("--allow_gids=" + std::to_string(Group("dos-sec-op"))), std::string::npos)
      << a;
  EXPECT_NE(a.find("uid " + std::to_string(User("dos-sec-a").uid)), std::string::npos) << a;
  EXPECT_EQ(::access((d->socket() + ".auth").c_str(), F_OK), -1) << "no second ticket socket";
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

}  // namespace
}  // namespace dos::testing
