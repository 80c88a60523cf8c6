#!/usr/bin/env bash
# Builds the convergence benchmark's text corpus from Debian packages' own text
# on this machine (no download): package documentation (READMEs, Markdown,
# reStructuredText and text files under /usr/share/doc, release notes, API
# manuals), the license texts and packages' copyright files, and the Python
# standard library's source. Files are taken in the order of their contents'
# SHA-1 (a fixed shuffle, so that the last 5% the benchmark holds out for
# validation is a mix of every source, and identical files count once), each
# cut at 256 KiB, paragraphs seen before dropped (licenses repeated in many
# copyright files), and the whole cut at MAX_MB (default 20).
#
#   bash bench/convergence/make_corpus.sh [OUT]   # default .dist/corpus/corpus.txt
#
# bench/make_dist.sh empties .dist: run this after it. The corpus is not
# committed; its size and SHA-256 go into the benchmark's result file.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.dist/corpus/corpus.txt}
max_mb=${MAX_MB:-20}
per_file=$((256 * 1024))
py=$(find /usr/lib -maxdepth 1 -name 'python3.[0-9]*' | sort -V | tail -1)
mkdir -p "$(dirname "$out")"
list=$(mktemp); trap 'rm -f "$list"' EXIT

{
  find /usr/share/common-licenses -type f
  find /usr/share/doc -type f -name copyright
  # Prose and technical text; changelogs (mostly version lines and hashes) left out.
  find /usr/share/doc -type f -size -4000k \
    \( -iname 'README*' -o -name '*.md' -o -name '*.txt' -o -name '*.rst' \
       -o -name '*.md.gz' -o -name '*.txt.gz' -o -name '*.rst.gz' \) \
    -not -path '*/changelogs/*' -not -iname '*changelog*'
  [ -n "$py" ] && find "$py" -type f -name '*.py' -not -path '*/test/*' \
    -not -path '*/tests/*' -not -path '*/site-packages/*'
} | sort -u | while IFS= read -r f; do
  # One line per file: the SHA-1 of its (decompressed) contents, then its path.
  case "$f" in
    *.gz) h=$(zcat -- "$f" 2>/dev/null | sha1sum) ;;
    *) h=$(sha1sum < "$f") ;;
  esac
  printf '%s %s\n' "${h%% *}" "$f"
done | LC_ALL=C sort -k1,1 -u > "$list"

# The cut at the end closes the pipe early: its writers' SIGPIPE is expected.
set +o pipefail
while IFS= read -r line; do
  f=${line#* }
  case "$f" in
    *.gz) zcat -- "$f" 2>/dev/null | head -c $per_file ;;
    *) head -c $per_file -- "$f" ;;
  esac
  printf '\n\n'
done < "$list" \
  | LC_ALL=C awk 'BEGIN { RS = ""; ORS = "\n\n" } !seen[$0]++' \
  | head -c $((max_mb * 1000 * 1000)) > "$out"
set -o pipefail
[ -s "$out" ] || { echo "make_corpus: no text found for $out" >&2; exit 1; }

echo "$out: $(wc -c < "$out") bytes from $(wc -l < "$list") files, sha256 $(sha256sum < "$out" | cut -c1-16)"
