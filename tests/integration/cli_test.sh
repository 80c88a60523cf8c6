#!/usr/bin/env bash
# What a new user meets on the command line (ctest cli_integration): --help
# and -h list the flags and exit 0, --version prints the project version, a
# --flagfile that overrides an earlier command-line flag is warned about, and a
# dosd started by hand keeps its checkpoints under the user's state folder
# (never /var/lib/dos) and leaves nothing behind after a clean stop.
#
#   tests/integration/cli_test.sh DOSD DOSCTL VERSION
set -euo pipefail
dosd=${1:?usage: cli_test.sh DOSD DOSCTL VERSION}
dosctl=${2:?}
version=${3:?}
tmp=$(mktemp -d /tmp/dos-cli-test.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

for prog in "$dosd" "$dosctl"; do
  name=$(basename "$prog")
  [ "$("$prog" --version)" = "$name $version" ] || fail "$name --version: $("$prog" --version)"
  for h in --help -h; do
    "$prog" "$h" > "$tmp/help" || fail "$name $h exited $?"
    grep -q -- '--socket=STRING' "$tmp/help" || fail "$name $h does not list --socket"
  done
done
grep -q -- '--host_memory_limit=STRING' <("$dosd" --help) || fail "dosd --help lacks --host_memory_limit"
grep -q -- 'policy set' <("$dosctl" --help) || fail "dosctl --help lacks the commands"
echo "ok: --help, -h, --version"

# dosctl refuses flag values no command can use (exit 2), before it calls dosd:
# a negative --uid once deleted the caller's own checkpoints, a huge one wrapped.
for bad in "--uid=-5 checkpoint delete .:bad --uid=-5" \
           "--uid=99999999999 checkpoint delete .:bad --uid=99999999999" \
           "--timeout=-1s status:bad --timeout=-1s" "--count=-1 stats --watch:bad --count=-1"; do
  rc=0
  read -ra argv <<< "${bad%%:*}"
  "$dosctl" --socket="$tmp/none.sock" "${argv[@]}" 2> "$tmp/err" || rc=$?
  [ "$rc" -eq 2 ] || fail "dosctl ${bad%%:*} should exit 2, got $rc"
  grep -q -- "${bad#*:}" "$tmp/err" || { cat "$tmp/err"; fail "no '${bad#*:}' for ${bad%%:*}"; }
done
echo "ok: bad dosctl flag values are refused by name"

# The README's old order: the flagfile's value wins, and dosd says so.
printf -- '--host_memory_limit=0\n--socket_mode=not-octal\n' > "$tmp/dosd.flags"
rc=0
"$dosd" --socket="$tmp/x.sock" --host_memory_limit=512G --flagfile="$tmp/dosd.flags" \
  2> "$tmp/err" || rc=$?
[ "$rc" -eq 1 ] || fail "dosd should stop at --socket_mode=not-octal (exit 1), got $rc"
grep -q 'event=daemon.flag_overridden' "$tmp/err" || { cat "$tmp/err"; fail "no override warning"; }
grep -q -- '--host_memory_limit=512G from the command line is overridden by --host_memory_limit=0' \
  "$tmp/err" || { cat "$tmp/err"; fail "the warning does not name both values"; }
"$dosd" --flagfile="$tmp/dosd.flags" --host_memory_limit=512G --socket="$tmp/x.sock" \
  2> "$tmp/err" || true
if grep -q 'flag_overridden' "$tmp/err"; then fail "warned with --flagfile first"; fi
echo "ok: a flagfile overriding a command-line flag is warned about"

# A value with a trailing blank or \r (Windows line ends) is refused, naming the line:
# abseil kept it ("64G\r" is no size; "/x.sock " served another path).
printf -- '--host_memory_limit=64G\r\n' > "$tmp/crlf.flags"
rc=0
"$dosd" --socket="$tmp/x.sock" --flagfile="$tmp/crlf.flags" 2> "$tmp/err" || rc=$?
[ "$rc" -ne 0 ] || fail "dosd started with a CRLF flagfile"
grep -q "crlf.flags line 1: --host_memory_limit=64G ends in a blank or a carriage return" \
  "$tmp/err" || { cat "$tmp/err"; fail "the CRLF line is not named"; }
echo "ok: a flagfile value ending in a blank or CR is refused by line"

# GPU flags are checked on every machine (a bad value is refused before anything starts).
for bad in "--gpu_cpu_path_copy=bogus:is not one of: kernel, dma" \
           "--gpu_staging_slots=0:--gpu_staging_slots must be >= 1"; do
  rc=0
  "$dosd" --socket="$tmp/x.sock" "${bad%%:*}" 2> "$tmp/err" || rc=$?
  [ "$rc" -eq 1 ] || fail "dosd ${bad%%:*} should exit 1, got $rc"
  grep -q -- "${bad#*:}" "$tmp/err" || { cat "$tmp/err"; fail "no '${bad#*:}' for ${bad%%:*}"; }
done
echo "ok: bad GPU flags are refused by name"

# Started by hand: checkpoints in $XDG_STATE_HOME (else ~/.local/state), not /var/lib/dos.
mkdir -p "$tmp/home" "$tmp/run"
env -u XDG_STATE_HOME HOME="$tmp/home" "$dosd" --socket="$tmp/run/dosd.sock" \
  --shm_prefix="/dos-cli$$" 2> "$tmp/dosd.log" &
pid=$!
for _ in $(seq 400); do [ -S "$tmp/run/dosd.sock" ] && break; sleep 0.05; done
[ -S "$tmp/run/dosd.sock" ] || { cat "$tmp/dosd.log"; fail "dosd did not listen"; }
grep -q "dir=$tmp/home/.local/state/dos/checkpoints" "$tmp/dosd.log" ||
  { cat "$tmp/dosd.log"; fail "checkpoints not under \$HOME/.local/state/dos"; }
[ -d "$tmp/home/.local/state/dos/checkpoints" ] || fail "checkpoint folder not created"
json=$("$dosctl" --socket="$tmp/run/dosd.sock" --json status)
grep -q "\"daemon_version\": \"$version\"" <<<"$json" || fail "dosctl status --json: $json"
# --json with --watch: JSON Lines, one sample's object a line and nothing else.
"$dosctl" --socket="$tmp/run/dosd.sock" --json stats --watch --count=2 --interval=10ms \
  > "$tmp/watch.jsonl" || fail "dosctl --json stats --watch exited $?"
[ "$(wc -l < "$tmp/watch.jsonl")" -eq 2 ] || { cat "$tmp/watch.jsonl"; fail "not 2 lines"; }
while read -r sample; do
  [ "${sample:0:1}" = "{" ] && [ "${sample: -1}" = "}" ] || fail "not one object a line: $sample"
done < "$tmp/watch.jsonl"
# --json errors: an object on stdout (a script reads it), the message on stderr as without.
err=$("$dosctl" --socket="$tmp/run/dosd.sock" --json stats 987654 2> "$tmp/err.txt") &&
  fail "dosctl --json stats of an unknown session exited 0"
grep -q '^{"error": {"code": "NOT_FOUND", "message": ".*987654' <<<"$err" ||
  fail "dosctl --json error not an object: $err"
grep -q "^dosctl: .*987654" "$tmp/err.txt" || fail "dosctl --json error not on stderr"
# A command line it cannot run: exit 2, the usage on stderr, an object on stdout too.
rc=0
err=$("$dosctl" --socket="$tmp/run/dosd.sock" --json stats not-a-number 2> "$tmp/err.txt") || rc=$?
[ "$rc" -eq 2 ] || fail "dosctl --json with a bad session id exited $rc, not 2"
grep -q '^{"error": {"code": "INVALID_ARGUMENT", "message": "bad SESSION_ID not-a-number' \
  <<<"$err" || fail "dosctl --json usage error not an object: $err"
grep -q "^usage: " "$tmp/err.txt" || fail "dosctl --json usage error: no usage on stderr"
kill -TERM "$pid"
wait "$pid" || fail "dosd exited $? after SIGTERM"
pid=
left=$(ls -A "$tmp/run")
[ -z "$left" ] || fail "a clean stop left $left in the socket folder"
echo "ok: checkpoints under the user's state folder; a clean stop leaves no socket, lock or auth file"

XDG_STATE_HOME="$tmp/state" "$dosd" --socket="$tmp/run/dosd.sock" 2> "$tmp/dosd.log" &
pid=$!
for _ in $(seq 400); do [ -S "$tmp/run/dosd.sock" ] && break; sleep 0.05; done
grep -q "dir=$tmp/state/dos/checkpoints" "$tmp/dosd.log" ||
  { cat "$tmp/dosd.log"; fail "checkpoints not under \$XDG_STATE_HOME/dos"; }
kill -TERM "$pid"
wait "$pid" || fail "dosd exited $? after SIGTERM"
pid=
echo "ok: \$XDG_STATE_HOME honoured"
