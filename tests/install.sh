#!/usr/bin/env bash
# `meson install` gives both kinds of users what the build tree gives them
# (docs/building.md, "Using it from another project"; docs/torch.md): a C program built with
# `pkg-config --cflags --libs libddp` against the installed headers and library runs a
# 2-rank allreduce; Debian's python3 finds the installed `libddp_torch` on its own sys.path
# (no PYTHONPATH entry), and the installed `ddprun` runs a 2-rank PyTorch script over it,
# started as torchrun takes a script. The install goes to a temporary --destdir, so the
# loader is pointed at the installed library with LD_LIBRARY_PATH and Python at the
# installed site directory, the one path that a real install at the prefix makes implicit.
#
#   tests/install.sh MESON BUILD_ROOT SANITIZE TORCH
#
# SANITIZE is the build's b_sanitize: a sanitized libddp.so needs its runtime loaded first,
# so the C program is built with the same -fsanitize. TORCH is true where the build has the
# torch backend (meson's have_torch).
# A build without the torch backend (no torch under /usr/bin/python3, or -Dtorch=disabled as
# in the sanitizer build) installs no libddp_torch, and the test ends after the C part.
set -u
meson=$1
build=$(realpath "$2")
sanitize=$3
torch=$4
py=/usr/bin/python3
dir=$(mktemp -d "${TMPDIR:-/tmp}/ddp-test-install-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() {
  echo "FAIL: $*"
  exit 1
}

root=$dir/root
"$meson" install -C "$build" --destdir "$root" --no-rebuild --quiet >install.log 2>&1 ||
  {
    cat install.log
    fail "meson install --destdir $root exited non-zero"
  }

# The C side: pkg-config's sysroot prefixes the .pc file's -I and -L with the destdir.
pc=$(find "$root" -name libddp.pc -print -quit)
[ -n "$pc" ] || fail "no libddp.pc under $root"
lib=$(dirname "$(find "$root" -name 'libddp.so.*' -print -quit)")
[ -d "$lib" ] || fail "no libddp.so under $root"
flags=$(PKG_CONFIG_SYSROOT_DIR=$root PKG_CONFIG_PATH=$(dirname "$pc") \
  pkg-config --cflags --libs libddp) || fail "pkg-config --cflags --libs libddp failed"
case "$flags" in
  *"-I$root/"*"-L$root/"* | *"-L$root/"*"-I$root/"*) ;;
  *) fail "pkg-config flags do not point into the install: $flags" ;;
esac
cat >consumer.c <<'C'
/* Rank r contributes (r + 1) * (i + 1); the sum over 2 ranks is 3 * (i + 1). */
#include <ddp.h>
#include <stdio.h>

static ddp_status_t rank_fn(ddp_pg_t *pg, void *arg) {
  (void)arg;
  float x[4];
  for (int i = 0; i < 4; i++) x[i] = (float)((ddp_pg_rank(pg) + 1) * (i + 1));
  ddp_status_t s = ddp_allreduce(pg, x, x, 4, DDP_F32, DDP_OP_SUM, NULL);
  if (s != DDP_OK) return s;
  if (ddp_pg_rank(pg) == 0) printf("%g %g %g %g\n", x[0], x[1], x[2], x[3]);
  return DDP_OK;
}

int main(void) {
  ddp_status_t s = ddp_spawn_threads(2, NULL, rank_fn, NULL);
  if (s != DDP_OK) fprintf(stderr, "consumer: %s\n", ddp_status_str(s));
  return s == DDP_OK ? 0 : 1;
}
C
san=()
[ "$sanitize" = none ] || san=("-fsanitize=$sanitize")
# shellcheck disable=SC2086  # flags are words
cc -std=c11 -Wall -Werror "${san[@]}" consumer.c -o consumer $flags >cc.log 2>&1 ||
  {
    cat cc.log
    fail "a program against the installed headers and library did not build"
  }
out=$(LD_LIBRARY_PATH=$lib timeout 60 ./consumer 2>&1)
[ "$out" = "3 6 9 12" ] || fail "the installed library's allreduce printed '$out', expected '3 6 9 12'"
echo "C: pkg-config build against $root, allreduce 3 6 9 12"

bin=$(dirname "$(find "$root" -path '*/bin/ddprun' -print -quit)")
[ -x "$bin/ddprun" ] || fail "no ddprun installed under $root"
for t in ddp-train ddp-compare ddp-bench ddp-fr-trace; do
  [ -x "$bin/$t" ] || fail "$t is not installed beside ddprun ($bin)"
done

# The PyTorch side.
mod=$(find "$root" -path '*/libddp_torch/__init__.py' -print -quit)
if [ "$torch" != true ]; then
  [ -z "$mod" ] || fail "a build without the torch backend installed $mod"
  echo "no torch backend in this build: nothing of PyTorch's to install"
  exit 0
fi
[ -n "$mod" ] || fail "the build has the torch backend but installed no libddp_torch under $root"
site=$(dirname "$(dirname "$mod")")
want=${site#"$root"}
"$py" -c 'import sys; sys.exit(0 if sys.argv[1] in sys.path else 1)' "$want" ||
  fail "libddp_torch went to $want, which is not on $py's sys.path: $($py -c 'import sys; print(sys.path)')"
cat >job.py <<'PY'
import os
import torch
import torch.distributed as dist
import libddp_torch

dist.init_process_group("libddp")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.arange(4, dtype=torch.float64) * (r + 1)
dist.all_reduce(t)
expect = torch.arange(4, dtype=torch.float64) * (w * (w + 1) // 2)
assert torch.equal(t, expect), (t, expect)
print(f"rank {r}: {t.tolist()} from {os.path.dirname(libddp_torch.__file__)}", flush=True)
dist.destroy_process_group()
PY
# No PYTHONPATH from the caller (the build tree's must not stand in for the install).
env -u PYTHONPATH PYTHONPATH="$site" LD_LIBRARY_PATH="$lib" \
  timeout 120 "$bin/ddprun" --nproc_per_node 2 job.py >job.log 2>&1 ||
  {
    cat job.log
    fail "the installed ddprun and libddp_torch did not run job.py"
  }
cat job.log
for r in 0 1; do
  grep -q "rank $r: \[0.0, 3.0, 6.0, 9.0\] from $site/libddp_torch" job.log ||
    fail "rank $r did not sum [0, 3, 6, 9] with libddp_torch from $site"
done
echo "PyTorch: libddp_torch from $want (on $py's sys.path), 2 ranks under the installed ddprun"
