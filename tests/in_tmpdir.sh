#!/usr/bin/env bash
# Runs a command in a fresh temporary directory, removed afterwards whatever the outcome,
# and exits with the command's status; its output goes to meson's log as usual.
#
#   tests/in_tmpdir.sh CMD ARGS...
#
# For tests registered in tests/meson.build that write files (ddp-train's --output_dir):
# with a relative path they write under their own directory, so two copies of the suite
# running at once from one build directory never share an output directory. CMD given as
# a relative path (meson passes built programs relative to the build directory) is made
# absolute before the change of directory.
set -u
cmd=$1
shift
case $cmd in
  */*) [ -e "$cmd" ] && cmd=$(realpath "$cmd") ;;
esac
dir=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-run-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
cd "$dir" || exit 1
"$cmd" "$@"
