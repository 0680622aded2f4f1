#!/usr/bin/python3
"""PyTorch oracle for libddp's nn layer (tests/test_nn_torch.c), and the reference builder
of libddp model files (docs/nn.md) that tools/torch/torch_reference.py can reuse.

Run with Debian's interpreter (/usr/bin/python3, which has torch 1.13). Tensors travel as
raw little-endian files (row-major, the dtype named beside them) and safetensors files.

    nn_oracle.py ops DIR      DIR/*/case.json: run each op forward and backward
    nn_oracle.py model DIR    DIR/run.json: build a model file, load weights, one step
    nn_oracle.py bench DIR    DIR/bench.json: time forward+backward of an MLP, 1 thread

Exit status 0 on success; any failure raises (the C test then reports it).
"""

import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
import blas_kernels  # noqa: E402

blas_kernels.match_libddp()  # before torch loads OpenBLAS: libddp's GEMM kernels

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import hf_llama  # noqa: E402  (tools/torch/hf_llama.py: Transformers' Llama, functional parts)

torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass

DTYPES = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64}
NP = {"f32": "<f4", "f64": "<f8", "i64": "<i8"}


def read_raw(path, dtype, shape):
    import numpy as np
    arr = np.fromfile(path, dtype=NP[dtype]).reshape(shape)
    return torch.from_numpy(arr.copy())


def write_raw(path, t):
    t.detach().contiguous().cpu().numpy().tofile(path)


# ---------------------------------------------------------------- model files ----------

class Seq(nn.Sequential):
    """nn.Sequential whose forward passes the batch flags on to Branch layers."""

    def forward(self, x, flags=0):
        for m in self:
            x = m(x, flags) if isinstance(m, FLAGGED) else m(x)
        return x


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, flags=0):
        return x + self.body(x, flags)


class Branch(nn.Module):
    """body(x) when bit `flag` of the flags is set, else x."""

    def __init__(self, body, flag):
        super().__init__()
        self.body = body
        self.flag = flag

    def forward(self, x, flags=0):
        return self.body(x, flags) if (flags >> self.flag) & 1 else x


class Checkpoint(nn.Module):
    """Reentrant activation checkpointing of body (use_reentrant=True)."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, flags=0):
        return torch.utils.checkpoint.checkpoint(lambda t: self.body(t, flags), x,
                                                 use_reentrant=True)


class Add(nn.Module):
    """The sum of its branches on the same input, left to right; a branch with a flag runs
    (and is added) only when that bit of the flags is set (docs/nn.md, "add")."""

    def __init__(self, keys, bodies, flags):
        super().__init__()
        self.keys, self.flags = keys, flags
        for k, b in zip(keys, bodies):
            self.add_module(k, b)

    def forward(self, x, flags=0):
        y = None
        for k, f in zip(self.keys, self.flags):
            if f is not None and not (flags >> f) & 1:
                continue
            h = getattr(self, k)(x, flags)
            y = h if y is None else y + h
        if y is None:
            raise ValueError("add: no branch is active under forward flags %#x" % flags)
        return y


def child_key(spec, k):
    """A layer's or branch's key in its parent: its "name", else its position."""
    return spec["name"] if isinstance(spec, dict) and "name" in spec else str(k)


def build_add(spec, dtype):
    keys, bodies, flags = [], [], []
    for k, br in enumerate(spec["branches"]):
        keys.append(child_key(br, k))
        layers = br["layers"] if isinstance(br, dict) else br
        bodies.append(build_seq(layers, dtype))
        flags.append(br.get("flag") if isinstance(br, dict) else None)
    return Add(keys, bodies, flags)


def build_layer(spec, dtype):
    t = spec["type"]
    if t == "linear":
        m = nn.Linear(spec["in"], spec["out"], bias=spec.get("bias", True), dtype=dtype)
    elif t == "relu":
        m = nn.ReLU()
    elif t == "gelu":
        m = nn.GELU(approximate=spec.get("approximate", "none"))
    elif t == "tanh":
        m = nn.Tanh()
    elif t == "sigmoid":
        m = nn.Sigmoid()
    elif t == "dropout":
        m = nn.Dropout(spec.get("p", 0.5))
    elif t == "layernorm":
        m = nn.LayerNorm(spec["dim"], eps=spec.get("eps", 1e-5), dtype=dtype)
    elif t == "batchnorm":
        m = nn.BatchNorm1d(spec["dim"], eps=spec.get("eps", 1e-5),
                           momentum=spec.get("momentum", 0.1), dtype=dtype)
    elif t == "embedding":
        m = nn.Embedding(spec["num"], spec["dim"], dtype=dtype)
    elif t == "flatten":
        m = nn.Flatten()
    elif t == "residual":
        m = Residual(build_seq(spec["layers"], dtype))
    elif t == "branch":
        m = Branch(build_seq(spec["layers"], dtype), spec.get("flag", 0))
    elif t == "checkpoint":
        m = Checkpoint(build_seq(spec["layers"], dtype))
    elif t == "add":
        m = build_add(spec, dtype)
    else:
        raise ValueError("unknown layer type %r" % t)
    if spec.get("frozen"):
        for p in m.parameters():
            p.requires_grad_(False)
    return m


def build_seq(layers, dtype):
    from collections import OrderedDict
    return Seq(OrderedDict((child_key(s, k), build_layer(s, dtype)) for k, s in enumerate(layers)))


class Named(nn.Module):
    """Holds a child under an attribute name, so that names get a prefix ("layers.0.weight")."""

    def __init__(self, attr, child):
        super().__init__()
        self.attr = attr
        setattr(self, attr, child)

    def forward(self, x, flags=0):
        return getattr(self, self.attr)(x, flags)


# Modules whose forward takes the flags (resolved when a Seq runs).
FLAGGED = (Seq, Residual, Branch, Checkpoint, Add, Named)


def build_model(spec):
    """The PyTorch twin of ddp_model_from_json: same module tree, same state_dict names."""
    model = build_seq(spec["layers"], DTYPES[spec.get("dtype", "f32")])
    prefix = spec.get("prefix", "")
    for attr in reversed(prefix.split(".") if prefix else []):
        model = Named(attr, model)
    return model


def load_safetensors(path):
    """name -> tensor, via tools/torch/safetensors.py (pure Python, no extra package)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import safetensors as st  # tools/torch/safetensors.py
    loaded = st.load_torch(path)
    return loaded[0] if isinstance(loaded, tuple) else loaded


# ---------------------------------------------------------------- ops ------------------

def run_op(op, attrs, xs):
    if op == "linear":
        return F.linear(*xs)
    if op == "matmul":
        return xs[0] @ xs[1]
    if op == "add":
        return xs[0] + xs[1]
    if op == "mul":
        return xs[0] * xs[1]
    if op == "bias_add":
        return xs[0] + xs[1]
    if op == "relu":
        return F.relu(xs[0])
    if op == "gelu":
        return F.gelu(xs[0], approximate=attrs.get("approximate", "none"))
    if op == "tanh":
        return torch.tanh(xs[0])
    if op == "sigmoid":
        return torch.sigmoid(xs[0])
    if op == "softmax":
        return F.softmax(xs[0], dim=-1)
    if op == "log_softmax":
        return F.log_softmax(xs[0], dim=-1)
    if op == "dropout":
        # The mask comes from libddp's RNG: x * mask reproduces F.dropout given that mask.
        return xs[0] * xs[1]
    if op == "layer_norm":
        return F.layer_norm(xs[0], xs[0].shape[-1:], xs[1], xs[2], attrs.get("eps", 1e-5))
    if op == "batch_norm":
        rm, rv = attrs["_rm"], attrs["_rv"]
        y = F.batch_norm(xs[0], rm, rv, xs[1], xs[2], attrs["training"], attrs["momentum"],
                         attrs["eps"])
        return y
    if op == "embedding":
        return F.embedding(xs[0], xs[1])
    if op == "reshape":
        return xs[0].reshape(attrs["shape"])
    if op == "concat":
        return torch.cat(xs, dim=attrs["dim"])
    if op == "sum":
        return xs[0].sum()
    if op == "mean":
        return xs[0].mean()
    if op == "mse_loss":
        return F.mse_loss(xs[0], xs[1])
    if op == "cross_entropy":
        return F.cross_entropy(xs[0], xs[1], ignore_index=attrs.get("ignore_index", -100))
    if op in TRANSFORMER_OPS:
        return TRANSFORMER_OPS[op](attrs, xs)
    raise ValueError("unknown op %r" % op)


# The transformer ops of libddp (ddp_conv1d ... ddp_causal_lm_loss), written the way
# Hugging Face Transformers' GPT-2 and BERT modules compute them.

def op_conv1d(attrs, xs):
    """Transformers' Conv1D: addmm(bias, x.view(-1, in), weight) with weight [in, out]."""
    x, w = xs[0], xs[1]
    size_out = x.shape[:-1] + (w.shape[1],)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.addmm(xs[2], x2, w) if len(xs) > 2 else x2 @ w
    return y.view(size_out)


def op_bmm(attrs, xs):
    b = xs[1].transpose(-1, -2) if attrs.get("trans_b") else xs[1]
    return torch.matmul(xs[0], b)


def heads(t, n_head):
    """[B, T, C] -> [B, n_head, T, C / n_head] (GPT-2's _split_heads)."""
    bsz, seq, c = t.shape
    return t.view(bsz, seq, n_head, c // n_head).permute(0, 2, 1, 3)


def op_split_heads(attrs, xs):
    """GPT-2's c_attn output split into q, k, v heads; returned stacked along dim 0."""
    x = xs[0]
    q, k, v = x.split(x.shape[-1] // 3, dim=2)
    n = attrs["n_head"]
    return torch.cat([heads(q, n), heads(k, n), heads(v, n)], dim=0)


def op_merge_heads(attrs, xs):
    """[B, H, T, D] -> [B, T, H * D] (GPT-2's _merge_heads)."""
    x = xs[0].permute(0, 2, 1, 3).contiguous()
    return x.view(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])


def op_attention(attrs, xs):
    """Scaled dot-product attention as Transformers writes it: q k^T divided by sqrt(d),
    masked positions replaced by the dtype's most negative finite value (torch.where),
    softmax, dropout (here: multiplied by libddp's mask, given as an input), then @ v.
    Inputs: q, k, v [B, H, T, D], then the key mask [B, T] when attrs.key_mask, then the
    dropout mask [B, H, T, T] when attrs.dropout."""
    q, k, v = xs[0], xs[1], xs[2]
    rest = list(xs[3:])
    bsz, seq = q.shape[0], q.shape[2]
    allowed = torch.ones(seq, seq, dtype=torch.bool)
    if attrs.get("causal"):
        allowed = torch.tril(allowed)
    allowed = allowed.view(1, 1, seq, seq)
    if attrs.get("key_mask"):
        allowed = allowed & rest.pop(0).bool().view(bsz, 1, 1, seq)
    w = torch.matmul(q, k.transpose(-1, -2))
    w = w / torch.full([], attrs["inv_scale"], dtype=w.dtype)
    lowest = torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype)
    w = torch.where(allowed, w, lowest)
    w = F.softmax(w, dim=-1)
    if attrs.get("dropout"):
        w = w * rest.pop(0)
    return torch.matmul(w, v)


def op_causal_lm_loss(attrs, xs):
    """GPT2LMHeadModel's loss: logits [..., :-1, :] against labels [..., 1:]."""
    logits, labels = xs
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                           ignore_index=attrs.get("ignore_index", -100))


# The Llama ops of libddp (src/nn/ops_llama.c, and the compositions src/nn/llama.c makes),
# through tools/torch/hf_llama.py's functions, which its LlamaForCausalLM uses: Transformers'
# modeling_llama.py and modeling_rope_utils.py.

def rope_config(attrs, head_dim):
    """The config fields hf_llama.inv_freq reads; rope_scaling's legacy "type" as "rope_type"."""
    class Cfg:
        pass
    cfg = Cfg()
    cfg.head_dim = head_dim
    cfg.rope_theta = attrs.get("theta", 10000.0)
    cfg.max_position_embeddings = attrs.get("max_position_embeddings", 2048)
    rs = attrs.get("rope_scaling")
    if rs is not None and "type" in rs and "rope_type" not in rs:
        rs = dict(rs, rope_type=rs["type"])
    cfg.rope_scaling = rs
    return cfg


def rope(attrs, q, k):
    """LlamaRotaryEmbedding's cos and sin for positions 0..T-1, applied to q and k."""
    cos, sin = hf_llama.LlamaRotaryEmbedding(rope_config(attrs, q.shape[-1]))(q, q.shape[2])
    return hf_llama.apply_rotary_pos_emb(q, k, cos, sin)


def op_rotary(attrs, xs):
    """x [B, H, T, D] rotated as a query is (apply_rotary_pos_emb's q * cos +
    rotate_half(q) * sin)."""
    return rope(attrs, xs[0], xs[0])[0]


def op_gated_mlp(attrs, xs):
    """LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)); inputs x, the gate, up and down
    weights [out, in], then (mlp_bias) their three biases."""
    x, wg, wu, wd = xs[:4]
    bg, bu, bd = xs[4:7] if len(xs) > 4 else (None, None, None)
    return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)


def op_gqa_attention(attrs, xs):
    """LlamaAttention after the projections: q [B, H, T, D], k, v [B, KV, T, D], then the
    attention mask [B, T] (1 = attend) when attrs.key_mask; rotary on q and k when attrs.rope;
    eager_attention_forward with Transformers' additive causal (and padding) mask: Llama is
    always causal."""
    q, k, v = xs[0], xs[1], xs[2]
    if attrs.get("rope"):
        q, k = rope(attrs, q, k)
    t = q.shape[2]
    am = xs[3] if attrs.get("key_mask") else None
    mask = hf_llama.causal_mask(t, q.dtype, am)
    return hf_llama.eager_attention(q, k, v, mask, attrs["scaling"], q.shape[1] // k.shape[1])


TRANSFORMER_OPS = {
    "conv1d": op_conv1d,
    "bmm": op_bmm,
    "permute": lambda attrs, xs: xs[0].permute(attrs["perm"]),
    "narrow": lambda attrs, xs: xs[0].narrow(attrs["dim"], attrs["start"], attrs["length"]),
    "scale": lambda attrs, xs: xs[0] * attrs["s"],
    "split_heads": op_split_heads,
    "to_heads": lambda attrs, xs: heads(xs[0], attrs["n_head"]),
    "merge_heads": op_merge_heads,
    "attention": op_attention,
    "causal_lm_loss": op_causal_lm_loss,
    "rms_norm": lambda attrs, xs: hf_llama.rms_norm(xs[0], xs[1] if len(xs) > 1 else None,
                                                    attrs["eps"]),
    "rotary": op_rotary,
    "repeat_kv": lambda attrs, xs: hf_llama.repeat_kv(xs[0], attrs["n_rep"]),
    "silu": lambda attrs, xs: F.silu(xs[0]),
    "gated_mlp": op_gated_mlp,
    "gqa_attention": op_gqa_attention,
}


def cmd_ops(root):
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        cj = os.path.join(d, "case.json")
        if not os.path.isfile(cj):
            continue
        with open(cj) as f:
            case = json.load(f)
        xs = []
        for i, spec in enumerate(case["inputs"]):
            t = read_raw(os.path.join(d, "in%d.bin" % i), spec["dtype"], spec["shape"])
            if spec.get("requires_grad"):
                t.requires_grad_(True)
            xs.append(t)
        attrs = case.get("attrs", {})
        if case["op"] == "batch_norm":
            c = xs[0].shape[1]
            dt = xs[0].dtype
            attrs["_rm"] = read_raw(os.path.join(d, "rm.bin"), case["dtype"], [c]).to(dt)
            attrs["_rv"] = read_raw(os.path.join(d, "rv.bin"), case["dtype"], [c]).to(dt)
        y = run_op(case["op"], attrs, xs)
        write_raw(os.path.join(d, "out.bin"), y)
        gout = read_raw(os.path.join(d, "gout.bin"), case["dtype"], list(y.shape))
        y.backward(gout)
        for i, t in enumerate(xs):
            if t.requires_grad:
                write_raw(os.path.join(d, "grad%d.bin" % i), t.grad)
        if case["op"] == "batch_norm":
            write_raw(os.path.join(d, "rm_out.bin"), attrs["_rm"])
            write_raw(os.path.join(d, "rv_out.bin"), attrs["_rv"])


# ---------------------------------------------------------------- model step -----------

def cmd_model(root):
    """One forward + backward of a model file on given weights and batch. Writes the output,
    the loss, the gradients in parameters() order (concatenated: the layout of libddp's flat
    gradient buffer), the buffers after the step, and the order in which the parameters'
    AccumulateGrad hooks fired (the DDP reducer's hook point)."""
    with open(os.path.join(root, "run.json")) as f:
        run = json.load(f)
    with open(os.path.join(root, "model.json")) as f:
        spec = json.load(f)
    dt = spec.get("dtype", "f32")
    model = build_model(spec)
    sd = load_safetensors(os.path.join(root, "weights.safetensors"))
    model.load_state_dict(sd, strict=True)
    model.train(run.get("train", True))
    names = [n for n, _ in model.named_parameters()]
    order = []
    keep = []
    for i, p in enumerate(model.parameters()):
        if not p.requires_grad:
            continue
        acc = p.expand_as(p).grad_fn.next_functions[0][0]  # AccumulateGrad (DDP's trick)
        acc.register_hook(lambda *a, i=i: order.append(i))
        keep.append(acc)
    x = read_raw(os.path.join(root, "x.bin"), run["x_dtype"], run["x_shape"])
    y = model(x, run.get("flags", 0))
    write_raw(os.path.join(root, "y.bin"), y)
    if run["loss"] == "ce":
        t = read_raw(os.path.join(root, "t.bin"), "i64", [run["x_shape"][0]])
        loss = F.cross_entropy(y, t)
    else:
        t = read_raw(os.path.join(root, "t.bin"), dt, list(y.shape))
        loss = F.mse_loss(y, t)
    loss.backward()
    write_raw(os.path.join(root, "loss.bin"), loss)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    write_raw(os.path.join(root, "grads.bin"), torch.cat([g.reshape(-1) for g in grads]))
    bufs = [b.reshape(-1).to(torch.float64) for _, b in model.named_buffers()]
    if bufs:
        write_raw(os.path.join(root, "buffers.bin"), torch.cat(bufs))
    with open(os.path.join(root, "order.json"), "w") as f:
        json.dump({"order": order, "names": names}, f)
    # PyTorch's own state_dict after the step (buffers updated), for libddp to load by name.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import safetensors as st  # tools/torch/safetensors.py
    st.save_torch(os.path.join(root, "state_after.safetensors"), list(model.state_dict().items()))


# ---------------------------------------------------------------- bench ----------------

def cmd_bench(root):
    with open(os.path.join(root, "bench.json")) as f:
        b = json.load(f)
    dims, batch, iters = b["dims"], b["batch"], b["iters"]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i + 2 < len(dims):
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    x = torch.rand(batch, dims[0])
    t = torch.randint(0, dims[-1], (batch,))

    def step():
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), t).backward()

    for _ in range(3):
        step()
    best = float("inf")
    t0 = time.perf_counter()
    for _ in range(iters):
        s = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - s)
    mean = (time.perf_counter() - t0) / iters
    with open(os.path.join(root, "bench_out.json"), "w") as f:
        json.dump({"torch_best_ms": best * 1e3, "torch_mean_ms": mean * 1e3,
                   "torch": torch.__version__, "threads": torch.get_num_threads()}, f)


def main(argv):
    if len(argv) != 3 or argv[1] not in ("ops", "model", "bench"):
        sys.stderr.write(__doc__)
        return 2
    {"ops": cmd_ops, "model": cmd_model, "bench": cmd_bench}[argv[1]](argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
