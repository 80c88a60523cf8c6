// Issue 11, items 5 and 6: a checkpoint store per owner. Files are 0600 and
// dosd's under <checkpoint_dir>/uid-<uid>/ (0700); temporaries are created
// exclusively and never through a link; scans never follow links; paths
// cannot leave the owner's folder; restore is keyed on (uid, name, rank).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
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

// A directory dosd's user owns (mode 0700), for a checkpoint store that
// outlives one daemon.
std::string DaemonOwnedDir(const std::string& what) {
  std::string tmpl = "/tmp/dos-sec-" + what + "-XXXXXX";
  std::string dir = ::mkdtemp(tmpl.data());
  const SecUser d = User("dos-sec-d");
  ::chown(dir.c_str(), d.uid, d.gid);
  return dir;
}

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

void MkdirOwned(const std::string& path) {
  fs::create_directories(path);
  const SecUser d = User("dos-sec-d");
  for (fs::path p = path; p.filename() != "checkpoints" && p.has_parent_path();
       p = p.parent_path()) {
    ::chown(p.c_str(), d.uid, d.gid);
    ::chmod(p.c_str(), 0700);
  }
}

std::string UserDir(const std::string& ck, const std::string& user) {
  return ck + "/uid-" + std::to_string(User(user).uid);
}

TEST(CheckpointStore, FilesArePrivateToDosd) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=2",
                                 "rpc_save:id=self"});
  ASSERT_NE(out.find("OK rpc_save"), std::string::npos) << out << d->log();
  const std::string path = Field(out.substr(out.find("OK rpc_save")), "path");
  EXPECT_EQ(path.rfind(UserDir(d->dir() + "/checkpoints", "dos-sec-a") + "/", 0), 0u) << path;
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_uid, User("dos-sec-d").uid);
  for (fs::path p = fs::path(path).parent_path(); p != fs::path(d->dir()); p = p.parent_path()) {
    ASSERT_EQ(::stat(p.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u) << p;
  }
  // Another trainer of the group can neither read nor delete it.
  const std::string cat = RunCommandAs(User("dos-sec-b"), {"/bin/cat", path});
  EXPECT_NE(cat.find("Permission denied"), std::string::npos) << cat;
  RunCommandAs(User("dos-sec-b"), {"/bin/rm", "-f", path});
  EXPECT_TRUE(fs::exists(path));
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(CheckpointStore, PlantedSymlinksAreNeverFollowed) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string victim = Victim();
  const std::string ck = d->dir() + "/checkpoints";
  // Links at every temporary name the first save could use, in the job's
  // folder (and where older dosd versions put it).
  for (const std::string& dir : {UserDir(ck, "dos-sec-a") + "/job.r-1", ck + "/job.r-1"}) {
    MkdirOwned(dir);
    for (int n = 0; n < 16; ++n) {
      fs::create_symlink(victim, dir + "/step-000000000002.dckpt.tmp." +
                                     std::to_string(d->pid()) + "." + std::to_string(n));
    }
  }
  // A link where a trainer names its checkpoint.
  fs::create_symlink(fs::path(victim).parent_path(), UserDir(ck, "dos-sec-a") + "/out");
  const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=2",
                                 "rpc_save:id=self", "rpc_save:id=self,path=out/x.dckpt"});
  EXPECT_NE(out.find("OK rpc_save path=" + UserDir(ck, "dos-sec-a") + "/job.r-1/step-"),
            std::string::npos) << out << d->log();
  EXPECT_NE(out.find("ERR rpc_save code=3"), std::string::npos) << out;
  EXPECT_NE(out.find("is a symlink"), std::string::npos) << out;
  EXPECT_EQ(ReadAll(victim), "precious");
  EXPECT_FALSE(fs::exists(fs::path(victim).parent_path() / "x.dckpt"));
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(CheckpointStore, PathsCannotLeaveTheOwnersFolder) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string victim = Victim();
  // Older dosd versions wrote "." as <dir>.tmp.<pid>.<n> beside the folder.
  for (int n = 0; n < 4; ++n) {
    fs::create_symlink(victim, d->dir() + "/checkpoints.tmp." + std::to_string(d->pid()) + "." +
                                   std::to_string(n));
  }
  const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                {"attach:name=job", "register:numel=256", "step:n=1",
                                 "rpc_save:id=self,path=.", "rpc_save:id=self,path=../x.dckpt",
                                 "rpc_save:id=self,path=a/../../x.dckpt",
                                 "rpc_save:id=self,path=/tmp/x.dckpt",
                                 "rpc_load:id=self,token=self,path=../uid-0"});
  const std::string user_dir = UserDir(d->dir() + "/checkpoints", "dos-sec-a");
  EXPECT_NE(out.find("OK rpc_save path=" + user_dir + "/job.r-1.s"), std::string::npos)
      << out << d->log();
  size_t refused = 0;
  for (size_t at = 0; (at = out.find("ERR rpc_save code=3", at)) != std::string::npos; ++at) {
    ++refused;
  }
  EXPECT_EQ(refused, 3u) << out;
  EXPECT_NE(out.find("ERR rpc_load code=3"), std::string::npos) << out;
  EXPECT_EQ(ReadAll(victim), "precious");
  EXPECT_FALSE(fs::exists(d->dir() + "/x.dckpt"));
  EXPECT_FALSE(fs::exists("/tmp/x.dckpt"));
  EXPECT_EQ(d->Stop(), 0) << d->log();
}

TEST(CheckpointStore, RestoreScanDoesNotFollowSymlinks) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  std::string path;
  {
    auto d = SecureDaemon({"--checkpoint_dir=" + ck});
    ASSERT_TRUE(d->Start()) << d->log();
    const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                  {"attach:name=job", "register:numel=256", "step:n=3",
                                   "rpc_save:id=self"});
    ASSERT_NE(out.find("OK rpc_save"), std::string::npos) << out << d->log();
    path = Field(out.substr(out.find("OK rpc_save")), "path");
    EXPECT_EQ(d->Stop(), 0) << d->log();
  }
  // The file moves out of the store; a link to it stays where it was.
  const std::string outside = DaemonOwnedDir("outside") + "/moved.dckpt";
  fs::rename(path, outside);
  fs::create_symlink(outside, path);
  // And a linked folder.
  fs::create_directory_symlink(fs::path(outside).parent_path(),
                               UserDir(ck, "dos-sec-a") + "/linked");
  auto d = SecureDaemon({"--checkpoint_dir=" + ck});
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                {"attach:name=job", "register:numel=256"});
  EXPECT_NE(out.find("OK register step=0"), std::string::npos) << out << d->log();
  EXPECT_EQ(d->log().find("session.restored"), std::string::npos) << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
  fs::remove_all(ck);
  fs::remove_all(fs::path(outside).parent_path());
}

TEST(CheckpointStore, RestoreIsKeyedByTheOwnersUid) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  {
    auto d = SecureDaemon({"--checkpoint_dir=" + ck});
    ASSERT_TRUE(d->Start()) << d->log();
    const std::string out = RunAs(User("dos-sec-a"), d->socket(),
                                  {"attach:name=job", "register:numel=256", "step:n=3",
                                   "rpc_save:id=self"});
    ASSERT_NE(out.find("OK rpc_save"), std::string::npos) << out << d->log();
    EXPECT_EQ(d->Stop(), 0) << d->log();
  }
  auto d = SecureDaemon({"--checkpoint_dir=" + ck});
  ASSERT_TRUE(d->Start()) << d->log();
  // Another user claims the same job name and rank first: it starts fresh.
  const std::string e = RunAs(User("dos-sec-e"), d->socket(),
                              {"attach:name=job", "register:numel=256"});
  EXPECT_NE(e.find("OK register step=0"), std::string::npos) << e << d->log();
  const std::string a = RunAs(User("dos-sec-a"), d->socket(),
                              {"attach:name=job", "register:numel=256"});
  EXPECT_NE(a.find("OK register step=3"), std::string::npos) << a << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
  fs::remove_all(ck);
}

TEST(CheckpointStore, AutosavesOfTwoUsersWithTheDefaultNameStayApart) {
  DOS_SECURITY_REQUIRE();
  const std::string ck = DaemonOwnedDir("ck");
  const std::vector<std::string> flags = {"--checkpoint_dir=" + ck, "--autosave_interval=200ms",
                                          "--autosave_keep=1"};
  {
    auto d = SecureDaemon(flags);
    ASSERT_TRUE(d->Start()) << d->log();
    UserProcess a(User("dos-sec-a"), d->socket(),
                  {"attach", "register:numel=256", "step:n=3", "wait"});
    UserProcess e(User("dos-sec-e"), d->socket(),
                  {"attach", "register:numel=256", "step:n=5", "wait"});
    ASSERT_EQ(Code(a.Await("wait")), 0) << a.output() << d->log();
    ASSERT_EQ(Code(e.Await("wait")), 0) << e.output() << d->log();
    // An autosave of each at its final step, in its owner's folder.
    ASSERT_TRUE(WaitFor([&] {
      const std::string log = d->log();
      return log.find(UserDir(ck, "dos-sec-a") + "/sec.r-1/auto-000000000003.dckpt") !=
                 std::string::npos &&
             log.find(UserDir(ck, "dos-sec-e") + "/sec.r-1/auto-000000000005.dckpt") !=
                 std::string::npos;
    }, 20000)) << d->log();
    EXPECT_EQ(d->Stop(), 0) << d->log();  // trainers still attached: final autosave
  }
  auto d = SecureDaemon(flags);
  ASSERT_TRUE(d->Start()) << d->log();
  const std::string e = RunAs(User("dos-sec-e"), d->socket(), {"attach", "register:numel=256"});
  const std::string a = RunAs(User("dos-sec-a"), d->socket(), {"attach", "register:numel=256"});
  EXPECT_NE(e.find("OK register step=5"), std::string::npos) << e << d->log();
  EXPECT_NE(a.find("OK register step=3"), std::string::npos) << a << d->log();
  EXPECT_EQ(d->Stop(), 0) << d->log();
  fs::remove_all(ck);
}

}  // namespace
}  // namespace dos::testing
