// dos/cli: -h/--help/--version detection, the help text, and the
// warning for flags a later --flagfile overrides.
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

TEST(CliTest, MissingFlagfileIsLeftToAbseil) {
  Argv a({"dosd", "--cli_test_limit=1G", "--flagfile=/nonexistent/dos.flags"});
  EXPECT_THAT(FlagfileOverrides(a.argc(), a.argv()), IsEmpty());
}

}  // namespace
}  // namespace dos::cli
