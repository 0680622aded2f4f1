#!/usr/bin/env python3
"""A small safetensors reader and writer in pure Python (standard library only).

Written from the format description, independently of libddp's C code and of the
`safetensors` package (which Debian does not ship), so that each side can check the other:

    8 bytes   N, little-endian unsigned header length
    N bytes   UTF-8 JSON object: {"name": {"dtype": "F32", "shape": [2, 3],
              "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "value"}}
              optionally padded with trailing spaces
    rest      the data block; offsets are relative to it, and the tensors' ranges
              tile it exactly (no overlap, no hole, nothing after the last one)

Tensor bytes are little-endian, row-major. The API:

    tensors, metadata = load(path)        # OrderedDict name -> (dtype, shape, bytes), dict
    save(path, tensors, metadata=None)    # tensors: mapping or list of (name, triple)
    values = decode(dtype, data)          # list of Python numbers (BF16 and F16 too)
    data = encode(dtype, values)
    to_torch(dtype, shape, data) / from_torch(tensor)   # only when torch is importable
    load_torch(path) / save_torch(path, named_tensors, metadata=None)

load() returns tensors in file order (sorted by data offsets); save() writes them in the
given order, JSON keys in that order after "__metadata__", and replaces the target file
atomically. Errors in a file raise SafetensorsError naming the problem.

Command line (used by libddp's tests):
    safetensors.py dump PATH      JSON on stdout: tensors in file order with dtype, shape,
                                  data_offsets, hex bytes and decoded values (as strings),
                                  plus the metadata
    safetensors.py sample PATH    writes the sample file described in sample_tensors()
    safetensors.py check PATH...  one line per file: "ok" or "invalid: <reason>"
    safetensors.py selftest       checks this module against itself (and torch if present)
"""

import collections
import json
import os
import struct
import sys
import tempfile

__all__ = ["SafetensorsError", "DTYPES", "load", "loads", "save", "dumps", "decode",
           "encode", "to_torch", "from_torch", "load_torch", "save_torch"]

MAX_HEADER = 100_000_000
META_KEY = "__metadata__"

# dtype -> (element size, struct code or None when struct has none)
DTYPES = {
    "BOOL": (1, "?"), "U8": (1, "B"), "I8": (1, "b"),
    "I16": (2, "h"), "U16": (2, "H"), "F16": (2, "e"), "BF16": (2, None),
    "I32": (4, "i"), "U32": (4, "I"), "F32": (4, "f"),
    "I64": (8, "q"), "U64": (8, "Q"), "F64": (8, "d"),
}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


class SafetensorsError(ValueError):
    """A malformed file or an invalid argument; the message names the problem."""


def _no_duplicates(pairs):
    seen = collections.OrderedDict()
    for key, value in pairs:
        if key in seen:
            raise SafetensorsError("duplicate key %r in the header" % key)
        seen[key] = value
    return seen


def _exact_uint(value):
    # bool is an int subclass in Python; JSON true/false are not numbers.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def loads(blob):
    """Parses a whole file image; returns (OrderedDict name -> (dtype, shape, bytes), metadata)."""
    blob = memoryview(blob)
    if len(blob) < 8:
        raise SafetensorsError("file is %d bytes, shorter than the header length" % len(blob))
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER:
        raise SafetensorsError("header length %d exceeds %d" % (n, MAX_HEADER))
    if n > len(blob) - 8:
        raise SafetensorsError("header length %d runs past the end of the file" % n)
    raw = bytes(blob[8:8 + n])
    if not raw.startswith(b"{"):
        raise SafetensorsError("header does not start with '{'")
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise SafetensorsError("header is not UTF-8: %s" % e) from None
    except json.JSONDecodeError as e:
        raise SafetensorsError("header is not valid JSON: %s" % e) from None
    except RecursionError:
        raise SafetensorsError("header JSON is nested too deeply") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    data = blob[8 + n:]

    metadata = collections.OrderedDict()
    entries = []
    for index, (name, info) in enumerate(header.items()):
        if name == META_KEY:
            if not isinstance(info, dict):
                raise SafetensorsError("__metadata__ is not an object")
            for k, v in info.items():
                if not isinstance(v, str):
                    raise SafetensorsError("__metadata__ value of %r is not a string" % k)
                metadata[k] = v
            continue
        if not isinstance(info, dict):
            raise SafetensorsError("tensor %r is not an object" % name)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in info:
                raise SafetensorsError("tensor %r has no %r field" % (name, field))
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise SafetensorsError("tensor %r: unknown dtype %r" % (name, dtype))
        if not isinstance(shape, list) or not all(_exact_uint(d) for d in shape):
            raise SafetensorsError("tensor %r: shape is not a list of non-negative integers"
                                   % name)
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_exact_uint(o) for o in offsets)):
            raise SafetensorsError("tensor %r: data_offsets is not two non-negative integers"
                                   % name)
        begin, end = offsets
        if begin > end:
            raise SafetensorsError("tensor %r: data_offsets [%d, %d] begin > end"
                                   % (name, begin, end))
        if end > len(data):
            raise SafetensorsError("tensor %r: data_offsets [%d, %d] past the data block (%d)"
                                   % (name, begin, end, len(data)))
        numel = 1
        for d in shape:
            numel *= d
        need = numel * DTYPES[dtype][0]
        if end - begin != need:
            raise SafetensorsError("tensor %r: %d bytes in data_offsets, %s%r needs %d"
                                   % (name, end - begin, dtype, shape, need))
        entries.append((begin, end, index, name, dtype, tuple(shape)))

    entries.sort()
    pos = 0
    tensors = collections.OrderedDict()
    for begin, end, _, name, dtype, shape in entries:
        if begin < pos:
            raise SafetensorsError("tensor %r [%d, %d] overlaps the previous tensor"
                                   % (name, begin, end))
        if begin > pos:
            raise SafetensorsError("hole of %d bytes before tensor %r" % (begin - pos, name))
        pos = end
        tensors[name] = (dtype, shape, bytes(data[begin:end]))
    if pos != len(data):
        raise SafetensorsError("%d trailing bytes after the last tensor" % (len(data) - pos))
    return tensors, metadata


def load(path):
    """Reads a file; see loads()."""
    with open(path, "rb") as f:
        return loads(f.read())


def _items(tensors):
    return list(tensors.items()) if hasattr(tensors, "items") else list(tensors)


def dumps(tensors, metadata=None):
    """The file image for tensors (mapping or list of (name, (dtype, shape, bytes)))."""
    header = collections.OrderedDict()
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise SafetensorsError("metadata keys and values must be strings")
        header[META_KEY] = collections.OrderedDict(metadata)
    chunks = []
    offset = 0
    for name, (dtype, shape, data) in _items(tensors):
        if not isinstance(name, str) or not name or name == META_KEY or name in header:
            raise SafetensorsError("empty, reserved or duplicate tensor name %r" % (name,))
        if dtype not in DTYPES:
            raise SafetensorsError("tensor %r: unknown dtype %r" % (name, dtype))
        shape = [int(d) for d in shape]
        numel = 1
        for d in shape:
            if d < 0:
                raise SafetensorsError("tensor %r: negative dimension" % name)
            numel *= d
        data = bytes(data)
        if len(data) != numel * DTYPES[dtype][0]:
            raise SafetensorsError("tensor %r: %d bytes for %s%r" % (name, len(data), dtype,
                                                                      shape))
        header[name] = collections.OrderedDict(
            [("dtype", dtype), ("shape", shape), ("data_offsets", [offset, offset + len(data)])])
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def save(path, tensors, metadata=None):
    """Writes atomically: a temporary file beside path, fsync, rename, fsync of the directory."""
    blob = dumps(tensors, metadata)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def decode(dtype, data):
    """Element values as Python numbers (bool for BOOL)."""
    size, code = DTYPES[dtype]
    n = len(data) // size
    if dtype == "BF16":
        # bfloat16 is the top half of a float32.
        halves = struct.unpack("<%dH" % n, data)
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    return list(struct.unpack("<%d%s" % (n, code), data))


def _f32_to_bf16_bits(x):
    (bits,) = struct.unpack("<I", struct.pack("<f", x))
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x7FFFFF):
        return (bits >> 16) | 0x40  # NaN stays a quiet NaN
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # nearest, ties to even


def encode(dtype, values):
    """Bytes for values; floats round to nearest even when narrowed."""
    size, code = DTYPES[dtype]
    if dtype == "BF16":
        return struct.pack("<%dH" % len(values), *[_f32_to_bf16_bits(v) for v in values])
    return struct.pack("<%d%s" % (len(values), code), *values)


# ----------------------------------------------------------------------- torch -------

def _torch():
    import torch  # noqa: imported lazily, only where torch helpers are used
    return torch


def _torch_dtypes():
    torch = _torch()
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def to_torch(dtype, shape, data):
    """A new CPU tensor holding a copy of data."""
    torch = _torch()
    tdt = _torch_dtypes()[dtype]
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return torch.empty(tuple(shape), dtype=tdt)
    return torch.frombuffer(bytearray(data), dtype=tdt).reshape(tuple(shape)).clone()


def from_torch(tensor):
    """(dtype, shape, bytes) of a tensor (copied to contiguous CPU memory)."""
    import ctypes
    names = {v: k for k, v in _torch_dtypes().items()}
    if tensor.dtype not in names:
        raise SafetensorsError("torch dtype %s has no safetensors name here" % tensor.dtype)
    t = tensor.detach().cpu().contiguous()
    nbytes = t.numel() * t.element_size()
    data = ctypes.string_at(t.data_ptr(), nbytes) if nbytes else b""
    return names[t.dtype], tuple(t.shape), data


def load_torch(path):
    """(OrderedDict name -> torch tensor, metadata)."""
    tensors, metadata = load(path)
    out = collections.OrderedDict((k, to_torch(*v)) for k, v in tensors.items())
    return out, metadata


def save_torch(path, named_tensors, metadata=None):
    """named_tensors: mapping or list of (name, torch tensor)."""
    save(path, [(k, from_torch(v)) for k, v in _items(named_tensors)], metadata)


# ----------------------------------------------------------------------- CLI ---------

def sample_tensors():
    """The sample file's contents. libddp's test computes the same values independently:
    element i of each tensor is
      F32   float32(i * 0.1 - 1)          F64  i * 0.1 - 1
      F16   (i - 5) * 0.5                 BF16 (i - 5) * 0.25
      I32   int32(i * 2654435761 mod 2^32)
      I64   int64(i * 0x9E3779B97F4A7C15 mod 2^64)
      U8    (i * 37 + 11) mod 256         BOOL i % 3 == 0
    The U8 tensor comes first with 17 bytes, so the F32 tensor after it starts misaligned."""
    def ints(n, mul, bits):
        out = []
        for i in range(n):
            v = (i * mul) % (1 << bits)
            out.append(v - (1 << bits) if v >= 1 << (bits - 1) else v)
        return out

    spec = [
        ("u8", "U8", [17], lambda n: [(i * 37 + 11) % 256 for i in range(n)]),
        ("layer.0.weight", "F32", [2, 3, 4], lambda n: [i * 0.1 - 1 for i in range(n)]),
        ("f64", "F64", [5], lambda n: [i * 0.1 - 1 for i in range(n)]),
        ("half", "F16", [3, 3], lambda n: [(i - 5) * 0.5 for i in range(n)]),
        ("brain", "BF16", [2, 5], lambda n: [(i - 5) * 0.25 for i in range(n)]),
        ("i32", "I32", [7], lambda n: ints(n, 2654435761, 32)),
        ("i64", "I64", [2, 2], lambda n: ints(n, 0x9E3779B97F4A7C15, 64)),
        ("mask", "BOOL", [3, 2], lambda n: [i % 3 == 0 for i in range(n)]),
        ("scalar", "F32", [], lambda n: [i * 0.1 - 1 for i in range(n)]),
        ("empty", "I64", [0, 3], lambda n: []),
    ]
    tensors = []
    for name, dtype, shape, gen in spec:
        numel = 1
        for d in shape:
            numel *= d
        tensors.append((name, (dtype, shape, encode(dtype, gen(numel)))))
    metadata = collections.OrderedDict([("format", "pt"), ("writer", "tools/torch/safetensors.py"),
                                        ("note", "h\u00e9llo \u2713")])
    return tensors, metadata


def _value_text(dtype, v):
    if dtype in FLOAT_DTYPES:
        return repr(float(v))  # repr round-trips exactly; 'inf', '-inf', 'nan' for the rest
    return str(int(v))


def _dump(path):
    tensors, metadata = load(path)
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    out = {"tensors": [], "metadata": metadata}
    for name, (dtype, shape, data) in tensors.items():
        out["tensors"].append({
            "name": name, "dtype": dtype, "shape": list(shape),
            "data_offsets": header[name]["data_offsets"], "hex": data.hex(),
            "values": [_value_text(dtype, v) for v in decode(dtype, data)]})
    json.dump(out, sys.stdout)  # ASCII with \u escapes: independent of the locale
    sys.stdout.write("\n")


def _check(paths):
    for path in paths:
        try:
            load(path)
        except SafetensorsError as e:
            print("invalid: %s" % e)
        else:
            print("ok")


def _selftest():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    tensors, metadata = sample_tensors()
    blob = dumps(tensors, metadata)
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0 and blob[8 + n - 1:8 + n] in (b" ", b"}"), "header padding"
    back, meta = loads(blob)
    assert list(back.items()) == [(k, (d, tuple(s), b)) for k, (d, s, b) in tensors], "round trip"
    assert meta == metadata
    bad = [
        (b"\x01\x00\x00\x00\x00\x00\x00\x00{", "JSON"),
        (struct.pack("<Q", 2) + b"{}" + b"\x00", "trailing"),
        (struct.pack("<Q", 99) + b"{}", "past the end"),
    ]
    for image, why in bad:
        try:
            loads(image)
        except SafetensorsError as e:
            assert why in str(e), (why, str(e))
        else:
            raise AssertionError("accepted a bad file: " + why)
    checked = "module"
    try:
        _torch()
    except ImportError:
        pass
    else:
        for name, triple in back.items():
            t = to_torch(*triple)
            assert from_torch(t) == triple, name
        checked += "+torch"
    print("selftest ok (%s)" % checked)


def main(argv):
    if len(argv) == 3 and argv[1] == "dump":
        _dump(argv[2])
    elif len(argv) == 3 and argv[1] == "sample":
        save(argv[2], *sample_tensors())
    elif len(argv) >= 3 and argv[1] == "check":
        _check(argv[2:])
    elif len(argv) == 2 and argv[1] == "selftest":
        _selftest()
    else:
        sys.stderr.write(__doc__.split("Command line")[1])
        return 2
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except SafetensorsError as e:
        sys.stderr.write("safetensors.py: %s\n" % e)
        sys.exit(1)
