#!/usr/bin/env bash
# Installs what a GPU-machine call needs into .dist (ignored): dosd, dosctl,
# the GPU test programs and libdos_client.so from ./build, plus the shared
# libraries the GPU machine's image lacks (../shared/device/bundle-libs).
# Then: run(carry=[".dist"], command="bash bench/device_session.sh tests $OUT/t").
# BASE_REV=<rev> also builds that revision's dosd (bin/dosd_base) for a before/after.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${DOS_BUILD_DIR:-build}
rm -rf .dist; mkdir -p .dist/bin .dist/lib
for p in daemon/dosd client/dosctl/dosctl; do cp "$b/$p" .dist/bin/; done
for t in gpu_adam_test gpu_lease_test gpu_ipc_test multi_gpu_test gpu_doomed_trainer \
         gpu_rank_trainer dos_bench_update_probe dos_bench_update_trainer dos_bench_finite_scan; do
  f=$(find "$b" -type f -name "$t" | head -1); [ -n "$f" ] && cp "$f" .dist/bin/
done
# BASE_REV=<rev>: that revision's dosd too, as bin/dosd_base, so that one device call
# measures before and after (bench/device_session.sh delay-ab); built once into
# build-base/ (ignored) in a temporary worktree.
if [ -n "${BASE_REV:-}" ]; then
  rev=$(git rev-parse --short "$BASE_REV"); cached=build-base/dosd-$rev
  # It loads this build's libdos_proto.so.1 (.dist/lib): only the same protocol will do.
  git diff --quiet "$rev" HEAD -- proto || {
    echo "make_dist.sh: proto/ changed since $rev; dosd_base would load this build's" \
      "libdos_proto.so.1: pick a BASE_REV with the same proto/" >&2; exit 1; }
  if [ ! -x "$cached" ]; then
    wt=$(mktemp -d); git worktree add --detach "$wt" "$rev"
    DOS_BUILD_DIR=build DOS_BUILD_TARGETS=dosd bash "$wt/deploy/build.sh" -DDOS_WERROR=ON
    mkdir -p build-base; cp "$wt/build/daemon/dosd" "$cached"
    git worktree remove --force "$wt"
  fi
  cp "$cached" .dist/bin/dosd_base
fi
cp -L "$b/client/src/libdos_client.so" .dist/lib/libdos_client.so
strip --strip-debug .dist/bin/* .dist/lib/libdos_client.so
# The commit checked out when the install was made, which the results name
# (bench/device_session.sh exports it as DOS_COMMIT); "+" when the tree outside bench/ had
# uncommitted changes. It names ./build only when that was built from this tree.
{ git rev-parse --short HEAD | tr -d '\n'; git diff --quiet HEAD -- . ':!bench' || printf '+'
  echo; } > .dist/COMMIT
bash ../shared/device/bundle-libs .dist
du -sh .dist
