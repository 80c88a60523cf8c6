// dos/cli: -h/--help/--version detection, the help text, usage errors
// (unknown flags, bad values) and the warning for flags a later --flagfile
// overrides.
#include "dos/cli/cli.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, cli_test_limit, "0", "A size the test sets, e.g. 512G.");
ABSL_FLAG(bool, cli_test_verbose, false, "A boolean flag.");
ABSL_FLAG(int, cli_test_count, 3, "An integer flag.");

namespace dos::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

struct Argv {
  explicit Argv(std::vector<std::string> a) : args(std::move(a)) {
    for (std::string& s : args) ptrs.push_back(s.data());
  }
  int argc() const { return static_cast<int>(ptrs.size()); }
  char** argv() { return ptrs.data(); }
  std::vector<std::string> args;
  std::vector<char*> ptrs;
};

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(CliTest, EarlyActions) {
  Argv h({"dosd", "-h"}), help({"dosd", "--socket=/x", "--help"}), v({"dosctl", "--version"});
  Argv none({"dosd", "--socket=/x"}), after({"dosctl", "--", "--help"});
  EXPECT_EQ(ScanEarlyAction(h.argc(), h.argv()), EarlyAction::kHelp);
  EXPECT_EQ(ScanEarlyAction(help.argc(), help.argv()), EarlyAction::kHelp);
  EXPECT_EQ(ScanEarlyAction(v.argc(), v.argv()), EarlyAction::kVersion);
  EXPECT_EQ(ScanEarlyAction(none.argc(), none.argv()), EarlyAction::kNone);
  EXPECT_EQ(ScanEarlyAction(after.argc(), after.argv()), EarlyAction::kNone);
}

TEST(CliTest, HelpListsTheProgramsFlagsOnly) {
  std::ostringstream out;
  PrintHelp(out, "usage: prog", "tests/unit/common/cli_test.cc");
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("usage: prog"));
  EXPECT_THAT(text, HasSubstr("--cli_test_limit=STRING  [0]"));
  EXPECT_THAT(text, HasSubstr("A size the test sets, e.g. 512G."));
  EXPECT_THAT(text, HasSubstr("--cli_test_verbose  [false]"));
  EXPECT_THAT(text, HasSubstr("--flagfile=FILE"));
  // Library flags (gtest's, abseil's) are left to --helpfull.
  EXPECT_THAT(text, ::testing::Not(HasSubstr("--gtest_filter")));
}

TEST(CliTest, VersionIsTheProjectVersion) {
  std::ostringstream out;
  PrintVersion(out, "dosd");
  EXPECT_THAT(out.str(), ::testing::MatchesRegex("dosd [0-9]+\\.[0-9]+\\.[0-9]+\n"));
}

TEST(CliTest, FlagfileAfterACommandLineFlagOverridesIt) {
  const std::string f = WriteFile("cli_a.flags",
                                  "# comment\n\n--cli_test_limit=0\n--cli_test_verbose\n");
  Argv a({"dosd", "--cli_test_limit=512G", "--flagfile=" + f});
  const std::vector<std::string> w = FlagfileOverrides(a.argc(), a.argv());
  ASSERT_THAT(w, SizeIs(1));
  EXPECT_THAT(w[0], HasSubstr("--cli_test_limit=512G from the command line is overridden by "
                              "--cli_test_limit=0 (" + f + " line 3)"));
  EXPECT_THAT(w[0], HasSubstr("put --flagfile before"));
}

TEST(CliTest, FlagfileFirstIsQuiet) {
  const std::string f = WriteFile("cli_b.flags", "--cli_test_limit=0\n");
  Argv a({"dosd", "--flagfile=" + f, "--cli_test_limit=512G"});
  EXPECT_THAT(FlagfileOverrides(a.argc(), a.argv()), IsEmpty());
  // The same value twice is no surprise either.
  Argv same({"dosd", "--cli_test_limit=0", "--flagfile", f});
  EXPECT_THAT(FlagfileOverrides(same.argc(), same.argv()), IsEmpty());
}

TEST(CliTest, NestedFlagfilesAndSpaceSeparatedValues) {
  const std::string inner = WriteFile("cli_inner.flags", "--nocli_test_verbose\n");
  const std::string outer = WriteFile("cli_outer.flags", "--flagfile=" + inner + "\n");
  Argv a({"dosd", "--cli_test_verbose", "--cli_test_limit", "1G", "--flagfile=" + outer});
  const std::vector<std::string> w = FlagfileOverrides(a.argc(), a.argv());
  ASSERT_THAT(w, SizeIs(1));
  EXPECT_THAT(w[0], HasSubstr("--cli_test_verbose=true from the command line is overridden by "
                              "--cli_test_verbose=false (" + inner + " line 1)"));
}

TEST(CliTest, UsageErrorsNameUnknownFlagsAndBadValues) {
  const std::string f = WriteFile("cli_e.flags", "--cli_test_count=2\n--cli_tset_limit=1G\n");
  Argv a({"dosctl", "status", "--nope", "--cli_test_count=abc", "--cli_test_verbose",
          "--nocli_test_verbose", "--cli_test_limit", "8G", "--flagfile=" + f, "--helpfull",
          "--", "--after"});
  const std::vector<std::string> e = UsageErrors(a.argc(), a.argv());
  ASSERT_THAT(e, SizeIs(3)) << ::testing::PrintToString(e);
  EXPECT_EQ(e[0], "unknown flag --nope");
  EXPECT_THAT(e[1], HasSubstr("--cli_test_count=abc: "));
  EXPECT_EQ(e[2], "unknown flag --cli_tset_limit (" + f + " line 2)");
}

TEST(CliTest, UsageErrorsNameAMissingValueAndAnUnreadableFlagfile) {
  Argv a({"dosd", "--flagfile=/nonexistent/dos.flags", "--cli_test_limit"});
  const std::vector<std::string> e = UsageErrors(a.argc(), a.argv());
  ASSERT_THAT(e, SizeIs(2)) << ::testing::PrintToString(e);
  EXPECT_THAT(e[0], HasSubstr("cannot read --flagfile=/nonexistent/dos.flags: "));
  EXPECT_EQ(e[1], "--cli_test_limit needs a value: --cli_test_limit=VALUE");
  Argv ok({"dosd", "--cli_test_limit=1G", "--cli_test_verbose=false", "-cli_test_count", "4"});
  EXPECT_THAT(UsageErrors(ok.argc(), ok.argv()), IsEmpty());
}

TEST(CliTest, HandleEarlyArgsExitsTwoOnAUsageErrorAndPointsAtHelp) {
  Argv bad({"dosctl", "--nope", "status"}), fine({"dosctl", "status"}), help({"dosctl", "-h"});
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(HandleEarlyArgs(bad.argc(), bad.argv(), "dosctl", "usage", "cli_test.cc"), 2);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "dosctl: unknown flag --nope\ndosctl: `dosctl --help` lists the flags\n");
  EXPECT_EQ(HandleEarlyArgs(fine.argc(), fine.argv(), "dosctl", "usage", "cli_test.cc"), -1);
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(HandleEarlyArgs(help.argc(), help.argv(), "dosctl", "usage", "cli_test.cc"), 0);
  EXPECT_THAT(::testing::internal::GetCapturedStdout(), HasSubstr("usage"));
}

TEST(CliTest, MissingFlagfileIsLeftToAbseil) {
  Argv a({"dosd", "--cli_test_limit=1G", "--flagfile=/nonexistent/dos.flags"});
  EXPECT_THAT(FlagfileOverrides(a.argc(), a.argv()), IsEmpty());
}

}  // namespace
}  // namespace dos::cli
