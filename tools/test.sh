#!/usr/bin/env bash
# Installs what is missing, builds libddp in build/ and runs every test.
#   tools/test.sh                 the normal build, all suites
#   tools/test.sh --sanitize      the same tests built with ASan + UBSan (in build/sanitize),
#                                 less the suite 'oracle' (PyTorch parity tests)
#   tools/test.sh --tsan          ThreadSanitizer (in build/tsan): the concurrency tests only
#                                 (test_collectives, test_pg_faults, test_store, test_ddp),
#                                 which must report no race (docs/building.md)
#   tools/test.sh [--sanitize|--tsan] -- ARGS   extra arguments for `meson test`
#                                 (e.g. --suite unit)
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/deps.sh

builddir=build
setup_args=()
tsan=0
if [ "${1:-}" = "--sanitize" ]; then
  shift
  builddir=build/sanitize
  # The torch backend is a Python extension: loading it into an uninstrumented python3
  # needs the sanitizer runtimes preloaded, so the sanitized builds leave it out; its own
  # tests run in the normal build.
  setup_args=(-Db_sanitize=address,undefined -Db_lundef=false -Dtorch=disabled)
elif [ "${1:-}" = "--tsan" ]; then
  shift
  tsan=1
  builddir=build/tsan
  setup_args=(-Db_sanitize=thread -Dtorch=disabled)
fi
[ "${1:-}" = "--" ] && shift

ddp_ensure_packages "${DDP_BUILD_PACKAGES[@]}" "${DDP_TEST_PACKAGES[@]}"
if [ "$tsan" = 1 ]; then
  # Only what the concurrency tests need (test_pg_faults runs ddp-train): a whole TSan build
  # would double CI's compile time for programs no TSan test runs.
  tsan_tests=(test_collectives test_pg_faults test_store test_ddp)
  [ -f "$builddir/build.ninja" ] || meson setup "$builddir" "${setup_args[@]}"
  meson compile -C "$builddir" tools/ddp-train "${tsan_tests[@]/#/tests/}"
  # halt_on_error: the first race fails the test with TSan's report in its log;
  # second_deadlock_stack: lock-order reports show both stacks.
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
  # test_collectives' matrices up to 4 ranks (7 and 8 forked ranks under TSan: about 45 s)
  export DDP_TEST_MAX_WORLD=4
  start=$(date +%s)
  meson test -C "$builddir" --no-rebuild -v --print-errorlogs --num-processes 2 \
    --timeout-multiplier 3 "$@" "${tsan_tests[@]}"
  echo "tools/test.sh --tsan: the concurrency tests ran in $(( $(date +%s) - start )) s"
  exit 0
fi
if [ "$builddir" = build ]; then
  # The packages above include the torch backend's: build it here even where an earlier
  # configure (the quickstart's, before they were installed) found them missing.
  setup_args=(-Dtorch=enabled)
  [ -f build/build.ninja ] && meson configure build -Dtorch=enabled >/dev/null
fi
ddp_build "$builddir" "${setup_args[@]}"
# The sanitizer run leaves out the suite 'oracle' (parity tests whose time goes to PyTorch,
# tests/meson.build); the normal run has every test.
skip=()
[ "$builddir" = build/sanitize ] && skip=(--no-suite oracle)
# ... and the long matrices (test_invariant, sharding.sh) take a cut of their runs under it
# (DDP_TEST_CUT=1: each path once; the normal run has them all).
[ "$builddir" = build/sanitize ] && export DDP_TEST_CUT=1
# Ranks are processes and threads on 2 cores: run test programs two at a time.
meson test -C "$builddir" -v --print-errorlogs --num-processes 2 "${skip[@]}" "$@"
