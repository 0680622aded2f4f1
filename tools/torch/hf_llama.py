"""PyTorch twin of Hugging Face Transformers' LlamaForCausalLM (modeling_llama.py and
modeling_rope_utils.py, 4.48), for checking libddp's Llama family (src/nn/llama.c). Used
through tools/torch/hf_models.py (load_config, build, init_weights, save_pretrained, ...), which
imports this module; the module names, parameters() order and state_dict keys are
Transformers'.

Where Transformers' arithmetic is pinned to float32 for half-precision training, this twin
keeps each stated rounding in float32 but takes the float64 model's own precision where
Transformers would *down*cast a float64 model (RMSNorm's and softmax's "compute in float32"):
that is what a float64 reference is for, and it is what libddp does (docs/nn.md). The rotary
tables stay float32 in both dtypes, as in Transformers. inv_freq and cos/sin are computed in
float64 and rounded to float32 once (Transformers rounds each float32 step: within an ulp).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
}


def fill_config(vals):
    """LlamaConfig.__init__'s derived values: num_key_value_heads and head_dim when null, and
    rope_scaling's legacy "type" copied to "rope_type"."""
    if vals["num_key_value_heads"] is None:
        vals["num_key_value_heads"] = vals["num_attention_heads"]
    if vals["head_dim"] is None:
        vals["head_dim"] = vals["hidden_size"] // vals["num_attention_heads"]
    rs = vals["rope_scaling"]
    if rs is not None:
        rs = dict(rs)
        if "type" in rs and "rope_type" not in rs:
            rs["rope_type"] = rs.pop("type")
        if rs["rope_type"] not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError("unsupported rope_type %r" % rs["rope_type"])
        vals["rope_scaling"] = rs
    if vals["num_attention_heads"] % vals["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
    return vals


def inv_freq(cfg, seq_len):
    """Transformers' ROPE_INIT_FUNCTIONS[rope_type](config, seq_len), in float64, returned as
    float32."""
    d = cfg.head_dim
    base = cfg.rope_theta
    rs = cfg.rope_scaling or {"rope_type": "default"}
    t = rs["rope_type"]
    if t == "dynamic" and seq_len > cfg.max_position_embeddings:
        f = rs["factor"]
        base = base * ((f * seq_len / cfg.max_position_embeddings) - (f - 1)) ** (d / (d - 2))
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).double() / d))
    if t == "linear":
        inv = inv / rs["factor"]
    if t == "llama3":
        factor, old = rs["factor"], rs["original_max_position_embeddings"]
        lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
        low_wl, high_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < high_wl) * ~(wl > low_wl)
        inv = torch.where(medium, smoothed, out)
    return inv.float()


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, h):
        return rms_norm(h, self.weight, self.variance_epsilon)


def rms_norm(h, weight, eps):
    """LlamaRMSNorm.forward with its weight given (None: the normalisation alone)."""
    dtype = h.dtype
    h = h.to(torch.promote_types(dtype, torch.float32))
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return h.to(dtype) if weight is None else weight * h.to(dtype)


class LlamaRotaryEmbedding(nn.Module):
    """cos and sin [T, d] for positions 0..T-1 (the frequencies concatenated twice)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, x, seq_len):
        inv = inv_freq(self.cfg, seq_len)
        pos = torch.arange(seq_len, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]  # float32, one rounding
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.double().cos().float().to(x.dtype), emb.double().sin().float().to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(h, n_rep):
    b, kv, t, d = h.shape
    if n_rep == 1:
        return h
    return h[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        d, h = cfg.head_dim, cfg.hidden_size
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)

    def forward(self, h, cos, sin):
        b, t, _ = h.shape
        d = self.cfg.head_dim
        q = self.q_proj(h).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(h).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(h).view(b, t, -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        a = eager_attention(q, k, v, causal_mask(t, q.dtype), self.scaling, self.n_rep,
                            self.cfg.attention_dropout, self.training)
        a = a.transpose(1, 2).reshape(b, t, -1).contiguous()
        return self.o_proj(a)


def causal_mask(t, dtype, attention_mask=None):
    """The additive mask Transformers' LlamaModel builds
    (_prepare_4d_causal_attention_mask_with_cache_position, no cache): 0 where query i may see
    key j (j <= i and attention_mask[b, j] != 0), the dtype's most negative finite value
    elsewhere; [1, 1, t, t], or [B, 1, t, t] with attention_mask [B, t] (1 = attend)."""
    lowest = torch.finfo(dtype).min
    allowed = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
    if attention_mask is not None:
        allowed = allowed & (attention_mask != 0).view(-1, 1, 1, t)
    return torch.where(allowed, torch.zeros([], dtype=dtype), torch.full([], lowest, dtype=dtype))


def eager_attention(q, k, v, mask, scaling, n_rep, dropout=0.0, training=False):
    """Transformers' eager_attention_forward: KV heads repeated, q k^T * scaling plus the
    additive mask, softmax in at least float32, dropout, @ v. q [B, H, T, D], k and v
    [B, H / n_rep, T, D]; returns [B, H, T, D]."""
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    w = torch.matmul(q, k.transpose(2, 3)) * scaling
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.promote_types(w.dtype, torch.float32)).to(q.dtype)
    w = F.dropout(w, p=dropout, training=training)
    return torch.matmul(w, v)


class LlamaMLP(nn.Module):
    def __init__(self, cfg, act):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx, act):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg, act)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin):
        r = h
        h = r + self.self_attn(self.input_layernorm(h), cos, sin)
        r = h
        return r + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg, act):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i, act)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        cos, sin = self.rotary_emb(h, ids.size(1))
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, cfg, act):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, act)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids):
        return self.lm_head(self.model(ids))


@torch.no_grad()
def init_weights(model):
    """LlamaPreTrainedModel._init_weights: Linear weights and the embedding
    N(0, initializer_range), biases 0, the padding row 0; RMSNorm weights stay 1."""
    std = model.config.initializer_range
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.weight.normal_(0.0, std)
            if mod.bias is not None:
                mod.bias.zero_()
        elif isinstance(mod, nn.Embedding):
            mod.weight.normal_(0.0, std)
            if mod.padding_idx is not None:
                mod.weight[mod.padding_idx].zero_()
