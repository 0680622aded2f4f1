#!/usr/bin/python3
"""Converts the UCI 8x8 handwritten digits (the copy Debian's python3-sklearn ships as
sklearn/datasets/data/digits.csv.gz) into tests/data/digits.safetensors:

    features  F32 [1797, 64]  pixel counts 0..16 divided by 16 (exact in f32)
    labels    I64 [1797]      digit 0..9

Dataset: "Optical Recognition of Handwritten Digits", E. Alpaydin and C. Kaynak, UCI
Machine Learning Repository (1998), https://doi.org/10.24432/C50P49, licensed under
CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/). The attribution travels in the
file's metadata; docs/data.md states it too.

Usage: make_digits.py [SRC.csv.gz] [OUT.safetensors]
Standard library only, plus tools/torch/safetensors.py beside this script.
"""
import gzip
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch"))
import safetensors  # noqa: E402  (tools/torch/safetensors.py)

DEFAULT_SRC = "/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "data",
                           "digits.safetensors")


def main(argv):
    src = argv[1] if len(argv) > 1 else DEFAULT_SRC
    out = argv[2] if len(argv) > 2 else DEFAULT_OUT
    feats, labels = [], []
    with gzip.open(src, "rt") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            vals = [int(float(v)) for v in line.split(",")]
            if len(vals) != 65:
                raise SystemExit("%s:%d: %d fields, expected 65" % (src, lineno, len(vals)))
            if not all(0 <= v <= 16 for v in vals[:64]) or not 0 <= vals[64] <= 9:
                raise SystemExit("%s:%d: value out of range" % (src, lineno))
            feats.extend(v / 16.0 for v in vals[:64])
            labels.append(vals[64])
    n = len(labels)
    if n != 1797:
        raise SystemExit("%s: %d samples, expected 1797" % (src, n))
    tensors = [
        ("features", ("F32", [n, 64], struct.pack("<%df" % len(feats), *feats))),
        ("labels", ("I64", [n], struct.pack("<%dq" % n, *labels))),
    ]
    meta = {
        "dataset": "UCI Optical Recognition of Handwritten Digits (8x8 test set, 1797 samples)",
        "creators": "E. Alpaydin, C. Kaynak",
        "source": "https://doi.org/10.24432/C50P49 (copy from scikit-learn's digits.csv.gz)",
        "license": "CC BY 4.0 (https://creativecommons.org/licenses/by/4.0/)",
        "preprocessing": "features = pixel count (0..16) / 16 as F32; labels I64",
    }
    safetensors.save(out, tensors, meta)
    print("wrote %s: %d samples, %d bytes" % (out, n, os.path.getsize(out)))


if __name__ == "__main__":
    main(sys.argv)
