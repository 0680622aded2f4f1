#!/usr/bin/env bash
# Installs what is missing, builds libddp in build/ and runs every test.
#   tools/test.sh                 the normal build, all suites
#   tools/test.sh --sanitize      the same tests built with ASan + UBSan (in build/sanitize)
#   tools/test.sh [--sanitize] -- ARGS   extra arguments for `meson test` (e.g. --suite unit)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh

builddir=build
setup_args=()
if [ "${1:-}" = "--sanitize" ]; then
  shift
  builddir=build/sanitize
  setup_args=(-Db_sanitize=address,undefined -Db_lundef=false)
fi
[ "${1:-}" = "--" ] && shift

ddp_ensure_packages "${DDP_BUILD_PACKAGES[@]}" "${DDP_TEST_PACKAGES[@]}"
ddp_build "$builddir" "${setup_args[@]}"
# Ranks are processes and threads on 2 cores: run test programs two at a time.
meson test -C "$builddir" -v --print-errorlogs --num-processes 2 "$@"
