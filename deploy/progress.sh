# Console progress for the long scripts (deploy/demo.sh, tests/run_all.sh,
# tests/run_sanitizers.sh). Source it; bash only.
#
#   progress_stage NAME          prints "== NAME (+Ns since the script began)"
#   CMD 2>&1 | progress_filter LABEL LOG
#                                keeps CMD's whole output in LOG and prints on the
#                                console the build steps (ninja's "[N/M] ...") and
#                                test progress (ctest's "N/M Test #k: ..."), at most
#                                one every $DOS_PROGRESS_EVERY seconds (default 10)
#                                plus the last one, each with the elapsed time; error
#                                and failure lines always. With pipefail the
#                                pipeline's status is CMD's.
progress_t0=${progress_t0:-$SECONDS}

progress_stage() {
  echo "== $* (+$((SECONDS - progress_t0)) s)"
}

progress_filter() {
  local label=$1 log=$2 every=${DOS_PROGRESS_EVERY:-10} last=-1000 line pending=
  local t_start=$SECONDS
  : > "$log"
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$log"
    case "$line" in
      \[[0-9]*/[0-9]*\]\ *|*[0-9]/[0-9]*\ Test\ *\#[0-9]*:*)
        if [ $((SECONDS - last)) -ge "$every" ]; then
          printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${line:0:120}"
          last=$SECONDS
          pending=
        else
          pending=$line
        fi
        ;;
      *FAILED:*|*error:*|*Error\ *|*\*\*\*Failed*|*\*\*\*Timeout*|*\*\*\*Exception*)
        printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${line:0:200}"
        ;;
    esac
  done
  if [ -n "$pending" ]; then
    printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${pending:0:120}"
  fi
  return 0
}
