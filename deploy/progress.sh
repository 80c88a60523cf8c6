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
#                                and failure lines always. When nothing was printed
#                                for $DOS_HEARTBEAT_EVERY seconds (default 20), a
#                                heartbeat says it still works and what: the files
#                                being compiled (ninja prints a step only when it
#                                ends, and one compile can take minutes), else the
#                                last step seen. With pipefail the pipeline's status
#                                is CMD's.
progress_t0=${progress_t0:-$SECONDS}

progress_stage() {
  echo "== $* (+$((SECONDS - progress_t0)) s)"
}

# The source files compilers are working on now, under this checkout
# (relative paths, at most 4): the "-c FILE" of the running compiler commands.
progress_compiling() {
  local root=$PWD/
  ps -eww -o args= 2>/dev/null |
    awk -v root="$root" '{ for (i = 1; i < NF; i++) if ($i == "-c" && index($(i + 1), root) == 1)
                             print substr($(i + 1), length(root) + 1) }' |
    sort -u | head -4 | paste -sd ' ' -
}

progress_filter() {
  local label=$1 log=$2 every=${DOS_PROGRESS_EVERY:-10} beat=${DOS_HEARTBEAT_EVERY:-20}
  local last=-1000 line pending= partial= rc seen= busy
  local t_start=$SECONDS last_out=$SECONDS
  : > "$log"
  while :; do
    line=
    rc=0
    IFS= read -r -t "${DOS_HEARTBEAT_POLL:-5}" line || rc=$?
    if [ "$rc" -gt 128 ]; then  # no whole line for a while: keep what came, maybe beat
      partial+=$line
      if [ $((SECONDS - last_out)) -ge "$beat" ]; then
        busy=$(progress_compiling)
        if [ -n "$busy" ]; then
          busy=": compiling $busy"
        elif [ -n "$seen" ]; then
          busy="; last: ${seen:0:100}"
        fi
        printf '   %s %4ds  still working (%ds since the last line)%s\n' "$label" \
          "$((SECONDS - t_start))" "$((SECONDS - last_out))" "$busy"
        last_out=$SECONDS
      fi
      continue
    fi
    line=$partial$line
    partial=
    [ "$rc" -eq 0 ] || [ -n "$line" ] || break  # end of input
    printf '%s\n' "$line" >> "$log"
    case "$line" in
      \[[0-9]*/[0-9]*\]\ *|*[0-9]/[0-9]*\ Test\ *\#[0-9]*:*)
        seen=$line
        if [ $((SECONDS - last)) -ge "$every" ]; then
          printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${line:0:120}"
          last=$SECONDS
          last_out=$SECONDS
          pending=
        else
          pending=$line
        fi
        ;;
      *FAILED:*|*error:*|*Error\ *|*\*\*\*Failed*|*\*\*\*Timeout*|*\*\*\*Exception*)
        printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${line:0:200}"
        last_out=$SECONDS
        ;;
    esac
    [ "$rc" -eq 0 ] || break  # a last line without a newline
  done
  if [ -n "$pending" ]; then
    printf '   %s %4ds  %s\n' "$label" "$((SECONDS - t_start))" "${pending:0:120}"
  fi
  return 0
}
