#!/usr/bin/python3
"""PyTorch reference run for libddp: real torch.nn.parallel.DistributedDataParallel on a
libddp model file, writing per-step, per-rank dumps in the layout of docs/dumps.md, which
tools/ddp-compare compares with a libddp run (docs/compare.md).

Run with Debian's interpreter (/usr/bin/python3, torch 1.13) on CPUs with gloo, or with any
PyTorch on GPUs with --backend nccl (TF32 is switched off there: docs/compare.md says why).

    torch_reference.py --model MODEL.json --dump_dir DIR [options]
    torch_reference.py --model gpt2-config.json --data corpus.txt --block_size 64 ...
    torch_reference.py --model bert-config.json --data texts.csv --max_seq_length 32 ...

A model file with a top-level "model_type" is a Transformers config.json: the model is then
tools/torch/hf_models.py's GPT2LMHeadModel, LlamaForCausalLM (tools/torch/hf_llama.py) or
BertForSequenceClassification (Transformers' names and semantics), trained on text data
prepared exactly as ddp-train prepares it: for GPT-2 and Llama a
token stream (a UTF-8 text through the byte tokenizer, llm.c's .bin, or a safetensors
"tokens" tensor) cut into --block_size blocks (labels = the block; the model shifts), for
BERT a text,label CSV byte-tokenized, truncated and padded to --max_seq_length with an
attention mask. Rank 0 then also writes DIR/pretrained/ (config.json and model.safetensors
as save_pretrained writes them, the tied lm_head left out) holding the broadcast weights.

The script spawns --world processes on 127.0.0.1 (gloo with GLOO_SOCKET_IFNAME=lo; the parent
serves the rendezvous store on a port the kernel picks), or,
when started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set), runs as
that one rank. Every rank builds the model, wraps it in DDP with the given options, and
trains --steps optimizer steps on batches drawn through torch's DistributedSampler; after
each step it writes DIR/rank{r}/step{NNNNNN}.safetensors. Exit status 0 on success, 2 on a
usage error, 1 when a rank fails.

With --zero the optimizer is PyTorch's ZeroRedundancyOptimizer over the same groups
(ZeRO-1: DDP's allreduce unchanged, each rank steps the parameters it owns, the owners
broadcast them), and each rank's ddp.json gets "zero_partition": {parameter name: owning
rank} as its _partition_parameters computed it; libddp's ZeRO-1 (ddp-train --deepspeed with
zero_optimization.stage 1) must agree (tests/test_zero_parity.c). --zero_parameters_as_bucket_view
passes parameters_as_bucket_view=True. --zero_comm_hook hook_with_zero_step (or _interleaved)
builds it with overlap_with_ddp=True and registers PyTorch's ddp_zero_hook around the
--comm_hook hook (one parameter group only, as PyTorch requires); PyTorch 1.13 refuses any
backend but NCCL/HCCL there (gloo may hang, pytorch#62300), so on gloo the backend check is
bypassed for that one call, and only hook_with_zero_step is run (the interleaved form issues
its broadcasts from gloo's completion thread, in an order that may differ between ranks).
zero_partition is then the bucket partition, recorded after the delayed initialisation.

With --optim_state CHECKPOINT (and --init CHECKPOINT/model.safetensors, --start_step K) the
optimizer starts from a ddp-train checkpoint's optimizer state (tools/torch/libddp_optim.py)
and the run from its step K: PyTorch continues ddp-train's run (tests/zero_optim_torch.sh).

With --comm_hook power_sgd or batched_power_sgd, rank 0 also writes
DIR/powersgd_q.safetensors, the random Q values PyTorch's hook drew (save_q_draws), which
the libddp side injects to start from the same Q (docs/hooks.md, "PyTorch parity").

Arithmetic is kept to one thread per rank (OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are set
before torch is imported; numerics.md "Running the oracle fairly"), and every worker ends
with a barrier and os._exit(0) (numerics.md "Known oracle failures").
"""

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.dont_write_bytecode = True  # the source tree may be read-only; leave nothing in it

import blas_kernels  # noqa: E402

blas_kernels.match_libddp()  # before torch loads OpenBLAS: libddp's GEMM kernels

FORMAT = "libddp-dump-1"
DEFAULT_DATA = os.path.join(TOOLS, "..", "..", "tests", "data", "digits.safetensors")


def parse_bool(text):
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError("expected true or false, got %r" % text)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="torch_reference.py",
        description="PyTorch DDP reference run writing libddp dumps (docs/dumps.md).")
    p.add_argument("--model", required=True, help="libddp model file (docs/nn.md)")
    p.add_argument("--dump_dir", required=True, help="output directory (created)")
    p.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--steps", "--max_steps", dest="steps", type=int, default=3,
                   help="optimizer steps (default 3)")
    p.add_argument("--batch", "--per_device_train_batch_size", dest="batch", type=int,
                   default=8, help="per-rank micro-batch size (default 8)")
    p.add_argument("--lr", "--learning_rate", dest="lr", type=float, default=0.1)
    p.add_argument("--optim", choices=("sgd", "adamw", "adamw_torch", "adam"), default="sgd")
    p.add_argument("--lr_scheduler_type",
                   choices=("constant", "constant_with_warmup", "linear", "cosine",
                            "cosine_with_restarts", "polynomial", "inverse_sqrt",
                            "cosine_with_min_lr"),
                   default="constant", help="Hugging Face's schedules (default constant)")
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--lr_scheduler_kwargs", default="",
                   help="Hugging Face's: a JSON object of the schedule's own arguments")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--optim_args", default="",
                   help="Hugging Face's key=value,...: sgd takes momentum, dampening, nesterov "
                        "(momentum here wins over --momentum)")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--weight_decay_grouping", choices=("all", "transformers"), default="all",
                   help="all: every parameter, as torch.optim on model.parameters() (default); "
                        "transformers: Hugging Face's groups, no decay on biases and LayerNorm "
                        "weights (ddp-train's default)")
    p.add_argument("--zero_grad_set_to_none", type=parse_bool, default=False,
                   help="optimizer.zero_grad(set_to_none=...) after each step (default false, "
                        "1.13's; ddp-train's default is true)")
    p.add_argument("--dump_local_grads", type=parse_bool, nargs="?", const=True, default=False,
                   help="also write local_grad.<name>: each rank's gradient before DDP "
                        "communicates it")
    p.add_argument("--adam_beta1", type=float, default=0.9)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_epsilon", type=float, default=1e-8)
    p.add_argument("--max_grad_norm", type=float, default=0.0,
                   help="clip_grad_norm_ before the step when > 0 (default off)")
    p.add_argument("--seed", type=int, default=0,
                   help="torch.manual_seed for the initial weights and synthetic data")
    p.add_argument("--init", default=None,
                   help="safetensors state_dict to start from (loaded by name, strict)")
    p.add_argument("--optim_state", default=None,
                   help="a ddp-train checkpoint directory whose optimizer state (consolidated "
                        "under ZeRO) the optimizer loads (libddp_optim.load_into) before "
                        "training; with --start_step and --init CKPT/model.safetensors it "
                        "continues that run")
    p.add_argument("--start_step", type=int, default=0,
                   help="the first optimizer step to run (data and schedule as the run's "
                        "step of that index; dumps from it on); default 0")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help="safetensors dataset, or 'synthetic' (default: tests/data/digits)")
    p.add_argument("--block_size", type=int, default=None,
                   help="GPT-2: tokens per block (default min(1024, n_positions), run_clm)")
    p.add_argument("--max_seq_length", type=int, default=128,
                   help="BERT: CSV texts truncated and padded to this many tokens (run_glue)")
    p.add_argument("--features", default="features", help="features tensor name")
    p.add_argument("--labels", default="labels", help="labels tensor name")
    p.add_argument("--synthetic_samples", type=int, default=256)
    p.add_argument("--synthetic_classes", type=int, default=0,
                   help="classes of the synthetic labels; 0 = regression targets")
    p.add_argument("--loss", choices=("auto", "ce", "mse", "causal_lm"), default="auto",
                   help="auto: causal_lm for GPT-2, else cross-entropy for integer labels, "
                        "MSE otherwise")
    p.add_argument("--shuffle", "--dataloader_shuffle", dest="shuffle", type=parse_bool,
                   default=True, help="DistributedSampler shuffle")
    p.add_argument("--data_seed", type=int, default=None,
                   help="DistributedSampler seed (default: --seed, as Hugging Face)")
    p.add_argument("--sampler_drop_last", type=parse_bool, default=False)
    p.add_argument("--dataloader_drop_last", type=parse_bool, default=False)
    p.add_argument("--flags", "--forward_flags", dest="flags", default="0",
                   help="forward flags for branch layers: one entry per rank separated by "
                        "commas (cycled over the ranks); an entry is one integer or one per "
                        "optimizer step separated by colons (cycled over the steps), e.g. 0:1,1")
    p.add_argument("--bucket_cap_mb", "--ddp_bucket_cap_mb", dest="bucket_cap_mb", type=float,
                   default=25.0)
    p.add_argument("--first_bucket_mb", type=float, default=None,
                   help="dist._DEFAULT_FIRST_BUCKET_BYTES in MiB (1.13 default: 1)")
    p.add_argument("--find_unused_parameters", "--ddp_find_unused_parameters",
                   dest="find_unused_parameters", type=parse_bool, nargs="?", const=True,
                   default=False)
    p.add_argument("--broadcast_buffers", "--ddp_broadcast_buffers", dest="broadcast_buffers",
                   type=parse_bool, nargs="?", const=True, default=True)
    p.add_argument("--static_graph", "--ddp_static_graph", dest="static_graph",
                   type=parse_bool, nargs="?", const=True, default=False)
    p.add_argument("--gradient_as_bucket_view", type=parse_bool, nargs="?", const=True,
                   default=False)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--comm_hook", choices=("no", "allreduce", "fp16", "bf16", "power_sgd",
                                           "batched_power_sgd"), default="no",
                   help="Accelerate's DDP communication hook (default: none); 'allreduce' "
                        "(PyTorch's allreduce_hook, not in Accelerate) lets a wrapper go "
                        "around plain allreduce")
    p.add_argument("--comm_wrapper", choices=("no", "fp16", "bf16"), default="no",
                   help="Accelerate's wrapper around the hook")
    p.add_argument("--comm_state_option", default="{}",
                   help="JSON object of PowerSGDState keyword arguments")
    p.add_argument("--backend", "--ddp_backend", dest="backend", choices=("gloo", "nccl"),
                   default="gloo")
    p.add_argument("--timeout", "--ddp_timeout", dest="timeout", type=float, default=300.0,
                   help="process-group timeout, s")
    p.add_argument("--zero", type=parse_bool, nargs="?", const=True, default=False,
                   help="wrap the optimizer in torch.distributed.optim.ZeroRedundancyOptimizer "
                        "(ZeRO-1); ddp.json then has zero_partition, each parameter's owner")
    p.add_argument("--zero_parameters_as_bucket_view", type=parse_bool, default=False,
                   help="ZeroRedundancyOptimizer(parameters_as_bucket_view=...)")
    p.add_argument("--zero_comm_hook", choices=("no", "hook_with_zero_step"), default="no",
                   help="ZeroRedundancyOptimizer(overlap_with_ddp=True) with this ddp_zero_hook "
                        "around --comm_hook (gloo: the NCCL-only check bypassed)")
    p.add_argument("--zero_shard_buckets", type=parse_bool, default=False,
                   help="the ddp_zero_hook's shard_buckets")
    a = p.parse_args(argv)
    if a.world < 1 or a.steps < 0 or a.batch < 1 or a.gradient_accumulation_steps < 1:
        p.error("--world, --batch and --gradient_accumulation_steps must be >= 1, "
                "--steps >= 0")
    if a.start_step < 0 or a.start_step > a.steps:
        p.error("--start_step must be within 0..--steps")
    if a.optim_state is not None and a.zero:
        p.error("--optim_state loads into a plain torch.optim optimizer, not with --zero")
    if a.data_seed is None:
        a.data_seed = a.seed
    if a.optim == "adamw_torch":
        a.optim = "adamw"
    try:
        a.comm_state = json.loads(a.comm_state_option)
        if not isinstance(a.comm_state, dict):
            raise ValueError("not an object")
    except ValueError as e:
        p.error("--comm_state_option must be a JSON object: %s" % e)
    try:
        a.flags_list = [[int(f, 0) for f in e.split(":")] for e in a.flags.split(",")]
        if any(f < 0 for e in a.flags_list for f in e):
            raise ValueError("negative")
    except ValueError:
        p.error("--flags must be integers >= 0, per rank separated by commas and per step by "
                "colons, got %r" % a.flags)
    a.dampening, a.nesterov = 0.0, False
    for item in a.optim_args.replace(" ", "").split(",") if a.optim_args.strip() else []:
        key, _, val = item.partition("=")
        if a.optim != "sgd" or key not in ("momentum", "dampening", "nesterov") or not val:
            p.error("--optim_args: %r is not one of sgd's momentum=, dampening=, nesterov="
                    % item)
        if key == "nesterov":
            a.nesterov = parse_bool(val)
        else:
            setattr(a, key, float(val))
    return a


def flags_at(a, rank, step):
    """The forward flags of optimizer step `step` on `rank` (the --flags schedule)."""
    entry = a.flags_list[rank % len(a.flags_list)]
    return entry[step % len(entry)]


def decay_groups(model, wd, grouping):
    """The optimizer's parameter groups: one group of every parameter ("all", as
    torch.optim on model.parameters()), or Hugging Face's Trainer.create_optimizer groups
    ("transformers"): parameters outside LayerNorm modules whose name has no "bias" get wd,
    the others 0; a group that would be empty, or wd 0, gives one group."""
    import torch.nn as nn
    params = [p for p in model.parameters()]
    if grouping == "all" or wd == 0:
        return [{"params": params, "weight_decay": wd}]
    in_ln = set()
    for _, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            in_ln.update(id(p) for p in m.parameters(recurse=False))
    decay = [p for n, p in model.named_parameters() if "bias" not in n and id(p) not in in_ln]
    rest = [p for n, p in model.named_parameters() if not ("bias" not in n and id(p) not in in_ln)]
    if not decay or not rest:
        return [{"params": params, "weight_decay": wd if decay else 0.0}]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def config_dict(a):
    """Every option, as written to meta.json."""
    d = {k: v for k, v in vars(a).items() if k not in ("flags_list", "dump_dir", "comm_state")}
    if d["init"] is not None:
        d["init"] = os.path.abspath(d["init"])
    if d["optim_state"] is not None:
        d["optim_state"] = os.path.abspath(d["optim_state"])
    if d["data"] != "synthetic":
        d["data"] = os.path.abspath(d["data"])
    d["model"] = os.path.abspath(d["model"])
    return d


# ----------------------------------------------------------------------- worker -------

def lr_factor(a, k):
    """Hugging Face's schedules (transformers.get_scheduler) at step k, over --steps."""
    import hf_schedules
    kwargs = json.loads(a.lr_scheduler_kwargs) if a.lr_scheduler_kwargs.strip() else {}
    return hf_schedules.lr_lambda(a.lr_scheduler_type, k, a.warmup_steps, a.steps, a.lr,
                                  **kwargs)


def reducer_params(module):
    """DDP 1.13's reducer parameter list (_build_params_for_reducer): per module in
    named_modules() order, its own parameters requiring grad, deduplicated. Returns
    (names, params, expect_sparse)."""
    import torch.nn as nn
    names, params, sparse, seen = [], [], [], set()
    for mname, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            names.append("%s.%s" % (mname, pname) if mname else pname)
            params.append(p)
            sparse.append(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and bool(m.sparse))
    return names, params, sparse


def csv_ints(text):
    return [int(t) for t in str(text).replace(",", " ").split()] if text else []


def parse_layout(text):
    """'5 4 3 2, 1 0' (rebuilt_per_bucket_param_indices) -> [[5, 4, 3, 2], [1, 0]]."""
    if not text:
        return None
    return [[int(t) for t in b.split()] for b in str(text).split(",")]


def load_dataset(a, st):
    """(features, labels) of a safetensors dataset, as CPU tensors."""
    tensors, _ = st.load_torch(a.data)
    for name in (a.features, a.labels):
        if name not in tensors:
            raise SystemExit("torch_reference: %s has no tensor %r (it has: %s)"
                             % (a.data, name, ", ".join(tensors)))
    return tensors[a.features], tensors[a.labels]


def synthetic_dataset(a, torch, model):
    """N samples with N(0, 1) features of the model's input width; labels are classes
    (uniform) or N(0, 1) targets of the output width, from a generator seeded with
    --seed + 1: identical on every rank. Rank 0 saves them as DIR/dataset.safetensors
    (features, labels) so that the libddp side can load the same samples."""
    first = next(p for p in model.parameters() if p.dim() == 2)
    out = [p for p in model.parameters() if p.dim() == 2][-1]
    g = torch.Generator().manual_seed(a.seed + 1)
    x = torch.randn(a.synthetic_samples, first.shape[1], generator=g)
    if a.synthetic_classes > 0:
        y = torch.randint(0, a.synthetic_classes, (a.synthetic_samples,), generator=g)
    else:
        y = torch.randn(a.synthetic_samples, out.shape[0], generator=g)
    return x, y


def recording_randn(hook, torch, drawn):
    """hook, with the random values it draws through torch.randn recorded: each call that
    draws appends (bucket index, its draws concatenated, flat) to drawn. The PowerSGD hooks
    draw their initial Q with torch.randn synchronously in the hook body (not in its
    futures), one call per Q matrix in the order of the bucket's Q memory, and call it for
    nothing else. functools.wraps keeps the hook's name for DDP's logging data."""
    import functools

    @functools.wraps(hook)
    def wrapped(state, bucket):
        orig, mine = torch.randn, []

        def rec(*args, **kwargs):
            t = orig(*args, **kwargs)
            mine.append(t.detach().reshape(-1).clone())
            return t
        torch.randn = rec
        try:
            return hook(state, bucket)
        finally:
            torch.randn = orig
            if mine:
                drawn.append((bucket.index(), torch.cat(mine)))
    return wrapped


def save_q_draws(path, drawn, st):
    """DIR/powersgd_q.safetensors: draw k (the k-th hook call that drew a random Q) as the
    tensor "draw{k}", the concatenation of that call's Q matrices in memory order (each
    row-major m x r, before orthogonalisation), with metadata "bucket{k}" (the bucket
    index) and "draws" (their count). libddp injects them through
    ddp_powersgd_options_t.init_q (docs/hooks.md)."""
    meta = {"producer": "torch_reference.py", "draws": str(len(drawn))}
    for k, (b, _) in enumerate(drawn):
        meta["bucket%d" % k] = str(b)
    st.save_torch(path, [("draw%d" % k, t) for k, (_, t) in enumerate(drawn)], meta)


def register_hook(a, ddp, params, drawn=None):
    """Accelerate's mapping (spec/ddp-semantics.md 7.9): the hook, PowerSGDState built from
    comm_state_option for the PowerSGD variants, then the optional fp16/bf16 wrapper. For
    PowerSGD the random Q draws are recorded into drawn (recording_randn)."""
    if a.comm_hook == "no":
        return
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    state = None
    if a.comm_hook == "allreduce":
        hook = dh.allreduce_hook
    elif a.comm_hook == "fp16":
        hook = dh.fp16_compress_hook
    elif a.comm_hook == "bf16":
        hook = dh.bf16_compress_hook
    else:
        # numerics.md, "Known oracle failures": 1.13's PowerSGD on gloo deadlocks or aborts
        # with two or more buckets. Refuse such a layout instead of hanging.
        total = sum(p.numel() * p.element_size() for p in params)
        limit = min(dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap)
        if a.backend == "gloo" and total > limit:
            raise SystemExit(
                "torch_reference: --comm_hook %s on gloo needs one bucket (PyTorch 1.13 "
                "deadlocks with more, numerics.md); the model has %d bytes of parameters: "
                "pass --first_bucket_mb and --bucket_cap_mb of at least %.6f"
                % (a.comm_hook, total, total / 1048576.0))
        state = ps.PowerSGDState(process_group=None, **a.comm_state)
        hook = ps.powerSGD_hook if a.comm_hook == "power_sgd" else ps.batched_powerSGD_hook
        if drawn is not None:
            hook = recording_randn(hook, torch, drawn)
    if a.comm_wrapper == "fp16":
        hook = dh.fp16_compress_wrapper(hook)
    elif a.comm_wrapper == "bf16":
        hook = dh.bf16_compress_wrapper(hook)
    if getattr(a, "zero_optimizer", None) is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as dz
        real = dist.get_backend
        dist.get_backend = lambda group=None: "nccl"  # 1.13 refuses gloo (pytorch#62300)
        try:
            hook = dz.hook_with_zero_step(hook, ddp, a.zero_optimizer,
                                          shard_buckets=a.zero_shard_buckets)
        finally:
            dist.get_backend = real
    ddp.register_comm_hook(state, hook)


def hf_forward(ddp, model, x):
    """A Transformers oracle module through DDP, on a batch in ddp_model_forward's layout
    (GPT-2 and Llama: ids [B, T]; BERT: [B, T], [B, 2, T] with the attention mask,
    [B, 3, T])."""
    import hf_models
    ids, mask, types = hf_models.split_ddp_layout(model, x)
    if model.config.model_type in ("gpt2", "llama"):
        return ddp(ids)
    return ddp(ids, mask, types)


def worker(rank, world, port, a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from datetime import timedelta
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler
    import nn_oracle
    import safetensors as st
    import text_data

    # nn_oracle's import has already set one intra-op and one inter-op thread (setting the
    # inter-op count twice is a fatal error in 1.13).
    torch.set_num_threads(1)
    if a.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    if port is not None:
        # The parent holds the store's server on a port the kernel chose: no race for a
        # "free" port between processes.
        store = dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=a.timeout))
        dist.init_process_group(a.backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=a.timeout))
    else:
        dist.init_process_group(a.backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=a.timeout))
    if a.first_bucket_mb is not None:
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(a.first_bucket_mb * 1024 * 1024)

    with open(a.model) as f:
        spec = json.load(f)
    torch.manual_seed(a.seed)
    hf = text_data.is_hf_config(spec)
    if hf:
        import hf_models
        model = hf_models.build(hf_models.load_config(spec))
        hf_models.init_weights(model)
    else:
        model = nn_oracle.build_model(spec)
    if a.init:
        sd, _ = st.load_torch(a.init)
        if hf:
            hf_models.load_state(model, sd)  # tied lm_head, ignored buffers: as Transformers
        else:
            model.load_state_dict(sd, strict=True)
    model.to(device)
    model.train()

    if hf:
        feats, labels = text_data.dataset(a, spec, torch, st)
    elif a.data == "synthetic":
        feats, labels = synthetic_dataset(a, torch, model)
    else:
        feats, labels = load_dataset(a, st)
    n = feats.shape[0]
    loss_kind = a.loss
    if loss_kind == "auto" and hf:
        loss_kind = text_data.loss_kind(spec)
    elif loss_kind == "auto":
        loss_kind = "mse" if labels.dtype.is_floating_point else "ce"

    names, params, sparse = reducer_params(model)
    ddp = DDP(model, device_ids=[device.index] if a.backend == "nccl" else None,
              bucket_cap_mb=a.bucket_cap_mb,
              find_unused_parameters=a.find_unused_parameters,
              broadcast_buffers=a.broadcast_buffers,
              gradient_as_bucket_view=a.gradient_as_bucket_view,
              static_graph=a.static_graph)

    q_draws = []
    if a.zero_comm_hook == "no":
        register_hook(a, ddp, params, q_draws)

    # The initial layout, recomputed exactly as 1.13's _ddp_init_helper does it, then checked
    # against the bucket sizes the reducer itself reports.
    if a.static_graph or not a.find_unused_parameters:
        limits = [sys.maxsize]
    else:
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap]
    idx, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse)
    initial = [list(b) for b in reversed(idx)]
    nbytes = [p.numel() * p.element_size() for p in params]
    init_sizes = [sum(nbytes[i] for i in b) for b in initial]
    logged_sizes = csv_ints(ddp._get_ddp_logging_data().get("bucket_sizes"))
    initial_verified = init_sizes == logged_sizes

    groups = decay_groups(model, a.weight_decay, a.weight_decay_grouping)
    if a.optim == "sgd":
        cls = torch.optim.SGD
        kw = dict(lr=a.lr, momentum=a.momentum, dampening=a.dampening, nesterov=a.nesterov,
                  weight_decay=a.weight_decay)
    else:
        cls = torch.optim.AdamW if a.optim == "adamw" else torch.optim.Adam
        kw = dict(lr=a.lr, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                  weight_decay=a.weight_decay)
    zero_partition = None
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        overlap = a.zero_comm_hook != "no"
        if overlap and (len(groups) != 1 or a.comm_hook == "no"):
            raise SystemExit("torch_reference: --zero_comm_hook needs one parameter group "
                             "(--weight_decay_grouping all) and a --comm_hook to wrap")
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=cls, overlap_with_ddp=overlap,
                                      parameters_as_bucket_view=a.zero_parameters_as_bucket_view,
                                      **kw)
        pname = {id(p): nm for nm, p in model.named_parameters()}
        if overlap:
            a.zero_optimizer = opt
            register_hook(a, ddp, params, q_draws)
        else:
            zero_partition = {pname[id(p)]: r
                              for r, rgroups in enumerate(opt._partition_parameters())
                              for g in rgroups for p in g["params"]}
    else:
        opt = cls(groups, **kw)
    if a.optim_state:
        import libddp_optim
        libddp_optim.load_into(opt, model, a.optim_state)  # initial_lr: the run's lr
    # resumed at start_step: LambdaLR's step j is the run's step start_step + j
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(a, k + a.start_step))

    rdir = os.path.join(a.dump_dir, "rank%d" % rank)
    os.makedirs(rdir, exist_ok=True)
    pnames = [nm for nm, _ in model.named_parameters()]
    # Buffers that are part of the state (a non-persistent one, like GPT-2's causal mask in
    # Transformers, is neither saved nor compared).
    persistent = set(model.state_dict().keys())
    bnames = [nm for nm, _ in model.named_buffers() if nm in persistent]

    def state_entries(with_grads):
        out = []
        if with_grads:
            for nm, p in model.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                out.append(("grad." + nm, g.detach().cpu().clone()))
        for nm, p in model.named_parameters():
            out.append(("param." + nm, p.detach().cpu().clone()))
        for nm, b in model.named_buffers():
            if nm in persistent:
                out.append(("buffer." + nm, b.detach().cpu().clone()))
        return out

    st.save_torch(os.path.join(rdir, "init.safetensors"), state_entries(False),
                  {"rank": str(rank), "producer": "torch_reference.py"})
    if rank == 0 and a.data == "synthetic":
        st.save_torch(os.path.join(a.dump_dir, "dataset.safetensors"),
                      [("features", feats), ("labels", labels)])
    if rank == 0:
        # The broadcast weights under plain state_dict names: ddp_model_load reads this.
        st.save_torch(os.path.join(a.dump_dir, "weights.safetensors"),
                      [(k, v.detach().cpu()) for k, v in
                       (hf_models.state_for_save(model) if hf else model.state_dict()).items()])
        if hf:
            hf_models.save_pretrained(model, os.path.join(a.dump_dir, "pretrained"))

    sampler = DistributedSampler(list(range(n)), num_replicas=world, rank=rank,
                                 shuffle=a.shuffle, seed=a.data_seed,
                                 drop_last=a.sampler_drop_last)
    per_epoch = len(sampler)
    nbatches = per_epoch // a.batch if a.dataloader_drop_last else -(-per_epoch // a.batch)
    accum = a.gradient_accumulation_steps
    steps_per_epoch = nbatches // accum
    if steps_per_epoch == 0:
        raise SystemExit("torch_reference: rank %d has %d micro-batches per epoch, fewer than "
                         "gradient_accumulation_steps=%d" % (rank, nbatches, accum))
    epoch_cache = {}

    def micro_batch(k, m):
        """Micro-batch m of step k: a DataLoader(batch_size, drop_last) over the sampler,
        set_epoch(e) before epoch e; an epoch has nbatches // accum steps and its leftover
        micro-batches are skipped, as in ddp-train (src/train/trainer.c)."""
        e, j = divmod(k, steps_per_epoch)
        j = j * accum + m
        if e not in epoch_cache:
            sampler.set_epoch(e)
            epoch_cache.clear()
            epoch_cache[e] = list(iter(sampler))
        return epoch_cache[e][j * a.batch:(j + 1) * a.batch]

    # Each rank's own gradient before communication: a tensor hook sees every incoming
    # gradient before AccumulateGrad (and so before DDP's hook); summed over the micro-steps
    # as AccumulateGrad sums them.
    local = {}
    if a.dump_local_grads:
        def local_hook(nm):
            def hook(g):
                local[nm] = g.detach().clone() if nm not in local else local[nm] + g
            return hook
        for nm, p in model.named_parameters():
            if p.requires_grad:
                p.register_hook(local_hook(nm))
    for k in range(a.start_step, a.steps):
        flags = flags_at(a, rank, k)
        local.clear()
        xs, ys, ids, total = [], [], [], 0.0
        for m in range(accum):
            ind = micro_batch(k, m)
            it = torch.tensor(ind, dtype=torch.int64)
            x, y = feats[it], labels[it]
            xs.append(x), ys.append(y), ids.append(it)
            xd, yd = x.to(device), y.to(device)
            last = m == accum - 1
            fwd = (lambda: hf_forward(ddp, model, xd)) if hf else (lambda: ddp(xd, flags))
            if last:
                out = fwd()
            else:
                with ddp.no_sync():
                    out = fwd()
            if hf and a.loss == "auto":
                loss = hf_models.compute_loss(model, out, yd)
            elif loss_kind == "ce":
                loss = F.cross_entropy(out, yd)
            else:
                loss = F.mse_loss(out, yd.reshape(out.shape))
            loss = loss / accum
            if last:
                loss.backward()
            else:
                with ddp.no_sync():
                    loss.backward()
            total += float(loss.detach().cpu())
        entries = [("input.x", torch.cat(xs)), ("input.y", torch.cat(ys)),
                   ("input.index", torch.cat(ids))]
        grads = state_entries(True)[:len(pnames)]
        none = [nm for nm, p in model.named_parameters() if p.grad is None]
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        if a.zero_comm_hook == "no":  # overlap_with_ddp: the hook steps
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=a.zero_grad_set_to_none)
        entries += grads + state_entries(False)
        meta = {"step": str(k), "rank": str(rank), "loss": repr(total),
                "micro_batches": str(accum), "flags": str(flags), "grads_none": ",".join(none)}
        if a.dump_local_grads:
            lnone = []
            for nm, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                if nm not in local:
                    lnone.append(nm)
                g = local.get(nm, torch.zeros_like(p))
                entries.append(("local_grad." + nm, g.detach().cpu().clone()))
            meta["local_grads_none"] = ",".join(lnone)
        st.save_torch(os.path.join(rdir, "step%06d.safetensors" % k), entries, meta)

    # The logger records the statistics of the last iteration and the rebuilt layout at the
    # next forward; calling it here gives the same record without another forward.
    ddp.logger.set_runtime_stats_and_log()
    ld = {k: (v if isinstance(v, (int, float)) else str(v))
          for k, v in ddp._get_ddp_logging_data().items()}
    rebuilt = parse_layout(ld.get("rebuilt_per_bucket_param_indices"))
    info = {
        "param_names": names,
        "param_shapes": [list(p.shape) for p in params],
        "state_param_names": pnames,
        "buffer_names": bnames,
        "bucket_layouts": {"initial": initial, "rebuilt": rebuilt},
        "bucket_sizes": {"initial": init_sizes,
                         "rebuilt": csv_ints(ld.get("rebuilt_bucket_sizes")) or None},
        "bucket_size_limits": {"initial": limits if limits != [sys.maxsize] else None,
                               "rebuilt": [dist._DEFAULT_FIRST_BUCKET_BYTES,
                                           ddp.bucket_bytes_cap]},
        "initial_layout_verified": initial_verified,
        "grad_ready_order": csv_ints(ld.get("prev_iteration_grad_ready_order_indices")) or None,
        "logging_data": ld,
    }
    if a.zero and a.zero_comm_hook != "no":  # the bucket partition, made after the warm-up
        zero_partition = {pname[id(p)]: r
                          for r, rgroups in enumerate(opt._partition_parameters())
                          for g in rgroups for p in g["params"]}
    if zero_partition is not None:
        info["zero_partition"] = zero_partition
    with open(os.path.join(rdir, "ddp.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.write("\n")
    if rank == 0 and a.comm_hook in ("power_sgd", "batched_power_sgd"):
        save_q_draws(os.path.join(a.dump_dir, "powersgd_q.safetensors"), q_draws, st)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_entry(rank, world, port, a):
    try:
        worker(rank, world, port, a)
    except SystemExit as e:
        sys.stderr.write("%s\n" % e)
        sys.stderr.flush()
        os._exit(1)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def main(argv):
    a = parse_args(argv)
    if not os.path.isfile(a.model):
        sys.stderr.write("torch_reference: model file %s not found\n" % a.model)
        return 2
    if a.data != "synthetic" and not os.path.isfile(a.data):
        sys.stderr.write("torch_reference: dataset %s not found\n" % a.data)
        return 2
    with open(a.model) as f:
        spec = json.load(f)
    under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                   "MASTER_PORT"))
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else a.world
    rank0 = int(os.environ["RANK"]) == 0 if under_torchrun else True
    os.makedirs(a.dump_dir, exist_ok=True)
    if rank0:
        import torch
        cfg = config_dict(a)
        cfg["world"] = world
        meta = {"format": FORMAT, "producer": "torch_reference.py",
                "producer_version": "torch " + torch.__version__, "world_size": world,
                "steps": a.steps, "config": cfg, "model": spec}
        with open(os.path.join(a.dump_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.write("\n")
    if under_torchrun:
        spawn_entry(int(os.environ["RANK"]), world, None, a)
        return 0  # not reached: the worker ends with os._exit
    import torch.multiprocessing as mp
    import torch.distributed as dist
    from datetime import timedelta
    ctx = mp.get_context("spawn")
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=a.timeout),
                           wait_for_workers=False)
    port = server.port
    procs = [ctx.Process(target=spawn_entry, args=(r, world, port, a)) for r in range(world)]
    for p in procs:
        p.start()
    # Wait for all ranks; the first failure stops the others at once instead of leaving
    # them blocked in a collective until the process-group timeout.
    from multiprocessing.connection import wait
    rc, live = 0, list(procs)
    while live:
        wait([p.sentinel for p in live])
        for p in [p for p in live if not p.is_alive()]:
            live.remove(p)
            p.join()
            if p.exitcode != 0 and rc == 0:
                sys.stderr.write("torch_reference: rank %d exited with status %s\n"
                                 % (procs.index(p), p.exitcode))
                rc = 1
                for q in live:
                    q.terminate()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
