// dosctl: inspect and steer the node's dosd.
//
//   dosctl [--socket=PATH] [--json] [--timeout=5s] COMMAND
//     status                          daemon pid, version, health
//     sessions                        attached sessions
//     stats [SESSION_ID] [--watch [--interval=2s] [--count=N]]
//                                     step statistics (all sessions by default)
//     checkpoint save SESSION_ID|all [PATH]
//     checkpoint load SESSION_ID|all PATH
//     checkpoint delete PATH [--uid=UID]
//                                     PATH relative to the owner's folder of dosd's
//                                     --checkpoint_dir (delete: yours, or UID's for operators)
//     policy get SESSION_ID [TOKEN]   a session's scheduling policy
//     policy set SESSION_ID|default POLICY
//                                     cpu, static:<f>, interleave:<k> or auto
//
// Exit status: 0 success, 1 the daemon refused or is unreachable, 2 usage
// (an unknown command, flag or flag value).
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/dosctl/commands.h"
#include "dos/cli/cli.h"

namespace {

std::string DefaultSocket() {
  const char* env = std::getenv("DOS_SOCKET");
  return (env != nullptr && env[0] != '\0') ? env : "/run/dos/dosd.sock";
}

}  // namespace

ABSL_FLAG(std::string, socket, DefaultSocket(), "dosd's unix socket (default: $DOS_SOCKET)");
ABSL_FLAG(bool, json, false, "print JSON instead of tables");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(5), "deadline of each call to the daemon");
ABSL_FLAG(absl::Duration, checkpoint_timeout, absl::Minutes(30),
          "deadline of checkpoint save/load calls");
ABSL_FLAG(int64_t, uid, -1,
          "checkpoint delete: whose folder (operators); default: the caller's own");
ABSL_FLAG(bool, watch, false, "stats: repeat every --interval until interrupted");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(2), "stats --watch: time between samples");
ABSL_FLAG(int, count, 0, "stats --watch: stop after this many samples (0 = never)");

namespace {

constexpr char kUsage[] =
    "dosctl [--socket=PATH] [--json] [--timeout=5s] COMMAND\n"
    "  status                               daemon pid, version, health\n"
    "  sessions                             attached sessions\n"
    "  stats [SESSION_ID] [--watch [--interval=2s] [--count=N]]\n"
    "                                       step statistics\n"
    "  checkpoint save SESSION_ID|all [PATH] checkpoint (PATH under dosd's --checkpoint_dir)\n"
    "  checkpoint load SESSION_ID|all PATH  restore state (and the trainers' weights)\n"
    "  checkpoint delete PATH [--uid=UID]   delete checkpoints (a file or folder; '.': all)\n"
    "  policy get SESSION_ID [TOKEN]        a session's scheduling policy\n"
    "  policy set SESSION_ID|default POLICY cpu, static:<f>, interleave:<k>, auto";

constexpr char kAbout[] =
    "dosctl: inspect and steer the node's dosd (the Deep Optimizer States daemon).\n";
constexpr char kNotes[] =
    "--json prints one JSON object per command (with stats --watch, one a line per sample:\n"
    "JSON Lines); every 64-bit integer (ids, counters, bytes)\n"
    "is a JSON number. Exit status: 0 success, 1 the daemon refused (a value only it\n"
    "checks, such as a policy) or is unreachable, 2 usage (an unknown command, flag or\n"
    "flag value).";

bool ParseId(const std::string& text, uint64_t* id) { return absl::SimpleAtoi(text, id); }

// {"error": {"code": "NOT_FOUND", "message": "..."}} on one line.
std::string JsonError(const absl::Status& st) {
  std::string msg;
  for (unsigned char c : st.message()) {
    if (c == '"' || c == '\\') {
      msg.push_back('\\');
      msg.push_back(static_cast<char>(c));
    } else if (c < 0x20) {
      msg += absl::StrFormat("\\u%04x", c);
    } else {
      msg.push_back(static_cast<char>(c));
    }
  }
  return absl::StrCat("{\"error\": {\"code\": \"", absl::StatusCodeToString(st.code()),
                      "\", \"message\": \"", msg, "\"}}");
}

// A command line dosctl cannot run: why, and the usage, on stderr; with
// --json also an INVALID_ARGUMENT error object on stdout, as for a failed call.
int Usage(const std::string& why) {
  std::cerr << "dosctl: " << why << "\nusage: " << kUsage << '\n';
  if (absl::GetFlag(FLAGS_json)) std::cout << JsonError(absl::InvalidArgumentError(why)) << '\n';
  return 2;
}

// Pretty-printed JSON on one line: each newline and the indent after it go
// (inside strings JSON has no raw newlines); ends in one newline.
std::string OneLine(const std::string& json) {
  std::string out;
  for (size_t i = 0; i < json.size(); ++i) {
    if (json[i] != '\n') {
      out.push_back(json[i]);
      continue;
    }
    while (i + 1 < json.size() && json[i + 1] == ' ') ++i;
  }
  return out.empty() ? out : out + '\n';
}

// A flag value no command can use, named with what it may be; "" if none.
std::string BadFlagValues() {
  for (const auto& [name, d] : {std::pair{"timeout", absl::GetFlag(FLAGS_timeout)},
                                {"checkpoint_timeout", absl::GetFlag(FLAGS_checkpoint_timeout)},
                                {"interval", absl::GetFlag(FLAGS_interval)}}) {
    if (d <= absl::ZeroDuration()) {
      return absl::StrCat("bad --", name, "=", absl::FormatDuration(d),
                          ": a positive duration, e.g. 5s");
    }
  }
  if (absl::GetFlag(FLAGS_count) < 0) {
    return absl::StrCat("bad --count=", absl::GetFlag(FLAGS_count),
                        ": the number of samples, 0 for no limit");
  }
  // -1, the default, is the caller's own folder; (uid_t)-1 is no user's.
  const int64_t uid = absl::GetFlag(FLAGS_uid);
  if (uid != -1 && (uid < 0 || uid >= int64_t{0xFFFFFFFF})) {
    return absl::StrCat("bad --uid=", uid, ": a user id, 0 to 4294967294 (leave it out for ",
                        "your own folder)");
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  const std::string help = absl::StrCat(kAbout, "usage: ", kUsage, "\n", kNotes);
  if (int rc = dos::cli::HandleEarlyArgs(argc, argv, "dosctl", help, "client/dosctl/main.cc");
      rc >= 0) {
    return rc;
  }
  for (const std::string& w : dos::cli::FlagfileOverrides(argc, argv)) {
    std::cerr << "dosctl: warning: " << w << '\n';
  }
  std::vector<char*> raw = absl::ParseCommandLine(argc, argv);
  std::vector<std::string> args(raw.begin() + 1, raw.end());
  if (args.empty()) return Usage("no command given");
  if (std::string bad = BadFlagValues(); !bad.empty()) return Usage(bad);

  dos::dosctl::Commands cmd({absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_json),
                             absl::GetFlag(FLAGS_timeout),
                             absl::GetFlag(FLAGS_checkpoint_timeout)});
  absl::Status st;
  const std::string& c = args[0];
  uint64_t id = 0;
  if (c == "status" && args.size() == 1) {
    st = cmd.Status(std::cout);
  } else if (c == "sessions" && args.size() == 1) {
    st = cmd.Sessions(std::cout);
  } else if (c == "stats" && args.size() <= 2) {
    if (args.size() == 2 && !ParseId(args[1], &id)) return Usage("bad SESSION_ID " + args[1]);
    if (!absl::GetFlag(FLAGS_watch)) {
      st = cmd.Stats(id, std::cout);
    } else {
      const int count = absl::GetFlag(FLAGS_count);
      for (int i = 0; st.ok() && (count <= 0 || i < count); ++i) {
        if (i > 0) absl::SleepFor(absl::GetFlag(FLAGS_interval));
        if (absl::GetFlag(FLAGS_json)) {
          // JSON Lines: one sample's object a line, nothing between them.
          std::ostringstream sample;
          st = cmd.Stats(id, sample);
          std::cout << OneLine(sample.str()) << std::flush;
          continue;
        }
        std::cout << "--- " << absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(),
                                                 absl::UTCTimeZone())
                  << '\n';
        st = cmd.Stats(id, std::cout);
        std::cout.flush();
      }
    }
  } else if (c == "checkpoint" && args.size() >= 3 && args.size() <= 4 &&
             (args[1] == "save" || (args[1] == "load" && args.size() == 4))) {
    if (args[2] != "all" && (!ParseId(args[2], &id) || id == 0)) {
      return Usage("bad SESSION_ID " + args[2] + " (a session id or 'all')");
    }
    const std::string path = args.size() == 4 ? args[3] : "";
    st = args[1] == "save" ? cmd.SaveCheckpoint(id, path, std::cout)
                           : cmd.LoadCheckpoint(id, path, std::cout);
  } else if (c == "checkpoint" && args.size() == 3 && args[1] == "delete") {
    st = cmd.DeleteCheckpoint(args[2], absl::GetFlag(FLAGS_uid), std::cout);
  } else if (c == "policy" && args.size() >= 3 && args[1] == "get" && args.size() <= 4) {
    if (!ParseId(args[2], &id) || id == 0) return Usage("bad SESSION_ID " + args[2]);
    st = cmd.GetPolicy(id, args.size() == 4 ? args[3] : "", std::cout);
  } else if (c == "policy" && args.size() == 4 && args[1] == "set") {
    if (args[2] != "default" && (!ParseId(args[2], &id) || id == 0)) {
      return Usage("bad SESSION_ID " + args[2] + " (a session id or 'default')");
    }
    st = cmd.SetPolicy(id, args[3], std::cout);
  } else {
    return Usage("unknown command or wrong arguments: " + c);
  }
  if (!st.ok()) {
    std::cerr << "dosctl: " << st.message() << '\n';
    // With --json a script reads stdout: the error as an object there too.
    if (absl::GetFlag(FLAGS_json)) std::cout << JsonError(st) << '\n';
    return 1;
  }
  return 0;
}
