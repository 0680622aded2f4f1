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
import struct

LLMC_MAGIC = 20240520


def is_hf_config(spec):
    return isinstance(spec, dict) and "model_type" in spec


def loss_kind(spec):
    if spec["model_type"] == "gpt2":
        return "causal_lm"
    return "mse" if int(spec.get("num_labels", 2)) == 1 else "ce"


def read_tokens(path, torch, st):
    """The token stream of path as a list of ints."""
    with open(path, "rb") as f:
        head = f.read(1024)
        if len(head) == 1024:
            magic, version, count = struct.unpack("<3i", head[:12])
            if magic == LLMC_MAGIC:
                if version != 1:
                    raise SystemExit("text_data: %s: llm.c version %d, expected 1"
                                     % (path, version))
                body = f.read()
                if len(body) < 2 * count:
                    raise SystemExit("text_data: %s: truncated: expected %d bytes of tokens, "
                                     "found %d" % (path, 2 * count, len(body)))
                return list(struct.unpack("<%dH" % count, body[:2 * count]))
    if path.endswith(".safetensors"):
        tensors, _ = st.load_torch(path)
        t = tensors.get("tokens")
        if t is None and len(tensors) == 1:
            t = next(iter(tensors.values()))
        if t is None:
            raise SystemExit("text_data: %s has no tensor \"tokens\"" % path)
        return [int(v) for v in t.reshape(-1).tolist()]
    with open(path, "rb") as f:
        return list(f.read())


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
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
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
        ids = list(r[ti].encode("utf-8"))[:max_len]
        mask = [1] * len(ids) + [0] * (max_len - len(ids))
        ids = ids + [pad_id] * (max_len - len(ids))
        feats.append([ids, mask])
        labels.append(r[li].strip())
    return feats, labels


def dataset(a, spec, torch, st):
    """(features, labels) tensors of --data for the config spec."""
    if spec["model_type"] == "gpt2":
        npos = int(spec.get("n_positions", 1024))
        block = a.block_size if a.block_size is not None else min(1024, npos)
        if block > npos:
            raise SystemExit("text_data: --block_size %d is longer than n_positions %d"
                             % (block, npos))
        blocks = lm_blocks(read_tokens(a.data, torch, st), block,
                           int(spec.get("vocab_size", 50257)), a.data)
        x = torch.tensor(blocks, dtype=torch.int64)
        return x, x.clone()
    feats, labels = text_csv(a.data, a.max_seq_length, int(spec.get("pad_token_id", 0)))
    x = torch.tensor(feats, dtype=torch.int64)
    if int(spec.get("num_labels", 2)) == 1:
        y = torch.tensor([float(v) for v in labels], dtype=torch.float32)
    else:
        y = torch.tensor([int(v) for v in labels], dtype=torch.int64)
    return x, y
