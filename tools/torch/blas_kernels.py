"""The OpenBLAS kernel set libddp runs, for the PyTorch scripts in tools/.

PyTorch (Debian's python3-torch) does its float matmuls through the same OpenBLAS as
libddp. On a CPU model newer than that OpenBLAS, the library falls back to its SSE3
"Prescott" kernels; libddp then switches to SkylakeX (AVX-512) or Haswell (AVX2 + FMA)
before main (src/tensor/blas.c, docs/environment.md). OpenBLAS reads OPENBLAS_CORETYPE only
when it loads, so a Python process cannot switch once torch is imported. match_libddp(),
called before `import torch`, applies libddp's rule (same fallback list, same CPU features)
and, when it would switch, re-executes the script with OPENBLAS_CORETYPE set: the oracle
and libddp then run the same kernels, and a comparison sees the arithmetic that differs,
not a different GEMM blocking. A user's own OPENBLAS_CORETYPE is left alone.
"""
import ctypes
import os
import sys

# Kernel sets from before AVX2: OpenBLAS's fallbacks for a CPU it does not know.
OLD_CORES = {"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "barcelona",
             "katmai", "coppermine", "northwood", "banias", "sandybridge"}


def libddp_choice():
    """The core libddp would switch OpenBLAS to here, or None."""
    if os.environ.get("OPENBLAS_CORETYPE"):
        return None
    try:
        lib = ctypes.CDLL("libopenblas.so.0")
        get = lib.openblas_get_corename
    except (OSError, AttributeError):
        return None
    get.restype = ctypes.c_char_p
    name = (get() or b"").decode().strip().lower()
    if name not in OLD_CORES:
        return None
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        return None
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def match_libddp():
    """Re-executes this script with libddp's kernel choice when it differs from OpenBLAS's."""
    core = libddp_choice()
    if core:
        os.environ["OPENBLAS_CORETYPE"] = core
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable] + sys.argv)


def core_name():
    """The kernel set of the OpenBLAS this process has loaded (after `import torch`): the
    library is found in /proc/self/maps and asked (openblas_get_corename); "unknown" when
    no OpenBLAS is mapped."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line and "/" in line}
    except OSError:
        return "unknown"
    for path in sorted(paths):
        try:
            get = ctypes.CDLL(path).openblas_get_corename
        except (OSError, AttributeError):
            continue
        get.restype = ctypes.c_char_p
        return (get() or b"unknown").decode().strip()
    return "unknown"
