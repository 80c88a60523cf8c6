// Issue 24, items 5 and 6: the checkpoint store is bounded per uid and
// trusted only where dosd made it. One user's saves beyond --checkpoint_quota
// prune that user's own oldest files (or are refused naming the usage, the
// quota and the fix) while another user saves on; a delete call for the owner
// and operators; per-uid bytes in dosctl stats and the metrics; dosd refuses a
// root it does not own or that others could replace; a uid-<n> folder dosd did
// not make for that uid (the rename attack) is neither restored from nor
// written to.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"
#include "tests/support/loopback.h"

namespace dos::testing {
namespace {

namespace fs = std::filesystem;

constexpr int kPermissionDenied = 7;
constexpr int kResourceExhausted = 8;
constexpr int kFailedPrecondition = 9;

std::string UserDir(const std::string& ck, const std::string& user) {
  return ck + "/uid-" + std::to_string(User(user).uid);
}

// The names of the regular files in `dir` (not the owner marker).
std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    const std::string name = e.path().filename();
    if (e.is_regular_file() && name != ".dos-owner") out.insert(name);
  }
  return out;
}

uint64_t Bytes(const std::string& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

// The "OK <op>" / "ERR <op>" lines of `out` for `op`, in order.
std::vector<std::string> Lines(const std::string& out, const std::string& op) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("OK " + op, 0) == 0 || line.rfind("ERR " + op, 0) == 0) lines.push_back(line);
  }
  return lines;
}

class StoreBounds : public SecureDaemonTest {
 protected:
  std::string Store() const { return daemon_->dir() + "/checkpoints"; }
};

// A 65536-parameter session's checkpoint is 786 KiB: two fit in 2 MiB.
TEST_F(StoreBounds, SavesBeyondTheQuotaPruneTheOwnersOldestAndSpareOtherUsers) {
  DOS_SECURITY_REQUIRE();
  const int metrics = FreeLoopbackPort();
  StartDaemon({"--checkpoint_quota=2M", "--metrics_port=" + std::to_string(metrics)});
  UserProcess victim(
      User("dos-sec-e"), daemon_->socket(),
      {"attach:name=v", "register:numel=65536", "step", "rpc_save:id=self,path=v1.dckpt", "wait",
       "rpc_save:id=self,path=v2.dckpt", "step:n=3"});
  ASSERT_EQ(Code(victim.Await("rpc_save")), 0) << victim.output() << daemon_->log();
  ASSERT_EQ(Code(victim.Await("wait")), 0);
  // The attacker saves five times, then once more than its quota holds.
  const std::string out =
      RunAs(User("dos-sec-a"), daemon_->socket(),
            {"attach:name=job", "register:numel=65536", "step", "rpc_save:id=self,path=p1.dckpt",
             "rpc_save:id=self,path=p2.dckpt", "rpc_save:id=self,path=p3.dckpt",
             "rpc_save:id=self,path=p4.dckpt", "rpc_save:id=self,path=p5.dckpt", "attach:name=big",
             "register:numel=262144", "rpc_save:id=self,path=big.dckpt"});
  const std::vector<std::string> saves = Lines(out, "rpc_save");
  ASSERT_EQ(saves.size(), 6u) << out;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Code(saves[i]), 0) << saves[i] << daemon_->log();
  // Pruned oldest first; never beyond the quota.
  const std::string a_dir = UserDir(Store(), "dos-sec-a");
  EXPECT_EQ(Files(a_dir), (std::set<std::string>{"p4.dckpt", "p5.dckpt"})) << daemon_->log();
  EXPECT_LE(Bytes(a_dir), 2u << 20);
  EXPECT_NE(daemon_->log().find("reason=checkpoint_quota"), std::string::npos) << daemon_->log();
  // 3 MiB alone is more than the quota: refused, naming the numbers and fix.
  EXPECT_EQ(Code(saves[5]), kResourceExhausted) << saves[5];
  EXPECT_NE(saves[5].find("the quota is 2097152 bytes per uid (--checkpoint_quota)"),
            std::string::npos) << saves[5];
  EXPECT_NE(saves[5].find("dosctl checkpoint delete"), std::string::npos) << saves[5];
  // The other user's saves and steps are untouched.
  victim.Continue();
  EXPECT_EQ(Code(victim.Await("rpc_save")), 0) << victim.output() << daemon_->log();
  EXPECT_EQ(Code(victim.Await("step")), 0) << victim.output();
  EXPECT_EQ(Files(UserDir(Store(), "dos-sec-e")), (std::set<std::string>{"v1.dckpt", "v2.dckpt"}));
  // Per-uid usage: dosctl stats and the metrics.
  const std::string stats = RunCommandAs(
      User("dos-sec-e"), {ReachableBinary(DOS_DOSCTL_PATH), "--socket=" + daemon_->socket(),
                          "stats"});
  EXPECT_NE(stats.find("checkpoints uid " + std::to_string(User("dos-sec-a").uid) + ": "),
            std::string::npos) << stats;
  EXPECT_NE(stats.find("of 2.0 MiB allowed"), std::string::npos) << stats;
  const std::string page = HttpGet(metrics, "/metrics");
  EXPECT_NE(page.find("dos_checkpoint_bytes{uid=\"" + std::to_string(User("dos-sec-a").uid) +
                      "\"} "),
            std::string::npos) << page;
  EXPECT_NE(page.find("dos_checkpoint_quota_bytes 2097152"), std::string::npos) << page;
  victim.Finish();
}

TEST_F(StoreBounds, WithoutPruningSavesBeyondTheQuotaAreRefusedAndTheOwnerDeletes) {
  DOS_SECURITY_REQUIRE();
  StartDaemon({"--checkpoint_quota=2M", "--checkpoint_quota_prune=false",
               "--operator_gids=dos-sec-op"});
  const std::string a_uid = std::to_string(User("dos-sec-a").uid);
  const std::string out =
      RunAs(User("dos-sec-a"), daemon_->socket(),
            {"attach:name=job", "register:numel=65536", "step", "rpc_save:id=self,path=p1.dckpt",
             "rpc_save:id=self,path=p2.dckpt", "rpc_save:id=self,path=p3.dckpt"});
  const std::vector<std::string> saves = Lines(out, "rpc_save");
  ASSERT_EQ(saves.size(), 3u) << out;
  EXPECT_EQ(Code(saves[0]), 0) << saves[0] << daemon_->log();
  EXPECT_EQ(Code(saves[1]), 0) << saves[1];
  EXPECT_EQ(Code(saves[2]), kResourceExhausted) << saves[2];
  for (const std::string& part :
       {std::string("uid ") + a_uid + "'s checkpoints use ", std::string("quota is 2097152"),
        std::string("--checkpoint_quota"), std::string("dosctl checkpoint delete")}) {
    EXPECT_NE(saves[2].find(part), std::string::npos) << part << " in " << saves[2];
  }
  const std::string a_dir = UserDir(Store(), "dos-sec-a");
  EXPECT_EQ(Files(a_dir), (std::set<std::string>{"p1.dckpt", "p2.dckpt"}));
  // Another trainer cannot delete them; their owner can.
  const std::string e =
      RunAs(User("dos-sec-e"), daemon_->socket(), {"rpc_delete:path=p1.dckpt,uid=" + a_uid});
  EXPECT_EQ(Code(Lines(e, "rpc_delete").at(0)), kPermissionDenied) << e;
  EXPECT_EQ(Files(a_dir), (std::set<std::string>{"p1.dckpt", "p2.dckpt"}));
  const std::string a = RunAs(User("dos-sec-a"), daemon_->socket(),
                              {"rpc_delete:path=p1.dckpt", "rpc_delete:path=../uid-0"});
  const std::vector<std::string> deletes = Lines(a, "rpc_delete");
  ASSERT_EQ(deletes.size(), 2u) << a;
  EXPECT_EQ(Code(deletes[0]), 0) << deletes[0] << daemon_->log();
  EXPECT_EQ(Field(deletes[0], "files"), "1") << deletes[0];
  EXPECT_EQ(Code(deletes[1]), 3) << deletes[1];  // outside its folder
  EXPECT_EQ(Files(a_dir), (std::set<std::string>{"p2.dckpt"}));
  // An operator deletes any uid's, with dosctl.
  const std::string op = RunCommandAs(
      User("dos-sec-o"), {ReachableBinary(DOS_DOSCTL_PATH), "--socket=" + daemon_->socket(),
                          "checkpoint", "delete", ".", "--uid=" + a_uid});
  EXPECT_NE(op.find("deleted " + a_dir + "/p2.dckpt"), std::string::npos) << op << daemon_->log();
  EXPECT_TRUE(Files(a_dir).empty());
}

TEST_F(StoreBounds, DosdRefusesAStoreItDoesNotOwnOrThatOthersCouldReplace) {
  DOS_SECURITY_REQUIRE();
  // A root another user made (the issue: created in a world-writable folder).
  const std::string parent = DaemonOwnedDir("parent");
  ::chmod(parent.c_str(), 0755);
  const std::string theirs = parent + "/ck";
  fs::create_directory(theirs);
  ::chown(theirs.c_str(), User("dos-sec-a").uid, User("dos-sec-a").gid);
  ::chmod(theirs.c_str(), 0777);
  auto d = SecureDaemon({"--checkpoint_dir=" + theirs});
  EXPECT_FALSE(d->Start()) << d->log();
  EXPECT_NE(d->log().find("--checkpoint_dir=" + theirs + " is owned by uid " +
                          std::to_string(User("dos-sec-a").uid)),
            std::string::npos) << d->log();
  EXPECT_NE(d->log().find("chown " + std::to_string(User("dos-sec-d").uid) + " " + theirs),
            std::string::npos) << d->log();
  // dosd's own root, in a folder everyone may write (no sticky bit).
  const std::string open = DaemonOwnedDir("open");
  ::chmod(open.c_str(), 0777);
  auto d2 = SecureDaemon({"--checkpoint_dir=" + open + "/ck"});
  EXPECT_FALSE(d2->Start()) << d2->log();
  EXPECT_NE(d2->log().find("lies in " + open + ", which every user may write"),
            std::string::npos) << d2->log();
}

// The rename attack of issue 24: another user's folder renamed to the
// victim's uid (by whoever could write the store) is not restored from.
TEST_F(StoreBounds, AFolderDosdDidNotMakeForTheUidIsNotTrusted) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  StartDaemon({"--checkpoint_dir=" + ck});
  const std::string saved = RunAs(User("dos-sec-e"), daemon_->socket(),
                                  {"attach:name=job", "register:numel=256", "step:n=7",
                                   "rpc_save:id=self"});
  ASSERT_EQ(Code(Lines(saved, "rpc_save").at(0)), 0) << saved << daemon_->log();
  StopDaemon();
  const std::string victim_dir = UserDir(ck, "dos-sec-a");
  fs::rename(UserDir(ck, "dos-sec-e"), victim_dir);
  StartDaemon({"--checkpoint_dir=" + ck});
  const std::string a = RunAs(User("dos-sec-a"), daemon_->socket(),
                              {"attach:name=job", "register:numel=256", "rpc_save:id=self"});
  EXPECT_NE(a.find("OK register step=0"), std::string::npos) << a << daemon_->log();
  EXPECT_EQ(daemon_->log().find("session.restored"), std::string::npos) << daemon_->log();
  EXPECT_NE(daemon_->log().find("event=checkpoint.folder_untrusted"), std::string::npos)
      << daemon_->log();
  const std::string save = Lines(a, "rpc_save").at(0);
  EXPECT_EQ(Code(save), kFailedPrecondition) << save;
  EXPECT_NE(save.find(victim_dir + " was made for uid " + std::to_string(User("dos-sec-e").uid)),
            std::string::npos) << save;
  EXPECT_NE(save.find("move it out of " + ck), std::string::npos) << save;
  StopDaemon();
  // A folder its owner made (not dosd), holding a valid checkpoint.
  fs::remove(victim_dir + "/.dos-owner");
  ::chown(victim_dir.c_str(), User("dos-sec-a").uid, User("dos-sec-a").gid);
  StartDaemon({"--checkpoint_dir=" + ck});
  const std::string again =
      RunAs(User("dos-sec-a"), daemon_->socket(), {"attach:name=job", "register:numel=256"});
  EXPECT_NE(again.find("OK register step=0"), std::string::npos) << again << daemon_->log();
  EXPECT_NE(daemon_->log().find("is owned by uid " + std::to_string(User("dos-sec-a").uid)),
            std::string::npos) << daemon_->log();
}

}  // namespace
}  // namespace dos::testing
