// Issue 11, items 5 and 6: a checkpoint store per owner. Files are 0600 and
// dosd's under <checkpoint_dir>/uid-<uid>/ (0700); temporaries are created
// exclusively and never through a link; scans never follow links; paths
// cannot leave the owner's folder; restore is keyed on (uid, name, rank).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"

namespace dos::testing {
namespace {

namespace fs = std::filesystem;

constexpr int kInvalidArgument = 3;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void MkdirOwned(const std::string& path) {
  fs::create_directories(path);
  const SecUser d = User("dos-sec-d");
  for (fs::path p = path; p.filename() != "checkpoints" && p.has_parent_path();
       p = p.parent_path()) {
    ::chown(p.c_str(), d.uid, d.gid);
    ::chmod(p.c_str(), 0700);
  }
}

// Marks `dir` (an owner's folder <store>/uid-<uid> made by the test) as dosd
// marks the folders it makes, so dosd trusts it (UserFolders).
void MarkOwned(const std::string& dir, const std::string& user) {
  const std::string marker = dir + "/.dos-owner";
  std::ofstream(marker) << User(user).uid << "\n";
  const SecUser d = User("dos-sec-d");
  ::chown(marker.c_str(), d.uid, d.gid);
  ::chmod(marker.c_str(), 0600);
}

// "a/a/.../" with `n` folders.
std::string Deep(int n) {
  std::string p;
  for (int i = 0; i < n; ++i) p += "a/";
  return p;
}

// The names in `dir` and their contents.
std::map<std::string, std::string> Contents(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename()] = ReadAll(e.path());
  return out;
}

// Whether one line of `log` has every one of `parts`.
bool LogLineHas(const std::string& log, std::vector<std::string> parts) {
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);) {
    bool all = true;
    for (const std::string& p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return true;
  }
  return false;
}

std::string UserDir(const std::string& ck, const std::string& user) {
  return ck + "/uid-" + std::to_string(User(user).uid);
}

// Victims and saves around SecureDaemonTest's dosd.
class CheckpointStore : public SecureDaemonTest {
 protected:
  // A file only dosd's user may write, holding "precious".
  std::string Victim() {
    std::string dir = DaemonOwnedDir("victim");
    ::chmod(dir.c_str(), 0755);
    const std::string path = dir + "/victim";
    std::ofstream(path) << "precious";
    const SecUser d = User("dos-sec-d");
    ::chown(path.c_str(), d.uid, d.gid);
    return path;
  }

  // dosd with the store `ck`; dos-sec-a's job "job" takes `steps` steps and
  // saves; dosd stops. The "OK rpc_save ..." line ("" and a failure if none).
  std::string SaveInStore(const std::string& ck, int steps) {
    StartDaemon({"--checkpoint_dir=" + ck});
    if (HasFatalFailure()) return "";
    const std::string out = RunAs(User("dos-sec-a"), daemon_->socket(),
                                  {"attach:name=job", "register:numel=256",
                                   "step:n=" + std::to_string(steps), "rpc_save:id=self"});
    const size_t at = out.find("OK rpc_save");
    EXPECT_NE(at, std::string::npos) << out << daemon_->log();
    StopDaemon();
    return at == std::string::npos ? "" : out.substr(at, out.find('\n', at) - at);
  }
};

TEST_F(CheckpointStore, FilesArePrivateToDosd) {
  DOS_SECURITY_REQUIRE();
  StartDaemon();
  const std::string out = RunAs(User("dos-sec-a"), daemon_->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=2",
                                 "rpc_save:id=self"});
  ASSERT_NE(out.find("OK rpc_save"), std::string::npos) << out << daemon_->log();
  const std::string path = Field(out.substr(out.find("OK rpc_save")), "path");
  EXPECT_EQ(path.rfind(UserDir(daemon_->dir() + "/checkpoints", "dos-sec-a") + "/", 0), 0u) << path;
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, User("dos-sec-d").uid);
  for (fs::path p = fs::path(path).parent_path(); p != fs::path(daemon_->dir());
       p = p.parent_path()) {
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u) << p;
  }
  // Another trainer of the group can neither read nor delete it.
  const std::string cat = RunCommandAs(User("dos-sec-b"), {"/bin/cat", path});
  EXPECT_NE(cat.find("Permission denied"), std::string::npos) << cat;
  RunCommandAs(User("dos-sec-b"), {"/bin/rm", "-f", path});
  EXPECT_TRUE(fs::exists(path));
}

TEST_F(CheckpointStore, PlantedSymlinksAreNeverFollowed) {
  DOS_SECURITY_REQUIRE();
  StartDaemon();
  const std::string victim = Victim();
  const std::string ck = daemon_->dir() + "/checkpoints";
  // Links at every temporary name the first save could use, in the job's
  // folder (and where older dosd versions put it).
  for (const std::string& dir : {UserDir(ck, "dos-sec-a") + "/job.r-1", ck + "/job.r-1"}) {
    MkdirOwned(dir);
    if (dir.find("/uid-") != std::string::npos) MarkOwned(UserDir(ck, "dos-sec-a"), "dos-sec-a");
    for (int n = 0; n < 16; ++n) {
      // (Session 1: the daemon's first.)
      fs::create_symlink(victim, dir + "/step-000000000002.s1.dckpt.tmp." +
                                     std::to_string(daemon_->pid()) + "." + std::to_string(n));
    }
  }
  // A link where a trainer names its checkpoint.
  fs::create_symlink(fs::path(victim).parent_path(), UserDir(ck, "dos-sec-a") + "/out");
  const std::string out = RunAs(User("dos-sec-a"), daemon_->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=2",
                                 "rpc_save:id=self", "rpc_save:id=self,path=out/x.dckpt"});
  EXPECT_NE(out.find("OK rpc_save path=" + UserDir(ck, "dos-sec-a") + "/job.r-1/step-"),
            std::string::npos) << out << daemon_->log();
  EXPECT_NE(out.find("ERR rpc_save code=3"), std::string::npos) << out;
  EXPECT_NE(out.find("is a symlink"), std::string::npos) << out;
  EXPECT_EQ(ReadAll(victim), "precious");
  EXPECT_FALSE(fs::exists(fs::path(victim).parent_path() / "x.dckpt"));
}

TEST_F(CheckpointStore, PathsCannotLeaveTheOwnersFolder) {
  DOS_SECURITY_REQUIRE();
  StartDaemon();
  const std::string victim = Victim();
  // Older dosd versions wrote "." as <dir>.tmp.<pid>.<n> beside the folder.
  for (int n = 0; n < 4; ++n) {
    fs::create_symlink(victim, daemon_->dir() + "/checkpoints.tmp." +
                                   std::to_string(daemon_->pid()) + "." + std::to_string(n));
  }
  const std::string out = RunAs(User("dos-sec-a"), daemon_->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=1",
                                 "rpc_save:id=self,path=.", "rpc_save:id=self,path=../x.dckpt",
                                 "rpc_save:id=self,path=a/../../x.dckpt",
                                 "rpc_save:id=self,path=/tmp/x.dckpt",
                                 // Deeper than a checkpoint path may go (a scan
                                 // of the store must not recurse without end).
                                 "rpc_save:id=self,path=" + Deep(40) + "x.dckpt",
                                 "rpc_load:id=self,token=self,path=../uid-0"});
  const std::string user_dir = UserDir(daemon_->dir() + "/checkpoints", "dos-sec-a");
  EXPECT_NE(out.find("OK rpc_save path=" + user_dir + "/job.r-1.s"), std::string::npos)
      << out << daemon_->log();
  size_t refused = 0;
  for (size_t at = 0; (at = out.find("ERR rpc_save code=3", at)) != std::string::npos; ++at) {
    ++refused;
  }
  EXPECT_EQ(refused, 4u) << out;
  EXPECT_NE(out.find("a checkpoint path has at most"), std::string::npos) << out;
  EXPECT_NE(out.find("ERR rpc_load code=3"), std::string::npos) << out;
  EXPECT_EQ(ReadAll(victim), "precious");
  EXPECT_FALSE(fs::exists(daemon_->dir() + "/x.dckpt"));
  EXPECT_FALSE(fs::exists("/tmp/x.dckpt"));
}

TEST_F(CheckpointStore, RestoreScanDoesNotFollowSymlinks) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  const std::string saved = SaveInStore(ck, 3);
  ASSERT_FALSE(saved.empty());
  const std::string path = Field(saved, "path");
  // The file moves out of the store; a link to it stays where it was.
  const std::string outside = DaemonOwnedDir("outside") + "/moved.dckpt";
  fs::rename(path, outside);
  fs::create_symlink(outside, path);
  // And a linked folder.
  fs::create_directory_symlink(fs::path(outside).parent_path(),
                               UserDir(ck, "dos-sec-a") + "/linked");
  StartDaemon({"--checkpoint_dir=" + ck});
  const std::string out = RunAs(User("dos-sec-a"), daemon_->socket(),
                                {"attach:name=job", "register:numel=256"});
  EXPECT_NE(out.find("OK register step=0"), std::string::npos) << out << daemon_->log();
  EXPECT_EQ(daemon_->log().find("session.restored"), std::string::npos) << daemon_->log();
}

TEST_F(CheckpointStore, RestoreIsKeyedByTheOwnersUid) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  ASSERT_FALSE(SaveInStore(ck, 3).empty());
  StartDaemon({"--checkpoint_dir=" + ck});
  // Another user claims the same job name and rank first: it starts fresh.
  const std::string e = RunAs(User("dos-sec-e"), daemon_->socket(),
                              {"attach:name=job", "register:numel=256"});
  EXPECT_NE(e.find("OK register step=0"), std::string::npos) << e << daemon_->log();
  const std::string a = RunAs(User("dos-sec-a"), daemon_->socket(),
                              {"attach:name=job", "register:numel=256"});
  EXPECT_NE(a.find("OK register step=3"), std::string::npos) << a << daemon_->log();
}

TEST_F(CheckpointStore, AutosavesOfTwoUsersWithTheDefaultNameStayApart) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  const std::vector<std::string> flags = {"--checkpoint_dir=" + ck, "--autosave_interval=200ms",
                                          "--autosave_keep=1"};
  {
    StartDaemon(flags);
    UserProcess a(User("dos-sec-a"), daemon_->socket(),
                  {"attach", "register:numel=256", "step:n=3", "wait"});
    UserProcess e(User("dos-sec-e"), daemon_->socket(),
                  {"attach", "register:numel=256", "step:n=5", "wait"});
    ASSERT_EQ(Code(a.Await("wait")), 0) << a.output() << daemon_->log();
    ASSERT_EQ(Code(e.Await("wait")), 0) << e.output() << daemon_->log();
    // An autosave of each at its final step, in its owner's folder.
    ASSERT_TRUE(WaitFor([&] {
      const std::string log = daemon_->log();
      return log.find(UserDir(ck, "dos-sec-a") + "/sec.r-1/auto-000000000003.s") !=
                 std::string::npos &&
             log.find(UserDir(ck, "dos-sec-e") + "/sec.r-1/auto-000000000005.s") !=
                 std::string::npos;
    }, 20000)) << daemon_->log();
    StopDaemon();  // trainers still attached: final autosave
  }
  StartDaemon(flags);
  const std::string e =
      RunAs(User("dos-sec-e"), daemon_->socket(), {"attach", "register:numel=256"});
  const std::string a =
      RunAs(User("dos-sec-a"), daemon_->socket(), {"attach", "register:numel=256"});
  EXPECT_NE(e.find("OK register step=5"), std::string::npos) << e << daemon_->log();
  EXPECT_NE(a.find("OK register step=3"), std::string::npos) << a << daemon_->log();
}

// One user's trainer that begins an early step and never gives its verdict
// (stalled, or hostile) holds only its own session. dosd saves one session at
// a time for every user: another user's save goes through at once, and the
// stalled user's save of its own session fails within seconds
// (FAILED_PRECONDITION, naming the session) instead of holding that single
// checkpointer up to --early_step_ready_timeout. Once the verdict comes, it
// saves.
TEST_F(CheckpointStore, AStalledTrainerOfOneUserHoldsUpNoOtherUsersSave) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  StartDaemon({"--checkpoint_dir=" + ck, "--early_step_ready_timeout=120s"});
  UserProcess a(User("dos-sec-a"), daemon_->socket(),
                {"attach:name=stalled", "register:numel=256", "stall", "wait", "rpc_save:id=self",
                 "wait", "verdict", "rpc_save:id=self"});
  const std::string stall = a.Await("stall");
  ASSERT_EQ(Code(stall), 0) << a.output() << daemon_->log();
  ASSERT_NE(stall.find("held=1"), std::string::npos) << stall << daemon_->log();
  ASSERT_EQ(Code(a.Await("wait")), 0) << a.output();
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  Clock::time_point t0 = Clock::now();
  const std::string e = RunAs(User("dos-sec-e"), daemon_->socket(),
                              {"attach:name=busy", "register:numel=256", "step:n=2",
                               "rpc_save:id=self"});
  EXPECT_NE(e.find("OK rpc_save"), std::string::npos) << e << daemon_->log();
  EXPECT_NE(e.find(UserDir(ck, "dos-sec-e")), std::string::npos) << e;
  EXPECT_LT(seconds_since(t0), 30.0) << "another user's save waited for the stalled trainer";
  a.Continue();
  t0 = Clock::now();
  const std::string own = a.Await("rpc_save", 60000);
  EXPECT_LT(seconds_since(t0), 30.0) << "the save waited for its stalled trainer";
  EXPECT_EQ(Code(own), 9) << own << daemon_->log();  // FAILED_PRECONDITION
  EXPECT_NE(own.find("session "), std::string::npos) << own;
  ASSERT_EQ(Code(a.Await("wait")), 0) << a.output();
  a.Continue();
  EXPECT_EQ(Code(a.Await("verdict")), 0) << a.output() << daemon_->log();
  const std::string after = a.Await("rpc_save");
  EXPECT_EQ(Code(after), 0) << after << daemon_->log();
  EXPECT_NE(after.find(UserDir(ck, "dos-sec-a")), std::string::npos) << after;
}

// A session's checkpoint folder swapped for a link to a folder outside the
// store, while the trainer runs and autosave is on: every save, load and
// autosave (and its pruning) fails naming the link and the fix; nothing
// outside is written, read or deleted. (dosd reaches every file through the
// store's directory descriptor, one folder at a time with O_NOFOLLOW, so the
// moment of the swap does not matter: tests/unit/checkpoint/store_env_test
// swaps between a save's checks and its writes.)
TEST_F(CheckpointStore, ASessionFolderSwappedForALinkRedirectsNothing) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  StartDaemon({"--checkpoint_dir=" + ck, "--autosave_interval=100ms", "--autosave_keep=1"});
  UserProcess t(User("dos-sec-a"), daemon_->socket(),
                {"attach:name=job", "register:numel=256", "step:n=2", "rpc_save:id=self", "wait",
                 "step:n=1", "rpc_save:id=self", "rpc_save:id=self,path=job.r-1/x.dckpt",
                 "rpc_load:id=self,token=self,path=job.r-1",
                 "rpc_load:id=self,token=self,path=job.r-1/auto-000000000000.s1.dckpt", "wait"});
  const std::string saved = t.Await("rpc_save");
  ASSERT_EQ(Code(saved), 0) << saved << daemon_->log();
  ASSERT_EQ(Code(t.Await("wait")), 0) << t.output();
  const std::string job = UserDir(ck, "dos-sec-a") + "/job.r-1";
  ASSERT_TRUE(WaitFor([&] { return fs::exists(job + "/auto-000000000002.s1.dckpt"); }, 20000))
      << daemon_->log();
  // Outside: valid checkpoints of this very job (a load through the link
  // would succeed) and autosaves that pruning through it would delete.
  const std::string outside = DaemonOwnedDir("outside");
  fs::copy_file(Field(saved, "path"), outside + "/auto-000000000000.s1.dckpt");
  fs::copy_file(Field(saved, "path"), outside + "/auto-000000000001.s1.dckpt");
  std::ofstream(outside + "/victim") << "precious";
  const auto before = Contents(outside);
  const std::string moved = DaemonOwnedDir("moved");
  fs::rename(job, moved + "/job.r-1");
  fs::create_directory_symlink(outside, job);

  t.Continue();
  ASSERT_EQ(Code(t.Await("wait")), 0) << t.output() << daemon_->log();
  const std::string out = t.output();
  size_t refused = 0;
  for (const std::string op : {"ERR rpc_save code=3", "ERR rpc_load code=3"}) {
    for (size_t at = 0; (at = out.find(op, at)) != std::string::npos; ++at) ++refused;
  }
  EXPECT_EQ(refused, 4u) << out << daemon_->log();
  EXPECT_NE(out.find(job + " is a symlink; dosd does not follow links in its checkpoint store"),
            std::string::npos) << out;
  EXPECT_NE(out.find("remove " + job), std::string::npos) << out;
  // The session is at step 3 now: autosave tries, fails the same way, and
  // prunes nothing.
  EXPECT_TRUE(WaitFor([&] {
    return LogLineHas(daemon_->log(),
                      {"event=checkpoint.failed", "autosave=1", job + " is a symlink"});
  }, 20000)) << daemon_->log();
  EXPECT_EQ(Contents(outside), before) << "something outside the store changed";
  EXPECT_EQ(daemon_->log().find("event=checkpoint.pruned path=" + job), std::string::npos)
      << daemon_->log();
  EXPECT_EQ(daemon_->log().find("event=checkpoint.loaded"), std::string::npos) << daemon_->log();
  t.Finish();
}

// A checkpoint write that fails part way (here at dosd's file size limit,
// RLIMIT_FSIZE, which it inherits from the test; a full disk fails the same
// write path, see tests/fault/checkpoint_fault_test) is reported to the
// caller with the cause and the fix, leaves the previous checkpoint at that
// path byte for byte and no temporary, and dosd serves on (before, SIGXFSZ
// killed it).
TEST_F(CheckpointStore, AFailedWriteKeepsThePreviousCheckpointAndDosdServing) {
  DOS_SECURITY_REQUIRE();
  constexpr rlim_t kLimit = 256 << 10;
  daemon_ = SecureDaemon();
  {
    rlimit saved{};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
    rlimit low = saved;
    low.rlim_cur = kLimit;  // the soft limit only: it can be raised back
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &low), 0) << std::strerror(errno);
    const bool started = daemon_->Start();
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
    ASSERT_TRUE(started) << daemon_->log();
  }
  // A small session's checkpoint fits; a large one's (786 KiB) does not.
  UserProcess small(User("dos-sec-a"), daemon_->socket(),
                    {"attach:name=job", "register:numel=256", "step:n=1",
                     "rpc_save:id=self,path=keep.dckpt", "wait", "rpc_save:id=self,path=keep.dckpt"});
  const std::string first = small.Await("rpc_save");
  ASSERT_EQ(Code(first), 0) << first << daemon_->log();
  const std::string path = Field(first, "path");
  const std::string before = ReadAll(path);
  ASSERT_FALSE(before.empty());
  const std::string big = RunAs(User("dos-sec-a"), daemon_->socket(),
                                {"attach:name=job", "register:numel=65536", "step:n=1",
                                 "rpc_save:id=self,path=keep.dckpt"});
  const std::string failed = big.substr(big.find("rpc_save"));
  EXPECT_EQ(Code("ERR " + failed), 8) << big << daemon_->log();  // RESOURCE_EXHAUSTED
  EXPECT_NE(failed.find("RLIMIT_FSIZE"), std::string::npos) << failed;
  EXPECT_NE(failed.find("the previous checkpoint is intact"), std::string::npos) << failed;
  EXPECT_NE(failed.find(path), std::string::npos) << failed;
  EXPECT_TRUE(ReadAll(path) == before) << "the previous checkpoint changed";
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path())) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
  // dosd serves on: the small session saves again.
  small.Continue();
  const std::string again = small.Await("rpc_save");
  EXPECT_EQ(Code(again), 0) << again << daemon_->log();
  small.Finish();
}

}  // namespace
}  // namespace dos::testing
