#!/usr/bin/env bash
# Throwaway users and groups for the `security` tests (ctest -L security), as
# deploy/sysusers.d/dos.conf lays them out, under names no deployment uses:
#   group dos-sec      plays the role of `dos` (the trainers' group)
#   user  dos-sec-d    runs dosd (primary group dos-sec, like the `dos` user)
#   user  dos-sec-a    a trainer whose primary group is dos-sec
#   user  dos-sec-b    a trainer in dos-sec by supplementary membership only
#   user  dos-sec-c    a local user outside dos-sec
#   user  dos-sec-o    an operator: in group dos-sec-op (dosd --operator_gids)
# Usage: users.sh create | remove. Needs root; without it, says so and exits 0
# (the tests then skip with the same message).
set -euo pipefail
action=${1:-}
if [ "$(id -u)" != 0 ]; then
  echo "security fixture: not root, no users created; the security tests skip (run them as root, as CI does)"
  exit 0
fi
users="dos-sec-d dos-sec-a dos-sec-b dos-sec-c dos-sec-o"
case "$action" in
  create)
    # Leftovers of an interrupted run are replaced.
    "$0" remove >/dev/null 2>&1 || true
    groupadd --system dos-sec
    groupadd --system dos-sec-op
    useradd --system --no-create-home --shell /usr/sbin/nologin -g dos-sec dos-sec-d
    useradd --system --no-create-home --shell /usr/sbin/nologin -g dos-sec dos-sec-a
    useradd --system --no-create-home --shell /usr/sbin/nologin -U -G dos-sec dos-sec-b
    useradd --system --no-create-home --shell /usr/sbin/nologin -U dos-sec-c
    useradd --system --no-create-home --shell /usr/sbin/nologin -U -G dos-sec,dos-sec-op dos-sec-o
    echo "security fixture: created $users"
    ;;
  remove)
    for u in $users; do
      pkill_pids=$(pgrep -u "$u" 2>/dev/null || true)
      for p in $pkill_pids; do kill -KILL "$p" 2>/dev/null || true; done
      userdel "$u" 2>/dev/null || true
      getent group "$u" >/dev/null && groupdel "$u" 2>/dev/null || true
    done
    for g in dos-sec dos-sec-op; do getent group "$g" >/dev/null && groupdel "$g" || true; done
    echo "security fixture: removed $users"
    ;;
  *)
    echo "usage: $0 create|remove" >&2
    exit 2
    ;;
esac
