#!/usr/bin/env bash
# The installed /etc/dos/dosd.flags against the dosd it configures (ctest
# deploy_flagfile_flags): every flag it names, set or commented out, is one
# `dosd --help` lists and does not call ignored or deprecated, and dosd starts
# with the file as it is (its socket and checkpoint folder moved aside).
#
#   deploy/test_flagfile.sh DOSD
set -euo pipefail
dosd=${1:?usage: test_flagfile.sh DOSD}
flags=$(dirname "$0")/dos/dosd.flags
tmp=$(mktemp -d /tmp/dos-flagfile-test.XXXXXX)
pid=
cleanup() {
  if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$dosd" --help > "$tmp/help"
names=$(sed -nE 's/^#?--([a-z0-9_]+)(=.*)?$/\1/p' "$flags" | sort -u)
[ -n "$names" ] || fail "no flags found in $flags"
for name in $names; do
  # The flag's entry: its line and the indented help under it.
  entry=$(awk -v f="--$name" '$1 ~ "^" f "(=|$)" { on = 1; print; next }
                              on && /^      / { print; next } { on = 0 }' "$tmp/help")
  [ -n "$entry" ] || fail "$flags names --$name, which dosd --help does not list"
  if grep -qiE 'ignored|deprecated' <<<"$entry"; then
    fail "$flags names --$name, which dosd --help calls ignored or deprecated: $entry"
  fi
done
echo "ok: the $(wc -w <<<"$names") flags $flags names are all dosd's, none ignored or deprecated"

mkdir "$tmp/run"
"$dosd" --flagfile="$flags" --socket="$tmp/run/dosd.sock" --checkpoint_dir="$tmp/ckpt" \
  2> "$tmp/log" &
pid=$!
for _ in $(seq 400); do [ -S "$tmp/run/dosd.sock" ] && break; sleep 0.05; done
[ -S "$tmp/run/dosd.sock" ] || { cat "$tmp/log"; fail "dosd did not start with $flags"; }
kill -TERM "$pid"
wait "$pid" || { cat "$tmp/log"; fail "dosd exited $? after SIGTERM"; }
pid=
# Started by hand, not as the unit (OOMScoreAdjust=-900): without
# CAP_SYS_RESOURCE dosd keeps its OOM score and says so; that is how it was
# run, not what the file says.
if grep 'level=warning' "$tmp/log" | grep -qv 'event=daemon.oom_score_adj_kept'; then
  cat "$tmp/log"; fail "warnings with $flags"
fi
echo "ok: dosd starts with $flags and warns about nothing (but how it was started)"
