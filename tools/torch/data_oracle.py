#!/usr/bin/python3
"""PyTorch oracle for tests/test_data.c. Run with Debian's /usr/bin/python3 (torch 1.13).
Exit status 77: torch (or, for `digits`, scikit-learn) is not available; the test skips.

  data_oracle.py sampler IN OUT
      IN lines "sampler N W SHUFFLE DROP_LAST SEED EPOCH" or "perm N SEED".
      For a sampler line OUT gets one line per rank r = 0..W-1: the indices of
      torch.utils.data.DistributedSampler(range(N), W, r, shuffle, seed, drop_last) after
      set_epoch(EPOCH). For a perm line: torch.randperm(N, generator=Generator().manual_seed(SEED)).
  data_oracle.py digits OUT
      scikit-learn's load_digits(): one line per sample "LABEL PIXEL_SUM" (raw 0..16 pixels).
  data_oracle.py llmc IN OUT
      Reads IN, an llm.c token file, with numpy as llm.c's loader lays it out (256 int32
      header: magic, version, count, zeros; then the tokens: 20240520, 1 and uint16 for GPT-2,
      20240801, 7 and uint32 for Llama 3), checks the header, and writes the tokens reversed
      to OUT in the same format, the way llm.c's write_datafile does.
      Needs only numpy (exit 77 without it).
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def sampler_mode(inp, outp):
    try:
        import torch
        from torch.utils.data.distributed import DistributedSampler
    except Exception:
        sys.exit(77)
    with open(inp) as f, open(outp, "w") as out:
        for line in f:
            tok = line.split()
            if not tok:
                continue
            if tok[0] == "perm":
                n, seed = int(tok[1]), int(tok[2])
                g = torch.Generator()
                g.manual_seed(seed)
                out.write(" ".join(str(i) for i in torch.randperm(n, generator=g).tolist()) + "\n")
                continue
            n, w, shuffle, drop_last, seed, epoch = (int(t) for t in tok[1:7])
            for r in range(w):
                s = DistributedSampler(list(range(n)), num_replicas=w, rank=r,
                                       shuffle=bool(shuffle), seed=seed, drop_last=bool(drop_last))
                s.set_epoch(epoch)
                idx = list(iter(s))
                assert len(idx) == len(s)
                out.write(("%d" % len(idx)) + "".join(" %d" % i for i in idx) + "\n")


def digits_mode(outp):
    try:
        from sklearn.datasets import load_digits
    except Exception:
        sys.exit(77)
    d = load_digits()
    with open(outp, "w") as out:
        for x, y in zip(d.data, d.target):
            out.write("%d %d\n" % (int(y), int(round(float(x.sum())))))


# llm.c's dev/data/data_common.py HEADERS_INFO: magic -> (version, token dtype).
LLMC_FORMATS = {20240520: (1, "<u2"), 20240801: (7, "<u4")}


def llmc_mode(inp, outp):
    try:
        import numpy as np
    except Exception:
        sys.exit(77)
    with open(inp, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype="<i4")
        magic = int(header[0])
        assert magic in LLMC_FORMATS, header[:3]
        version, dtype = LLMC_FORMATS[magic]
        toks = np.frombuffer(f.read(), dtype=dtype)
    assert header[1] == version, header[:3]
    assert header[2] == len(toks), (header[2], len(toks))
    assert not header[3:].any(), "reserved header ints are not zero"
    out_header = np.zeros(256, dtype="<i4")
    out_header[0], out_header[1], out_header[2] = magic, version, len(toks)
    with open(outp, "wb") as f:
        f.write(out_header.tobytes())
        f.write(np.ascontiguousarray(toks[::-1]).astype(dtype).tobytes())


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "sampler":
        sampler_mode(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "llmc":
        llmc_mode(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "digits":
        digits_mode(sys.argv[2])
    else:
        sys.stderr.write(__doc__)
        sys.exit(2)
