# Sourced by tools/test.sh and tools/quickstart.sh: installs the Debian packages a step needs,
# only those missing, non-interactively. A second run finds everything and does no apt work.
# Usage: ddp_ensure_packages pkg...

ddp_ensure_packages() {
  local missing=() p
  for p in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "libddp: installing missing Debian packages: ${missing[*]}" >&2
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# What building libddp needs.
DDP_BUILD_PACKAGES=(gcc libc6-dev meson ninja-build pkg-config libopenblas-dev libcjson-dev
                    libcmocka-dev libopenmpi-dev openmpi-bin)
# What the tests need on top: the PyTorch oracle, sklearn's digits, gnuplot for plots,
# iproute2 (ip, tc) for the simulated multi-host test (tests/hosts_netns.sh), Slurm's
# daemons and srun for tests/slurm.sh (about 3 MB; 27 s to install on a 2-core machine), and
# universal-ctags for the function lengths of tools/maint/check_layers.py (suite lint).
# The torch.distributed backend (src/torch, docs/torch.md) builds against Debian's
# libtorch-dev with pybind11 and Python's headers, in C++.
DDP_TEST_PACKAGES=(python3 python3-torch python3-numpy python3-sklearn gnuplot-nox iproute2
                   slurmctld slurmd slurm-client universal-ctags
                   g++ libtorch-dev pybind11-dev python3-dev)
# What CI's format check needs (tools/maint/check_format.sh): Debian's clang-format (14 on
# bookworm), whose output .clang-format was tuned against.
DDP_LINT_PACKAGES=(clang-format)

# Configures (once) and builds a build directory. Extra args go to `meson setup`.
ddp_build() {
  local dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" "$@"
  fi
  meson compile -C "$dir"
}
