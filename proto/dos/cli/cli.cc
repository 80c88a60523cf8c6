#include "dos/cli/cli.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <fstream>
#include <map>
#include <utility>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "dos/version.h"

namespace dos::cli {
namespace {

// One flag as written: "--name=value" / "--name value" / "--name" / "--noname".
struct FlagArg {
  std::string name;
  std::string value;
  bool has_value = false;
};

// Splits "-x", "--x=v" into name and value; false for non-flags.
bool SplitFlag(absl::string_view arg, FlagArg* out) {
  if (arg.size() < 2 || arg[0] != '-' || arg == "--") return false;
  arg.remove_prefix(arg[1] == '-' ? 2 : 1);
  const size_t eq = arg.find('=');
  out->name = std::string(arg.substr(0, eq));
  out->has_value = eq != absl::string_view::npos;
  out->value = out->has_value ? std::string(arg.substr(eq + 1)) : "";
  // --nofoo is --foo=false for a boolean foo.
  if (!out->has_value && absl::StartsWith(out->name, "no") &&
      absl::FindCommandLineFlag(out->name) == nullptr) {
    if (absl::CommandLineFlag* f = absl::FindCommandLineFlag(out->name.substr(2));
        f != nullptr && f->IsOfType<bool>()) {
      out->name = out->name.substr(2);
      out->value = "false";
      out->has_value = true;
    }
  }
  return true;
}

// A flag that takes its value from the next argument ("--socket /x").
bool TakesNextArg(const FlagArg& f) {
  if (f.has_value) return false;
  if (f.name == "flagfile") return true;
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(f.name);
  return flag != nullptr && !flag->IsOfType<bool>();
}

struct Setting {
  std::string value;       // as written ("true" for a bare --flag)
  std::string where;       // kCommandLine or "FILE line N"
  bool has_value = false;  // false: a bare --flag
};

constexpr char kCommandLine[] = "the command line";

// Appends every flag a flagfile sets (following nested --flagfile lines);
// a file that cannot be read goes to `unreadable` (if not null).
void ReadFlagfile(const std::string& path, int depth,
                  std::vector<std::pair<std::string, Setting>>* out,
                  std::vector<std::string>* unreadable) {
  if (depth > 8) return;
  std::ifstream in(path);
  if (!in && unreadable != nullptr) {
    unreadable->push_back(absl::StrCat("cannot read --flagfile=", path, ": ",
                                       std::strerror(errno)));
  }
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    absl::string_view l = absl::StripAsciiWhitespace(line);
    FlagArg f;
    if (l.empty() || l[0] == '#' || !SplitFlag(l, &f)) continue;
    if (unreadable != nullptr && f.has_value &&
        absl::StripTrailingAsciiWhitespace(line).size() != line.size()) {
      // abseil keeps them in the value: "64G\r" is no size, "/run/d.sock " another path.
      unreadable->push_back(absl::StrCat(
          "--flagfile=", path, " line ", n, ": --", f.name, "=", f.value,
          " ends in a blank or a carriage return (a file saved with Windows line ends), which "
          "the value would keep; remove it (sed -i 's/[[:space:]]*$//' ",
          path, ")"));
    }
    if (f.name == "flagfile") {
      for (absl::string_view p : absl::StrSplit(f.value, ',', absl::SkipEmpty())) {
        ReadFlagfile(std::string(p), depth + 1, out, unreadable);
      }
      continue;
    }
    out->push_back({f.name, Setting{f.has_value ? f.value : "true",
                                    absl::StrCat(path, " line ", n), f.has_value}});
  }
}

// Every setting argv makes, in the order abseil applies them (a
// --flagfile's lines where it stands).
std::vector<std::pair<std::string, Setting>> Settings(int argc, char** argv,
                                                      std::vector<std::string>* unreadable) {
  std::vector<std::pair<std::string, Setting>> order;
  for (int i = 1; i < argc; ++i) {
    FlagArg f;
    if (absl::string_view(argv[i]) == "--") break;
    if (!SplitFlag(argv[i], &f)) continue;
    if (TakesNextArg(f) && i + 1 < argc) {
      f.value = argv[++i];
      f.has_value = true;
    }
    if (f.name == "flagfile") {
      for (absl::string_view p : absl::StrSplit(f.value, ',', absl::SkipEmpty())) {
        ReadFlagfile(std::string(p), 0, &order, unreadable);
      }
    } else {
      order.push_back({f.name, Setting{f.has_value ? f.value : "true", kCommandLine,
                                       f.has_value}});
    }
  }
  return order;
}

// abseil's usage flags, which are not registered flags.
bool IsUsageFlag(absl::string_view name) {
  for (absl::string_view u : {"help", "helpfull", "helpshort", "helppackage", "helpon",
                              "helpmatch", "version", "only_check_args"}) {
    if (name == u) return true;
  }
  return false;
}

void Wrap(std::ostream& out, absl::string_view text, absl::string_view indent, size_t width) {
  size_t col = 0;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (col == 0) {
      out << indent;
      col = indent.size();
    } else if (col + 1 + word.size() > width) {
      out << '\n' << indent;
      col = indent.size();
    } else {
      out << ' ';
      ++col;
    }
    out << word;
    col += word.size();
  }
  if (col != 0) out << '\n';
}

std::string TypeHint(const absl::CommandLineFlag& f) {
  if (f.IsOfType<bool>()) return "";
  if (f.IsOfType<std::string>()) return "=STRING";
  if (f.IsOfType<double>() || f.IsOfType<float>()) return "=NUMBER";
  if (f.IsOfType<absl::Duration>()) return "=DURATION";
  return "=INT";
}

}  // namespace

EarlyAction ScanEarlyAction(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--") break;
    if (a == "-h" || a == "-help" || a == "--help") return EarlyAction::kHelp;
    if (a == "--version" || a == "-version") return EarlyAction::kVersion;
  }
  return EarlyAction::kNone;
}

void PrintHelp(std::ostream& out, absl::string_view usage, absl::string_view flags_file) {
  out << usage << "\n\nFlags (default in brackets):\n";
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    std::string file = flag->Filename();
    if (absl::EndsWith(flags_file, "/")) file = file.substr(0, file.rfind('/') + 1);
    if (absl::EndsWith(file, flags_file)) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  for (const absl::CommandLineFlag* f : flags) {
    out << "  --" << f->Name() << TypeHint(*f) << "  [" << f->DefaultValue() << "]\n";
    Wrap(out, f->Help(), "      ", 80);
  }
  out << "\nCommon flags:\n"
         "  --flagfile=FILE  read flags from FILE, one per line; flags are applied left to right,\n"
         "      so a flag after --flagfile overrides the file's value (put --flagfile first)\n"
         "  --version        print the version and exit\n"
         "  -h, --help       this text; --helpfull lists every flag, libraries' included\n";
}

void PrintVersion(std::ostream& out, absl::string_view program) {
  out << program << ' ' << DOS_VERSION_STRING << '\n';
}

std::vector<std::string> FlagfileOverrides(int argc, char** argv) {
  const std::vector<std::pair<std::string, Setting>> order = Settings(argc, argv, nullptr);
  std::vector<std::string> warnings;
  std::map<std::string, Setting> from_cmdline;  // the command line's last setting per flag
  for (const auto& [name, s] : order) {
    const bool cmdline = s.where == kCommandLine;
    auto it = from_cmdline.find(name);
    if (cmdline) {
      from_cmdline[name] = s;
    } else if (it != from_cmdline.end()) {
      if (it->second.value != s.value) {
        warnings.push_back(absl::StrCat(
            "--", name, "=", it->second.value, " from the command line is overridden by --",
            name, "=", s.value, " (", s.where,
            "), which comes later; put --flagfile before the flags that should override it"));
      }
      from_cmdline.erase(it);
    }
  }
  return warnings;
}

std::vector<std::string> UsageErrors(int argc, char** argv) {
  std::vector<std::string> errors;
  const std::vector<std::pair<std::string, Setting>> order = Settings(argc, argv, &errors);
  for (const auto& [name, s] : order) {
    if (IsUsageFlag(name)) continue;
    const std::string where = s.where == kCommandLine ? "" : absl::StrCat(" (", s.where, ")");
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr) {
      errors.push_back(absl::StrCat("unknown flag --", name, where));
      continue;
    }
    if (flag->IsRetired()) continue;
    if (!s.has_value && !flag->IsOfType<bool>()) {
      errors.push_back(absl::StrCat("--", name, where, " needs a value: --", name, "=VALUE"));
      continue;
    }
    // Sets the flag as absl::ParseCommandLine will again, in the same order
    // (abseil's FlagSaver would put values back but logs each one it does).
    std::string error;
    if (!flag->ParseFrom(s.value, &error)) {
      errors.push_back(absl::StrCat("--", name, "=", s.value, where, ": ", error));
    }
  }
  return errors;
}

int HandleEarlyArgs(int argc, char** argv, absl::string_view program, absl::string_view usage,
                    absl::string_view flags_file) {
  switch (ScanEarlyAction(argc, argv)) {
    case EarlyAction::kHelp:
      PrintHelp(std::cout, usage, flags_file);
      return 0;
    case EarlyAction::kVersion:
      PrintVersion(std::cout, program);
      return 0;
    case EarlyAction::kNone:
      break;
  }
  const std::vector<std::string> errors = UsageErrors(argc, argv);
  if (errors.empty()) return -1;
  for (const std::string& e : errors) std::cerr << program << ": " << e << '\n';
  std::cerr << program << ": `" << program << " --help` lists the flags\n";
  return 2;
}

std::string UserStateDir(absl::string_view sub) {
  const char* xdg = std::getenv("XDG_STATE_HOME");
  if (xdg != nullptr && xdg[0] == '/') return absl::StrCat(xdg, "/", sub);
  const char* home = std::getenv("HOME");
  if (home != nullptr && home[0] == '/') return absl::StrCat(home, "/.local/state/", sub);
  return "";
}

}  // namespace dos::cli
