"""Text data for torch_reference.py: the same datasets ddp-train builds for GPT-2 and BERT
(docs/data.md, docs/train.md), prepared here in Python from the same files.

- Token streams (ddp_tokens_read): llm.c's .bin (256 int32 header: magic 20240520,
  version 1, token count; then uint16 tokens), a safetensors file holding a 1-D integer
  tensor "tokens" (or its only tensor), or any other file as UTF-8 text through the
  byte-level tokenizer (id = byte value).
- Causal-LM blocks (ddp_dataset_lm_blocks, run_clm's group_texts): n // block_size blocks,
  the remainder dropped; features = labels = the block (the model shifts).
- Text CSV (ddp_dataset_from_text_csv, run_glue with padding to max_seq_length): a header
  row naming the columns "text" and "label", RFC 4180 quoting; each text byte-tokenized,
  truncated to max_seq_length, padded with pad_token_id; features [2, L] = (ids,
  attention_mask), labels int64 (num_labels > 1) or float32 (num_labels == 1).
"""

import csv
import io
import struct

LLMC_MAGIC = 20240520


def is_hf_config(spec):
    return isinstance(spec, dict) and "model_type" in spec


# Causal LMs train on a token stream in blocks (run_clm); the others on a text,label CSV.
CAUSAL_LM = ("gpt2", "llama")


def loss_kind(spec):
    if spec["model_type"] in CAUSAL_LM:
        return "causal_lm"
    return "mse" if int(spec.get("num_labels", 2)) == 1 else "ce"


LLMC_FORMATS = {LLMC_MAGIC: (1, "H", 2), 20240801: (7, "I", 4)}  # version, struct code, size


def _llmc(path, data):
    magic, version, count = struct.unpack("<3i", data[:12])
    want, code, size = LLMC_FORMATS[magic]
    if version != want:
        raise SystemExit("text_data: %s: llm.c version %d, expected %d" % (path, version, want))
    body = data[1024:]
    if len(body) != size * count:
        raise SystemExit("text_data: %s: expected %d bytes of tokens, found %d"
                         % (path, size * count, len(body)))
    return list(struct.unpack("<%d%s" % (count, code), body))


def read_tokens(path, torch, st):
    """The token stream of path as a list of ints, the format chosen as ddp_tokens_read
    chooses it: by the extension (.bin, .safetensors, .txt), else by the content (an llm.c
    magic, a safetensors header, else text)."""
    with open(path, "rb") as f:
        data = f.read()
    low = path.lower()
    magic = struct.unpack("<i", data[:4])[0] if len(data) >= 1024 else None
    if low.endswith(".bin") or (not low.endswith((".safetensors", ".txt"))
                                and magic in LLMC_FORMATS):
        return _llmc(path, data)
    if low.endswith(".safetensors") or (not low.endswith(".txt") and b"\0" in data[:8000]):
        tensors, _ = st.load_torch(path)
        t = tensors.get("tokens")
        if t is None and len(tensors) == 1:
            t = next(iter(tensors.values()))
        if t is None:
            raise SystemExit("text_data: %s has no tensor \"tokens\"" % path)
        return [int(v) for v in t.reshape(-1).tolist()]
    return list(data)


def lm_blocks(tokens, block, vocab, path):
    n = len(tokens) // block
    if n == 0:
        raise SystemExit("text_data: %s: %d tokens, fewer than one block of %d"
                         % (path, len(tokens), block))
    tokens = tokens[:n * block]
    for i, t in enumerate(tokens):
        if t < 0 or t >= vocab:
            raise SystemExit("text_data: %s: token %d at position %d is beyond the "
                             "vocabulary (vocab_size %d)" % (path, t, i, vocab))
    return [tokens[i * block:(i + 1) * block] for i in range(n)]


def text_csv(path, max_len, pad_id):
    # latin-1 maps every byte to one character and back: the texts' bytes exactly, as the
    # byte tokenizer sees them, whatever their encoding.
    with open(path, newline="", encoding="latin-1") as f:
        text = f.read()
    if text.startswith("\xef\xbb\xbf"):
        text = text[3:]
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if not rows:
        raise SystemExit("text_data: %s is empty" % path)
    head = [h.strip() for h in rows[0]]
    try:
        ti, li = head.index("text"), head.index("label")
    except ValueError:
        raise SystemExit("text_data: %s: the header needs columns text and label, has %s"
                         % (path, head))
    feats, labels = [], []
    for r in rows[1:]:
        if not r:
            continue
        ids = list(r[ti].encode("latin-1"))[:max_len]
        mask = [1] * len(ids) + [0] * (max_len - len(ids))
        ids = ids + [pad_id] * (max_len - len(ids))
        feats.append([ids, mask])
        labels.append(r[li].strip())
    return feats, labels


def dataset(a, spec, torch, st):
    """(features, labels) tensors of --data for the config spec."""
    if spec["model_type"] in CAUSAL_LM:
        # Transformers' defaults: GPT2Config's n_positions 1024 and vocab 50257,
        # LlamaConfig's max_position_embeddings 2048 and vocab 32000.
        llama = spec["model_type"] == "llama"
        pos_key = "max_position_embeddings" if llama else "n_positions"
        npos = int(spec.get(pos_key, 2048 if llama else 1024))
        block = a.block_size if a.block_size is not None else min(1024, npos)
        if block > npos:
            raise SystemExit("text_data: --block_size %d is longer than %s %d"
                             % (block, pos_key, npos))
        blocks = lm_blocks(read_tokens(a.data, torch, st), block,
                           int(spec.get("vocab_size", 32000 if llama else 50257)), a.data)
        x = torch.tensor(blocks, dtype=torch.int64)
        return x, x.clone()
    feats, labels = text_csv(a.data, a.max_seq_length, int(spec.get("pad_token_id", 0) or 0))
    x = torch.tensor(feats, dtype=torch.int64)
    if int(spec.get("num_labels", 2)) == 1:
        y = torch.tensor([float(v) for v in labels], dtype=torch.float32)
    else:
        y = torch.tensor([int(v) for v in labels], dtype=torch.int64)
    return x, y
