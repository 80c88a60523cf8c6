// Command-line conveniences shared by dosd and dosctl (in proto/ beside the
// wire: code both programs use, neither daemon nor client), on top of abseil
// flags:
// -h/--help that lists the program's own flags and exits 0, --version that
// prints the project version, usage errors (unknown flags, bad values) that
// point at --help and exit 2, and a check for flags that a later --flagfile
// silently overrides.
#ifndef DOS_CLI_CLI_H_
#define DOS_CLI_CLI_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace dos::cli {

// What argv asks for before any real work: -h, -help, --help (help; abseil's
// --helpfull, --helpshort etc. keep abseil's behaviour), --version.
enum class EarlyAction { kNone, kHelp, kVersion };
EarlyAction ScanEarlyAction(int argc, char** argv);

// Prints `usage`, then every flag defined in a source file whose path ends
// with `flags_file` (e.g. "client/dosctl/main.cc") or, when it ends with '/'
// (e.g. "daemon/"), directly in that folder, sorted, with type, default and
// help, then the common abseil flags (--flagfile, --version, --helpfull).
void PrintHelp(std::ostream& out, absl::string_view usage, absl::string_view flags_file);

// "PROGRAM VERSION" plus the build's details, for --version.
void PrintVersion(std::ostream& out, absl::string_view program);

// abseil applies flags left to right, a --flagfile's lines where the
// --flagfile stands; so `dosd --x=1 --flagfile=f` with `--x=2` in f runs with
// x=2. Returns one message per flag given on the command line that a later
// --flagfile (nested ones included) sets again, naming both values and the fix.
// Files that cannot be read are skipped (abseil reports them).
std::vector<std::string> FlagfileOverrides(int argc, char** argv);

// What is wrong with argv's flags before abseil parses them, one message
// each: a flag this program does not define ("unknown flag --nope"), a value
// its flag cannot take ("--timeout=abc: ..."), a --flagfile that cannot be
// read. Flagfiles are read (nested ones included). Trying a value sets the
// flag, as absl::ParseCommandLine then does again in the same order.
std::vector<std::string> UsageErrors(int argc, char** argv);

// For main(), before absl::ParseCommandLine: handles -h/--help (PrintHelp)
// and --version (PrintVersion) on stdout and returns 0; prints UsageErrors
// on stderr ("PROGRAM: unknown flag --nope") with a pointer to
// `PROGRAM --help` and returns 2 (abseil would exit 1 and name no help);
// returns -1 when main should go on.
int HandleEarlyArgs(int argc, char** argv, absl::string_view program, absl::string_view usage,
                    absl::string_view flags_file);

// The user's own state folder for `sub` (e.g. "dos/checkpoints"):
// $XDG_STATE_HOME/sub, else $HOME/.local/state/sub; "" when neither is an
// absolute path.
std::string UserStateDir(absl::string_view sub);

}  // namespace dos::cli

#endif  // DOS_CLI_CLI_H_
