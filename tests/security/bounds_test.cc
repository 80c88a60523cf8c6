// Issue 24: no trainer can starve the others. One fixture user attacks dosd
// (bounds_client's attacker ops: sparse memfds, idle descriptor-socket
// connections, stalled early steps, many tensors, long names) while another
// attaches, registers, steps, saves a checkpoint and reads its state; the
// victim's results and times are asserted while the attack runs, and
// `dosctl stats` shows what the attacker holds against each per-uid bound.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/security/security_env.h"

namespace dos::testing {
namespace {

constexpr int kInvalidArgument = 3;
constexpr int kResourceExhausted = 8;

std::vector<std::string> BoundsArgv(const std::string& socket, std::vector<std::string> ops) {
  return ClientArgv(DOS_BOUNDS_CLIENT_PATH, socket, std::move(ops));
}

double Ms(const std::string& line) {
  const std::string v = Field(line, "ms");
  return v.empty() ? 1e9 : std::stod(v);
}

// A field of /proc/<pid>/status as a number ("VmRSS", "VmSize" in kB).
long ProcStatus(pid_t pid, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stol(line.substr(key.size() + 1));
  }
  return -1;
}

// CPU time (user + system) `pid` has used, in seconds.
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i >= 14) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// The row of `dosctl stats`'s per-uid table for `uid` ("" if none).
std::string UidRow(const std::string& stats, uid_t uid) {
  const size_t table = stats.find("per uid");
  std::istringstream in(table == std::string::npos ? "" : stats.substr(table));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string first;
    if (words >> first && first == std::to_string(uid)) return line;
  }
  return "";
}

std::string Stats(const DaemonProcess& d) {
  return RunCommandAs(User("dos-sec-b"),
                      {ReachableBinary(DOS_DOSCTL_PATH), "--socket=" + d.socket(), "stats"});
}

// The victim's attach, register, steps, save and state read, each OK; the
// lines in order.
struct VictimRun {
  std::string attach, reg, step, save, read;
};
VictimRun RunVictim(const DaemonProcess& d, int steps, uint64_t numel = 4096) {
  UserProcess e(User("dos-sec-e"),
                BoundsArgv(d.socket(), {"attach", "register:numel=" + std::to_string(numel),
                                        "step:n=" + std::to_string(steps), "save",
                                        "state_read"}));
  VictimRun v;
  v.attach = e.Await("attach", 30000);
  v.reg = e.Await("register", 30000);
  v.step = e.Await("step", 60000);
  v.save = e.Await("save", 30000);
  v.read = e.Await("state_read", 30000);
  e.Finish();
  return v;
}

void ExpectVictimOk(const VictimRun& v, int steps, const std::string& log) {
  EXPECT_EQ(Code(v.attach), 0) << v.attach << log.substr(0, 4000);
  EXPECT_LT(Ms(v.attach), 2000) << v.attach;
  EXPECT_EQ(Code(v.reg), 0) << v.reg;
  EXPECT_EQ(Code(v.step), 0) << v.step;
  EXPECT_EQ(Field(v.step, "step"), std::to_string(steps)) << v.step;
  EXPECT_EQ(Code(v.save), 0) << v.save << log.substr(0, 4000);
  EXPECT_LT(Ms(v.save), 5000) << v.save;
  EXPECT_EQ(Code(v.read), 0) << v.read;
  EXPECT_EQ(Field(v.read, "step"), std::to_string(steps)) << v.read;
  EXPECT_LT(Ms(v.read), 2000) << v.read;
}

// Item 1: 112 sparse memfds of 1.25 TiB (140 TiB) used to be mapped whole,
// until another user's Attach found no address space.
TEST(Bounds, SparseMemfdsAreRefusedBeforeBeingMappedAndAnotherUserWorks) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"sparse:segments=112,bytes=1374389534720",
                                         "sparse:segments=4,bytes=1048576", "wait"}));
  const std::string sparse = a.Await("sparse", 60000);
  ASSERT_EQ(Code(sparse), 0) << sparse << d->log().substr(0, 4000);
  EXPECT_EQ(Field(sparse, "accepted"), "0") << sparse;
  EXPECT_NE(sparse.find("--max_mapped_bytes_per_session"), std::string::npos) << sparse;
  const std::string small = a.Await("sparse", 60000);
  EXPECT_EQ(Field(small, "accepted"), "4") << small;  // buffers of a sensible size still go
  ASSERT_EQ(Code(a.Await("wait")), 0) << a.output();
  EXPECT_LT(ProcStatus(d->pid(), "VmSize"), 1L << 31) << "kB of address space";
  const VictimRun v = RunVictim(*d, 20);
  ExpectVictimOk(v, 20, d->log());
  const std::string row = UidRow(Stats(*d), User("dos-sec-a").uid);
  EXPECT_NE(row.find("4.0 MiB /"), std::string::npos) << row;  // the 4 small segments
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

TEST(Bounds, MappedBytesPerUidBoundsEveryOneOfItsSessions) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_mapped_bytes_per_uid=8M", "--max_mapped_bytes_per_session=6M"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"), BoundsArgv(d->socket(), {"sparse:segments=4,bytes=2097152",
                                                            "sparse:segments=4,bytes=2097152",
                                                            "wait"}));
  const std::string first = a.Await("sparse", 30000);
  EXPECT_EQ(Field(first, "accepted"), "3") << first;
  EXPECT_NE(first.find("--max_mapped_bytes_per_session=6.00_MiB"), std::string::npos) << first;
  const std::string second = a.Await("sparse", 30000);
  EXPECT_EQ(Field(second, "accepted"), "1") << second;
  EXPECT_NE(second.find("--max_mapped_bytes_per_uid=8.00_MiB"), std::string::npos) << second;
  // Another uid is not charged for it.
  const VictimRun v = RunVictim(*d, 5);
  ExpectVictimOk(v, 5, d->log());
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Item 2: 128 idle connections used to hold a victim's dos_attach for 28 s.
TEST(Bounds, IdleDescriptorConnectionsDelayNoOneElse) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_fd_connections_per_uid=8"});
  ASSERT_TRUE(d->Start()) << d->log();
  // (A session too, so that `dosctl stats` lists the uid.)
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"sparse:segments=1,bytes=4096", "idle:n=128", "wait"}));
  const std::string idle = a.Await("idle", 30000);
  ASSERT_EQ(Code(idle), 0) << idle;
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const VictimRun v = RunVictim(*d, 10);
  ExpectVictimOk(v, 10, d->log());
  EXPECT_LT(Ms(v.attach), 1000) << v.attach;
  // At most --max_fd_connections_per_uid of them wait to be served.
  const std::string row = UidRow(Stats(*d), User("dos-sec-a").uid);
  EXPECT_NE(row.find(" / 8 "), std::string::npos) << row;
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Item 3: 32 stalled early steps used to take 1.5 of 2 cores and slow a
// victim's steps 9x.
TEST(Bounds, StalledEarlyStepsCostNoCpuAndAreCappedPerUid) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_sessions_per_uid=64"});
  ASSERT_TRUE(d->Start()) << d->log();
  const VictimRun alone = RunVictim(*d, 100);
  ExpectVictimOk(alone, 100, d->log());
  UserProcess a(User("dos-sec-a"), BoundsArgv(d->socket(), {"stall:n=32", "wait"}));
  const std::string stall = a.Await("stall", 60000);
  ASSERT_EQ(Code(stall), 0) << stall << d->log().substr(0, 4000);
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const double cpu0 = CpuSeconds(d->pid());
  const auto t0 = std::chrono::steady_clock::now();
  ::usleep(2'000'000);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double used = CpuSeconds(d->pid()) - cpu0;
  EXPECT_LT(used, 0.1 * wall) << "dosd used " << used << " s of CPU in " << wall
                              << " s with 32 stalled early steps";
  const VictimRun with = RunVictim(*d, 100);
  ExpectVictimOk(with, 100, d->log());
  EXPECT_LT(Ms(with.step), 1.5 * Ms(alone.step) + 100) << alone.step << " | " << with.step;
  // At most 16 wait (--max_early_steps_per_uid); the others were refused.
  const std::string row = UidRow(Stats(*d), User("dos-sec-a").uid);
  EXPECT_NE(row.find(" 16 / 16 "), std::string::npos) << row;
  EXPECT_NE(d->log().find("--max_early_steps_per_uid=16"), std::string::npos)
      << d->log().substr(0, 4000);
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// A state read of a session whose early step waits for its trainer once
// held the descriptor socket's one thread (every user's attach) until the
// step timed out; then each was refused after 1 s, but one after another
// they still held it. Now they wait on their uid's own threads: another
// user attaches while they go on.
TEST(Bounds, StateReadsOfStalledSessionsHoldUpNoOne) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon();
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"stall:n=2", "stalled_reads:seconds=6", "wait"}));
  ASSERT_EQ(Code(a.Await("stall", 60000)), 0) << d->log().substr(0, 4000);
  ::usleep(2'000'000);  // the reads begin 1 s after the stall
  const VictimRun v = RunVictim(*d, 5);
  ExpectVictimOk(v, 5, d->log());
  EXPECT_LT(Ms(v.attach), 1000) << v.attach;
  const std::string reads = a.Await("stalled_reads", 60000);
  EXPECT_GE(std::stoi(Field(reads, "aborted")), 2) << reads;
  EXPECT_EQ(Field(reads, "aborted"), Field(reads, "reads")) << reads;
  EXPECT_LT(Ms(reads), 5000) << reads;  // each refused after 1 s of waiting
  ASSERT_EQ(Code(a.Await("wait")), 0);
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Each segment is one mapping of dosd's, and vm.max_map_count bounds them
// all: one uid's thousands of tiny segments once left no mapping for another
// user's attach.
TEST(Bounds, SegmentsPerUidAreBoundedAcrossSessions) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_segments_per_uid=6"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"sparse:segments=4,bytes=4096",
                                         "sparse:segments=4,bytes=4096", "wait"}));
  const std::string first = a.Await("sparse", 30000);
  EXPECT_EQ(Field(first, "accepted"), "4") << first;
  const std::string second = a.Await("sparse", 30000);
  EXPECT_EQ(Field(second, "accepted"), "2") << second;
  EXPECT_NE(second.find("--max_segments_per_uid=6"), std::string::npos) << second;
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const std::string row = UidRow(Stats(*d), User("dos-sec-a").uid);
  EXPECT_NE(row.find(" 6 / 6 "), std::string::npos) << row;
  const VictimRun v = RunVictim(*d, 5);
  ExpectVictimOk(v, 5, d->log());
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Item 4: 100,000 one-element tensors per session, and 3 MB names, used to
// grow dosd by hundreds of MB uncharged.
TEST(Bounds, TensorBookkeepingAndNamesAreChargedAndBounded) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_bookkeeping_bytes_per_uid=32M"});
  ASSERT_TRUE(d->Start()) << d->log();
  const long before = ProcStatus(d->pid(), "VmRSS");
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"tensors:sessions=8,n=100000",
                                         "names:sessions=40,bytes=3000000", "wait"}));
  const std::string tensors = a.Await("tensors", 60000);
  EXPECT_EQ(Field(tensors, "registered"), "0") << tensors;
  EXPECT_NE(tensors.find("code8:"), std::string::npos) << tensors;
  EXPECT_NE(tensors.find("--max_bookkeeping_bytes_per_uid=32.00_MiB"), std::string::npos)
      << tensors;
  const std::string names = a.Await("names", 60000);
  EXPECT_EQ(Field(names, "registered"), "0") << names;
  EXPECT_NE(names.find("code3:"), std::string::npos) << names;
  EXPECT_NE(names.find("at_most_1024"), std::string::npos) << names;
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const long grown_kb = ProcStatus(d->pid(), "VmRSS") - before;
  EXPECT_LT(grown_kb, 96 * 1024) << "dosd grew " << grown_kb << " kB";
  const VictimRun v = RunVictim(*d, 10);
  ExpectVictimOk(v, 10, d->log());
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

TEST(Bounds, TensorsPerUidAreBoundedAcrossSessions) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--max_tensors_per_uid=150000"});
  ASSERT_TRUE(d->Start()) << d->log();
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"tensors:sessions=2,n=100000", "wait"}));
  const std::string tensors = a.Await("tensors", 60000);
  EXPECT_EQ(Field(tensors, "registered"), "1") << tensors;
  EXPECT_NE(tensors.find("--max_tensors_per_uid=150000"), std::string::npos) << tensors;
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const std::string row = UidRow(Stats(*d), User("dos-sec-a").uid);
  EXPECT_NE(row.find("100000 / 150000"), std::string::npos) << row;
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

// Every attack at once from one uid: another uid's 100 steps take at most
// 1.5x their time alone (the best of three runs each, on the 2-core CI
// machine), and its attach, save and state read work.
TEST(Bounds, OneUidAttackingEveryWayLeavesAnotherUidsStepsFair) {
  DOS_SECURITY_REQUIRE();
  auto d = SecureDaemon({"--host_memory_limit=256M", "--max_sessions_per_uid=128"});
  ASSERT_TRUE(d->Start()) << d->log();
  // 1 Mi parameters: the steps' time is the update's, not the doorbell's.
  auto steps_ms = [&] {
    const VictimRun v = RunVictim(*d, 100, 1 << 20);
    ExpectVictimOk(v, 100, d->log());
    return Ms(v.step);
  };
  const double alone = std::min({steps_ms(), steps_ms(), steps_ms()});
  UserProcess a(User("dos-sec-a"),
                BoundsArgv(d->socket(), {"sparse:segments=112,bytes=1374389534720", "stall:n=32",
                                         "tensors:sessions=4,n=100000",
                                         "names:sessions=20,bytes=3000000", "idle:n=128", "all",
                                         "wait"}));
  ASSERT_EQ(Code(a.Await("all", 120000)), 0) << a.output() << d->log().substr(0, 4000);
  ASSERT_EQ(Code(a.Await("wait")), 0);
  const double attacked = std::min({steps_ms(), steps_ms(), steps_ms()});
  // 100 steps take about 30 ms: 50 ms of slack for the tests ctest runs
  // beside this one on a small machine (the attack this guards against
  // made them 9x slower).
  const double limit = 1.5 * alone + 50;
  EXPECT_LT(attacked, limit) << "100 steps: " << alone << " ms alone, " << attacked
                             << " ms under attack";
  std::printf("fairness: 100 steps %.1f ms alone, %.1f ms under attack (limit %.1f)\n", alone,
              attacked, limit);
  a.Finish();
  EXPECT_EQ(d->Stop(), 0) << d->log().substr(0, 4000);
}

}  // namespace
}  // namespace dos::testing
