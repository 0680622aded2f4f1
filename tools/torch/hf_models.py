#!/usr/bin/python3
"""PyTorch twins of Hugging Face Transformers' GPT2LMHeadModel,
BertForSequenceClassification and LlamaForCausalLM (the latter in tools/torch/hf_llama.py), for
checking libddp's GPT-2, BERT and Llama families (src/nn/gpt2.c, src/nn/bert.c,
src/nn/llama.c) and for tools/torch/torch_reference.py. Transformers is not packaged in Debian, so the
modules are written here from Transformers' modeling semantics (docs/nn.md, "Transformers"),
with the same module names, the same parameters() order and the same state_dict keys, so that a
checkpoint directory moves between this file, libddp and Transformers itself.

Run with Debian's interpreter (/usr/bin/python3, torch 1.13). Library use:

    cfg = load_config(path_or_dict)          # Transformers' keys and defaults
    model = build(cfg, torch.float32)        # GPT2LMHeadModel / BertForSequenceClassification
    init_weights(model)                      # Transformers' _init_weights (torch's RNG)
    save_pretrained(model, DIR, max_shard_size="5GB")  # DIR/config.json + DIR/model.safetensors
                                             # (or shards + model.safetensors.index.json)
    model = from_pretrained(DIR, dtype)      # strict by name (see load_state)
    logits = forward_ddp_layout(model, x)    # x as libddp's ddp_model_forward takes it
    loss = compute_loss(model, logits, labels)

Command line (tests/test_transformers.c):

    hf_models.py step DIR     DIR/model (a pretrained dir), DIR/run.json, DIR/x.bin,
                              DIR/labels.bin -> logits.bin, loss.bin, grads.bin (parameters()
                              order, concatenated), order.json (AccumulateGrad hook order)
    hf_models.py init DIR SEED [MAX_SHARD_SIZE]
                              DIR/config.json -> a model with Transformers' init from
                              torch.manual_seed(SEED), saved into DIR (save_pretrained with
                              max_shard_size, default "5GB": shards + index when larger)
    hf_models.py same DIR_A DIR_B  loads both strictly; exit 0 when every state_dict tensor
                              is bitwise equal, else 1 naming the first that differs
    hf_models.py check DIR    loads DIR strictly; prints "ok" and the parameter names, or
                              exits 3 with the load error's text on stderr
    hf_models.py names CONFIG prints {"names": [...], "shapes": [...]} in parameters() order

Exit status 0 on success; any other failure raises.
"""

import json
import math
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree

if __name__ == "__main__":
    import blas_kernels  # noqa: E402
    blas_kernels.match_libddp()  # before torch loads OpenBLAS: libddp's GEMM kernels

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import safetensors as st  # noqa: E402  (tools/torch/safetensors.py)
import hf_llama  # noqa: E402  (tools/torch/hf_llama.py)

# ---------------------------------------------------------------- configuration --------

GPT2_DEFAULTS = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
    "attn_pdrop": 0.1, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "tie_word_embeddings": True,
}
# Transformers' GPT2Config.attribute_map: generic names accepted for GPT-2's own.
GPT2_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}

BERT_DEFAULTS = {
    "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
    "layer_norm_eps": 1e-12, "initializer_range": 0.02, "pad_token_id": 0,
    "classifier_dropout": None, "position_embedding_type": "absolute",
}


class Config:
    """A config.json's values as attributes (model_type, Transformers' keys)."""

    def __init__(self, values):
        self.__dict__.update(values)

    def to_dict(self):
        return dict(self.__dict__)


def load_config(src):
    """A Config from a config.json path, a directory holding one, or a dict, with
    Transformers' defaults for absent keys (the same defaults as src/nn/hf_config.c)."""
    if isinstance(src, str):
        path = os.path.join(src, "config.json") if os.path.isdir(src) else src
        with open(path) as f:
            src = json.load(f)
    d = dict(src)
    mt = d.get("model_type")
    if mt == "gpt2":
        for alias, key in GPT2_ALIASES.items():
            if alias in d and key not in d:
                d[key] = d.pop(alias)
        vals = dict(GPT2_DEFAULTS)
    elif mt == "bert":
        vals = dict(BERT_DEFAULTS)
    elif mt == "llama":
        vals = dict(hf_llama.LLAMA_DEFAULTS)
    else:
        raise ValueError("unknown model_type %r (gpt2, bert, llama)" % (mt,))
    vals.update({k: v for k, v in d.items() if k in vals})
    vals["model_type"] = mt
    if mt == "llama":
        vals = hf_llama.fill_config(vals)
    if mt == "bert":
        if "id2label" in d:
            vals["num_labels"] = len(d["id2label"])
        else:
            vals["num_labels"] = d.get("num_labels", 2)
        vals["problem_type"] = d.get("problem_type")
    return Config(vals)


def config_dict(cfg, dtype=torch.float32):
    """The config.json object save_pretrained writes (Transformers' keys, sorted)."""
    d = cfg.to_dict()
    out = {}
    if cfg.model_type == "gpt2":
        out.update({k: d[k] for k in GPT2_DEFAULTS})
        out["architectures"] = ["GPT2LMHeadModel"]
    elif cfg.model_type == "llama":
        out.update({k: d[k] for k in hf_llama.LLAMA_DEFAULTS})
        out["architectures"] = ["LlamaForCausalLM"]
    else:
        out.update({k: d[k] for k in BERT_DEFAULTS})
        out["architectures"] = ["BertForSequenceClassification"]
        n = d["num_labels"]
        out["id2label"] = {str(i): "LABEL_%d" % i for i in range(n)}
        out["label2id"] = {"LABEL_%d" % i: i for i in range(n)}
        if d.get("problem_type"):
            out["problem_type"] = d["problem_type"]
    out["model_type"] = cfg.model_type
    out["torch_dtype"] = "float64" if dtype == torch.float64 else "float32"
    return dict(sorted(out.items()))


# ---------------------------------------------------------------- activations ----------

def gelu_new(x):
    """Transformers' NewGELUActivation: the tanh approximation written out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


ACTIVATIONS = {
    "gelu": F.gelu, "gelu_python": F.gelu, "gelu_new": gelu_new,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "silu": F.silu, "swish": F.silu,
}


def activation(name):
    if name not in ACTIVATIONS:
        raise ValueError("unsupported activation %r (%s)" % (name, ", ".join(ACTIVATIONS)))
    return ACTIVATIONS[name]


# ---------------------------------------------------------------- GPT-2 ----------------

class Conv1D(nn.Module):
    """Transformers' Conv1D: a linear layer whose weight is stored [in, out]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        shape = x.size()[:-1] + (self.nf,)
        y = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return y.view(shape)


def heads(x, n_head):
    """[B, T, C] -> [B, n_head, T, C / n_head]."""
    b, t, c = x.shape
    return x.view(b, t, n_head, c // n_head).permute(0, 2, 1, 3)


def merge(x):
    """[B, H, T, D] -> [B, T, H * D]."""
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).contiguous().view(b, t, h * d)


class GPT2Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        c = cfg.n_embd
        if c % cfg.n_head:
            raise ValueError("n_embd (%d) must be divisible by n_head (%d)" % (c, cfg.n_head))
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.c_attn = Conv1D(3 * c, c)
        self.c_proj = Conv1D(c, c)
        self.attn_dropout = nn.Dropout(cfg.attn_pdrop)
        self.resid_dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, h):
        cfg = self.cfg
        q, k, v = self.c_attn(h).split(cfg.n_embd, dim=2)
        q, k, v = heads(q, cfg.n_head), heads(k, cfg.n_head), heads(v, cfg.n_head)
        w = torch.matmul(q, k.transpose(-1, -2))
        if cfg.scale_attn_weights:
            w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype)
        if cfg.scale_attn_by_inverse_layer_idx:
            w = w / float(self.layer_idx + 1)
        t = q.size(-2)
        causal = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
        w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        w = F.softmax(w, dim=-1)
        w = self.attn_dropout(w)
        a = merge(torch.matmul(w, v))
        return self.resid_dropout(self.c_proj(a))


class GPT2MLP(nn.Module):
    def __init__(self, inner, cfg):
        super().__init__()
        self.c_fc = Conv1D(inner, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, inner)
        self.act = activation(cfg.activation_function)
        self.dropout = nn.Dropout(cfg.resid_pdrop)

    def forward(self, h):
        return self.dropout(self.c_proj(self.act(self.c_fc(h))))


class GPT2Block(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        inner = cfg.n_inner if cfg.n_inner is not None else 4 * cfg.n_embd
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(inner, cfg)

    def forward(self, h):
        h = self.attn(self.ln_1(h)) + h
        return h + self.mlp(self.ln_2(h))


class GPT2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.embd_pdrop)
        self.h = nn.ModuleList([GPT2Block(cfg, i) for i in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, ids):
        t = ids.size(-1)
        if t > self.cfg.n_positions:
            raise ValueError("sequence length %d > n_positions %d" % (t, self.cfg.n_positions))
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0)
        h = self.wte(ids)
        h = h + self.wpe(pos)
        h = self.drop(h)
        for block in self.h:
            h = block(h)
        return self.ln_f(h)


class GPT2LMHeadModel(nn.Module):
    base_model_prefix = "transformer"

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))


# ---------------------------------------------------------------- BERT -----------------

class BertEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, c, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, c)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, c)
        self.LayerNorm = nn.LayerNorm(c, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.max_pos = cfg.max_position_embeddings

    def forward(self, ids, token_type_ids):
        t = ids.size(1)
        if t > self.max_pos:
            raise ValueError("sequence length %d > max_position_embeddings %d" % (t, self.max_pos))
        e = self.word_embeddings(ids) + self.token_type_embeddings(token_type_ids)
        e += self.position_embeddings(torch.arange(t, dtype=torch.long).unsqueeze(0))
        return self.dropout(self.LayerNorm(e))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg.hidden_size
        if c % cfg.num_attention_heads:
            raise ValueError("hidden_size (%d) is not a multiple of num_attention_heads (%d)"
                             % (c, cfg.num_attention_heads))
        self.n_head = cfg.num_attention_heads
        self.query = nn.Linear(c, c)
        self.key = nn.Linear(c, c)
        self.value = nn.Linear(c, c)
        self.dropout = nn.Dropout(cfg.attention_probs_dropout_prob)

    def forward(self, h, ext_mask):
        q_lin = self.query(h)
        k = heads(self.key(h), self.n_head)
        v = heads(self.value(h), self.n_head)
        q = heads(q_lin, self.n_head)
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1))
        s = s + ext_mask
        p = self.dropout(F.softmax(s, dim=-1))
        return merge(torch.matmul(p, v))


class BertSelfOutput(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, h, ext_mask):
        return self.output(self.self(h, ext_mask), h)


class BertIntermediate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, h):
        return self.act(self.dense(h))


class BertOutput(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, h, ext_mask):
        a = self.attention(h, ext_mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, h, ext_mask):
        for layer in self.layer:
            h = layer(h, ext_mask)
        return h


class BertPooler(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, h):
        return self.activation(self.dense(h[:, 0]))


class BertModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)

    def forward(self, ids, attention_mask, token_type_ids):
        e = self.embeddings(ids, token_type_ids)
        # 1 keeps a key, 0 masks it for every query: (1 - mask) * the dtype's lowest value.
        m = attention_mask[:, None, None, :].to(e.dtype)
        ext = (1.0 - m) * torch.finfo(e.dtype).min
        return self.pooler(self.encoder(e, ext))


class BertForSequenceClassification(nn.Module):
    base_model_prefix = "bert"

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.num_labels = cfg.num_labels
        self.bert = BertModel(cfg)
        p = cfg.classifier_dropout
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        return self.classifier(self.dropout(self.bert(ids, attention_mask, token_type_ids)))


# ---------------------------------------------------------------- build, init, loss ----

def build(cfg, dtype=torch.float32):
    if not isinstance(cfg, Config):
        cfg = load_config(cfg)
    if cfg.model_type == "llama":
        model = hf_llama.LlamaForCausalLM(cfg, activation(cfg.hidden_act))
    elif cfg.model_type == "gpt2":
        model = GPT2LMHeadModel(cfg)
    else:
        model = BertForSequenceClassification(cfg)
    return model.to(dtype)


@torch.no_grad()
def init_weights(model):
    """Transformers' _init_weights: Linear/Conv1D weights and embeddings N(0, initializer_range),
    biases 0, padding rows 0, LayerNorm 1 and 0; GPT-2's c_proj weights then
    N(0, initializer_range / sqrt(2 n_layer))."""
    cfg = model.config
    if cfg.model_type == "llama":
        hf_llama.init_weights(model)
        return
    std = cfg.initializer_range
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, Conv1D)):
            mod.weight.normal_(0.0, std)
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, nn.Embedding):
            mod.weight.normal_(0.0, std)
            if mod.padding_idx is not None:
                mod.weight[mod.padding_idx].zero_()
        elif isinstance(mod, nn.LayerNorm):
            mod.weight.fill_(1.0)
            mod.bias.zero_()
    if cfg.model_type == "gpt2":
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, std / math.sqrt(2 * cfg.n_layer))


def split_ddp_layout(model, x):
    """libddp's model input -> (ids, attention_mask, token_type_ids): GPT-2 takes ids [B, T];
    BERT takes [B, T] ids, [B, 2, T] (ids, attention_mask) or [B, 3, T] (plus token types)."""
    if x.dim() == 2:
        return x, None, None
    rows = [x[:, i] for i in range(x.size(1))]
    return rows[0], rows[1], rows[2] if len(rows) > 2 else None


def forward_ddp_layout(model, x):
    ids, mask, tt = split_ddp_layout(model, x)
    if model.config.model_type in ("gpt2", "llama"):
        return model(ids)
    return model(ids, mask, tt)


def compute_loss(model, logits, labels):
    """GPT-2: logits [..., :-1, :] against labels [..., 1:], mean cross-entropy over labels
    != -100. BERT: MSE for num_labels == 1 or problem_type "regression", else cross-entropy."""
    if model.config.model_type in ("gpt2", "llama"):
        v = logits.size(-1)
        return F.cross_entropy(logits[..., :-1, :].contiguous().view(-1, v),
                               labels[..., 1:].contiguous().view(-1), ignore_index=-100)
    # Transformers' problem_type rule: regression for num_labels 1 (or when the config says
    # so), single-label classification for integer labels; multi-label (BCE) is not modelled.
    pt = model.config.problem_type
    if pt is None:
        pt = "regression" if model.num_labels == 1 else "single_label_classification"
    if pt == "regression":
        labels = labels.to(logits.dtype)
        if model.num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze())
        return F.mse_loss(logits, labels)
    return F.cross_entropy(logits.view(-1, model.num_labels), labels.view(-1))


# ---------------------------------------------------------------- checkpoint dirs ------

IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "embeddings.position_ids",
                    ".rotary_emb.inv_freq")
# The embedding a tied lm_head.weight is, per model_type.
TIED_EMBEDDING = {"gpt2": "transformer.wte.weight", "llama": "model.embed_tokens.weight"}


def tied(cfg):
    return cfg.model_type in TIED_EMBEDDING and cfg.tie_word_embeddings


def state_for_save(model):
    """state_dict without the tied lm_head.weight (save_pretrained drops shared tensors)."""
    sd = model.state_dict()
    if tied(model.config):
        sd.pop("lm_head.weight", None)
    return sd


def convert_file_size_to_int(size):
    """Transformers' convert_file_size_to_int: an int is bytes; "5GB" is 5 * 10**9, "2GiB"
    2 * 2**30, and a lower-case "b" after a decimal unit means bits ("40Mb" = 5 * 10**6)."""
    if isinstance(size, int):
        return size
    if size.upper().endswith("GIB"):
        return int(size[:-3]) * (2**30)
    if size.upper().endswith("MIB"):
        return int(size[:-3]) * (2**20)
    if size.upper().endswith("KIB"):
        return int(size[:-3]) * (2**10)
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if size.upper().endswith(unit):
            int_size = int(size[:-2]) * factor
            return int_size // 8 if size.endswith("b") else int_size
    raise ValueError("`size` is not in a valid format. Use an integer followed by the unit, "
                     "e.g., '5GB'.")


SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def shard_checkpoint(state_dict, max_shard_size="5GB"):
    """Transformers' shard_checkpoint (modeling_utils.py, 4.3x): tensors in state_dict order; a
    new shard starts when the next tensor would take the current one over max_shard_size and
    the current one holds a tensor. Returns ({file: {name: tensor}}, index or None)."""
    max_shard_size = convert_file_size_to_int(max_shard_size)
    blocks, last_block_size, total_size = [{}], 0, 0
    for key, weight in state_dict.items():
        weight_size = weight.numel() * weight.element_size()
        if last_block_size + weight_size > max_shard_size and len(blocks[-1]) > 0:
            blocks.append({})
            last_block_size = 0
        blocks[-1][key] = weight
        last_block_size += weight_size
        total_size += weight_size
    if len(blocks) == 1:
        return {SAFE_WEIGHTS_NAME: blocks[0]}, None
    shards, weight_map = {}, {}
    for idx, block in enumerate(blocks):
        name = SAFE_WEIGHTS_NAME.replace(
            ".safetensors", f"-{idx + 1:05d}-of-{len(blocks):05d}.safetensors")
        shards[name] = block
        for key in block:
            weight_map[key] = name
    return shards, {"metadata": {"total_size": total_size}, "weight_map": weight_map}


def save_pretrained(model, directory, max_shard_size="5GB"):
    os.makedirs(directory, exist_ok=True)
    dtype = next(model.parameters()).dtype
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_dict(model.config, dtype), f, indent=2)
        f.write("\n")
    state = {k: v.contiguous() for k, v in state_for_save(model).items()}
    shards, index = shard_checkpoint(state, max_shard_size)
    for name, block in shards.items():
        st.save_torch(os.path.join(directory, name), list(block.items()), {"format": "pt"})
    if index is not None:
        with open(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_weights(directory):
    """from_pretrained's weights: model.safetensors, else the files the index names
    (load_sharded_checkpoint), each checked against the index: a missing file, a tensor the
    index does not list or places in another file, a listed tensor absent from its file."""
    single = os.path.join(directory, SAFE_WEIGHTS_NAME)
    if os.path.exists(single):
        return st.load_torch(single)[0]
    index_file = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    with open(index_file, "r", encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    state = {}
    for name in sorted(set(weight_map.values())):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError("%s names %s, which is not in %s" % (index_file, name, directory))
        tensors, _ = st.load_torch(path)
        for key, value in tensors.items():
            if weight_map.get(key) != name:
                raise ValueError("tensor '%s' is in %s, but %s puts it in %s"
                                 % (key, path, index_file, weight_map.get(key)))
            state[key] = value
    for key, name in weight_map.items():
        if key not in state:
            raise ValueError("%s puts tensor '%s' in %s, which does not hold it"
                             % (index_file, key, name))
    return state


def load_state(model, state):
    """Loads a checkpoint's tensors by name, strict=True, after what Transformers tolerates:
    the causal-mask and position_ids buffers are dropped, keys of a base-model checkpoint get
    the model's prefix, and a tied lm_head.weight must only match in shape."""
    prefix = model.base_model_prefix + "."
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_SUFFIXES)}
    if state and not any(k.startswith(prefix) for k in state):
        state = {prefix + k: v for k, v in state.items()}
    own = model.state_dict()
    if tied(model.config):
        emb = TIED_EMBEDDING[model.config.model_type]
        lm = state.pop("lm_head.weight", None)
        if lm is not None and lm.shape != own["lm_head.weight"].shape:
            raise RuntimeError("size mismatch for lm_head.weight: copying a param with shape %s "
                               "from checkpoint, the shape in current model is %s."
                               % (lm.shape, own["lm_head.weight"].shape))
        if emb in state:
            state["lm_head.weight"] = state[emb]
    model.load_state_dict(state, strict=True)


def from_pretrained(directory, dtype=torch.float32):
    model = build(load_config(directory), dtype)
    load_state(model, load_weights(directory))
    return model


# ---------------------------------------------------------------- command line ---------

NP = {"f32": "<f4", "f64": "<f8", "i64": "<i8"}
DTYPES = {"f32": torch.float32, "f64": torch.float64}


def read_raw(path, dtype, shape):
    import numpy as np
    return torch.from_numpy(np.fromfile(path, dtype=NP[dtype]).reshape(shape).copy())


def write_raw(path, t):
    t.detach().contiguous().cpu().numpy().tofile(path)


def cmd_step(root):
    """One forward + backward from a pretrained dir; run.json: dtype, x_shape, labels_dtype,
    labels_shape, train (dropout must be 0 for a comparison)."""
    with open(os.path.join(root, "run.json")) as f:
        run = json.load(f)
    dt = DTYPES[run["dtype"]]
    model = from_pretrained(os.path.join(root, "model"), dt)
    model.train(run.get("train", False))
    params = list(model.parameters())
    order, keep = [], []
    for i, p in enumerate(params):
        acc = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad (DDP's trick)
        acc.register_hook(lambda *a, i=i: order.append(i))
        keep.append(acc)
    x = read_raw(os.path.join(root, "x.bin"), "i64", run["x_shape"])
    labels = read_raw(os.path.join(root, "labels.bin"), run["labels_dtype"], run["labels_shape"])
    if labels.dtype.is_floating_point:
        labels = labels.to(dt)
    logits = forward_ddp_layout(model, x)
    loss = compute_loss(model, logits, labels)
    loss.backward()
    write_raw(os.path.join(root, "logits.bin"), logits)
    write_raw(os.path.join(root, "loss.bin"), loss)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    write_raw(os.path.join(root, "grads.bin"), torch.cat([g.reshape(-1) for g in grads]))
    names = [n for n, _ in model.named_parameters()]
    with open(os.path.join(root, "order.json"), "w") as f:
        json.dump({"order": order, "names": names}, f)


def cmd_init(root, seed, max_shard_size="5GB"):
    cfg = load_config(root)
    with open(os.path.join(root, "config.json")) as f:
        dtype = torch.float64 if json.load(f).get("torch_dtype") == "float64" else torch.float32
    torch.manual_seed(seed)
    model = build(cfg, dtype)
    init_weights(model)
    save_pretrained(model, root, max_shard_size)


def cmd_check(root):
    try:
        model = from_pretrained(root)
    except (RuntimeError, ValueError) as e:
        sys.stderr.write(str(e) + "\n")
        return 3
    print("ok")
    for n, _ in model.named_parameters():
        print(n)
    return 0


def cmd_same(a, b):
    """Loads two directories strictly and compares every state_dict tensor bit for bit."""
    ma, mb = from_pretrained(a), from_pretrained(b)
    sa, sb = ma.state_dict(), mb.state_dict()
    for k, v in sa.items():
        if v.dtype != sb[k].dtype or not torch.equal(v.view(-1).view(torch.uint8),
                                                     sb[k].view(-1).view(torch.uint8)):
            sys.stderr.write("%s differs between %s and %s\n" % (k, a, b))
            return 1
    print("ok: %d tensors bitwise equal" % len(sa))
    return 0


def cmd_names(path):
    model = build(load_config(path))
    print(json.dumps({"names": [n for n, _ in model.named_parameters()],
                      "shapes": [list(p.shape) for p in model.parameters()]}))


def main(argv):
    torch.set_num_threads(1)
    if len(argv) == 3 and argv[1] == "step":
        cmd_step(argv[2])
    elif len(argv) in (4, 5) and argv[1] == "init":
        cmd_init(argv[2], int(argv[3]), *argv[4:])
    elif len(argv) == 4 and argv[1] == "same":
        return cmd_same(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "check":
        return cmd_check(argv[2])
    elif len(argv) == 3 and argv[1] == "names":
        cmd_names(argv[2])
    else:
        sys.stderr.write(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
