#!/usr/bin/env bash
# The C sources are formatted as .clang-format says (CI runs this: .ci/run).
#   tools/maint/check_format.sh                  checks every tracked .c and .h; exit 1 listing
#                                                the files clang-format would change, with
#                                                how many lines
#   tools/maint/check_format.sh FILE...          checks only these
#   tools/maint/check_format.sh --fix [FILE...]  reformats them in place instead
# Installs clang-format through tools/deps.sh when it is missing. .clang-format was tuned
# against Debian's clang-format 14 (bookworm); another major version may lay some lines out
# differently, so the version used is printed. CLANG_FORMAT=/path/to/clang-format picks one.
# Nothing is vendored today; a third-party file would be listed in EXCLUDE below.
set -euo pipefail
cd "$(dirname "$0")/../.."

EXCLUDE='^$' # extended regex of paths never checked (third-party code), e.g. '^src/vendor/'

fix=0
if [ "${1:-}" = "--fix" ]; then
  fix=1
  shift
fi

cf=${CLANG_FORMAT:-clang-format}
if ! command -v "$cf" >/dev/null; then
  . tools/deps.sh
  ddp_ensure_packages "${DDP_LINT_PACKAGES[@]}"
fi

if [ $# -gt 0 ]; then
  files=("$@")
elif git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t files < <(git ls-files -- '*.c' '*.h' | grep -Ev "$EXCLUDE")
else # a tarball: the same folders
  mapfile -t files < <(find src include tools tests -name '*.[ch]' | sort | grep -Ev "$EXCLUDE")
fi

if [ "$fix" = 1 ]; then
  "$cf" -i --style=file "${files[@]}"
  echo "tools/maint/check_format.sh: formatted ${#files[@]} files ($("$cf" --version))"
  exit 0
fi

bad=()
for f in "${files[@]}"; do
  if ! "$cf" --dry-run -Werror --style=file "$f" >/dev/null 2>&1; then
    n=$("$cf" --style=file "$f" | diff --unchanged-line-format= --old-line-format='-' \
          --new-line-format='' "$f" - | wc -c || true)
    bad+=("$f ($n lines to change)")
  fi
done
if [ ${#bad[@]} -eq 0 ]; then
  echo "tools/maint/check_format.sh: ${#files[@]} files formatted ($("$cf" --version))"
  exit 0
fi
echo "tools/maint/check_format.sh: ${#bad[@]} of ${#files[@]} files are not formatted as" \
     ".clang-format says ($("$cf" --version)):"
printf '  %s\n' "${bad[@]}"
echo "See the changes with: $cf --style=file FILE | diff FILE -"
echo "Apply them with:      tools/maint/check_format.sh --fix [FILE...]"
exit 1
