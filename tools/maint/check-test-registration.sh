#!/bin/sh
# Fails (exit 1) when a tests/test_*.c file is not listed in tests/meson.build, so that no
# test file is silently left out of `meson test`. Usage: check-test-registration.sh TESTS_DIR
dir=${1:?usage: check-test-registration.sh TESTS_DIR}
status=0
for f in "$dir"/test_*.c; do
  [ -e "$f" ] || continue
  name=$(basename "$f" .c)
  if ! grep -q "\['$name'," "$dir/meson.build"; then
    echo "tests/$name.c is not registered in tests/meson.build" >&2
    status=1
  fi
done
exit $status
