"""libddp_capture: per-step dumps from any PyTorch DistributedDataParallel job.

One file, Python's standard library and PyTorch only (1.13 and 2.x; any backend: gloo,
nccl with CUDA tensors, libddp's); copy it beside a training script on any machine. It
writes the dump layout of libddp's docs/dumps.md, which `ddp-compare A B` holds against
another dump of the same script (on another backend, another machine, GPUs or CPUs) and
names the first step, bucket, tensor and element where the two runs part
(docs/compare.md, "Dumps from your own PyTorch script").

The lines a script adds, after it built its DDP model and optimizer and before the first
forward:

    from libddp_capture import Capture
    cap = Capture(ddp_model, optimizer, "dumps/gloo")
    ...                                   # the training loop, unchanged; optionally
    cap.inputs(labels=y)                  # more inputs to checksum (the forward's are taken)
    cap.loss(loss)                        # the step's loss, into the step file's metadata
    ...
    cap.close()                           # or: with Capture(...) as cap: <training loop>

What it does:
- registers a DDP communication hook of its own that records each bucket's buffer before
  communication (this rank's local gradients) and the hook's result after it (the averaged
  gradients), then calls the script's own hook: `ddp_model.register_comm_hook(state, hook)`
  called after the Capture is created sets the hook the capture calls (PyTorch allows one
  hook per model, so a hook registered before the Capture is refused with a message).
  Without one it calls PyTorch's `allreduce_hook` (divide by the world size, allreduce SUM);
- wraps the DDP model's forward to checksum every tensor argument (`input_checksum.*`);
- wraps `optimizer.step`: after each step it writes `DIR/rank{r}/step{NNNNNN}.safetensors`
  (checksums, local gradients and averaged gradients per bucket, parameters and buffers
  after the step), `DIR/rank{r}/ddp.json` (parameter list, observed bucket layouts) and,
  on rank 0, `DIR/meta.json`. `DIR/rank{r}/init.safetensors` is written at construction.

Every tensor is copied to host memory before it is written; bucket copies stay on the
device until the step's file is written.
"""

import ctypes
import hashlib
import json
import os
import struct
import sys
import tempfile
import types

__all__ = ["Capture", "CaptureError", "FORMAT"]

FORMAT = "libddp-dump-1"
PRODUCER = "libddp_capture.py"


class CaptureError(RuntimeError):
    """A usage error of the capture; the message names the object and what to do."""


# ------------------------------------------------------------------ safetensors -------

def _st_dtype(torch, t):
    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
    return names.get(t.dtype)


def _host_bytes(t):
    """The tensor's elements as little-endian row-major bytes (copied to host memory)."""
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    t = t.to("cpu").contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _write_safetensors(path, entries, metadata):
    """entries: list of (name, tensor); written atomically (temporary file, rename)."""
    import torch
    header = {"__metadata__": dict(metadata)}
    chunks, offset = [], 0
    for name, t in entries:
        dt = _st_dtype(torch, t)
        if dt is None:
            raise CaptureError("libddp_capture: tensor %s has dtype %s, which the dump format "
                               "(safetensors F64/F32/F16/BF16/I64/I32/I16/I8/U8/BOOL) cannot "
                               "hold" % (name, t.dtype))
        data = _host_bytes(t)
        header[name] = {"dtype": dt, "shape": [int(d) for d in t.shape],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    _write_atomic(path, struct.pack("<Q", len(text)) + text + b"".join(chunks))


def _write_atomic(path, blob):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_json(path, obj):
    _write_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def _json_safe(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    return str(v)


# ------------------------------------------------------------------ the capture -------

def _tensors_in(obj, path, out):
    """Every tensor in args/kwargs-like nests, with a dotted path."""
    import torch
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _tensors_in(x, "%s.%d" % (path, i), out)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            _tensors_in(x, "%s.%s" % (path, k), out)


def _checksum(torch, t):
    """I64 [2]: the element count and a 63-bit BLAKE2b hash of dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(("%s%s" % (t.dtype, list(t.shape))).encode())
    h.update(_host_bytes(t))
    v = int.from_bytes(h.digest(), "little") & 0x7FFFFFFFFFFFFFFF
    return torch.tensor([t.numel(), v], dtype=torch.int64)


def _capture_hook(cap, bucket):
    """The hook DDP calls per bucket: local copy, the script's hook, averaged copy."""
    if not cap._recording:
        return cap._inner_hook(cap._inner_state, bucket)
    idx = bucket.index()
    names = cap._bucket_names(bucket)
    local = bucket.buffer().detach().clone()
    fut = cap._inner_hook(cap._inner_state, bucket)

    def record(f):
        v = f.value()
        avg = v[0] if isinstance(v, (list, tuple)) else v
        cap._pending[idx] = (names, local, avg.detach().clone())
        return v

    return fut.then(record)


class Capture(object):
    """Dumps every optimizer step of a DDP job (docs/dumps.md layout).

    Capture(ddp_model, optimizer, dump_dir, inputs=True, save_inputs=False, max_steps=None,
            config=None)

    ddp_model: a torch.nn.parallel.DistributedDataParallel with no comm hook registered yet
    (register yours after this). optimizer: the optimizer whose step() ends a training step.
    inputs: checksum the tensor arguments of every forward. save_inputs: also write them
    whole (input.*). max_steps: stop recording after this many steps. config: a dict added
    to meta.json's "config" (learning rate, data, anything that identifies the run)."""

    def __init__(self, ddp_model, optimizer, dump_dir, inputs=True, save_inputs=False,
                 max_steps=None, config=None):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        if sys.byteorder != "little":
            raise CaptureError("libddp_capture: the dump format is little-endian; this "
                               "machine is %s-endian" % sys.byteorder)
        if not isinstance(ddp_model, DistributedDataParallel):
            raise CaptureError("libddp_capture: Capture wants the model wrapped in "
                               "torch.nn.parallel.DistributedDataParallel, got %s"
                               % type(ddp_model).__name__)
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "param_groups"):
            raise CaptureError("libddp_capture: Capture wants a torch.optim optimizer, got %s"
                               % type(optimizer).__name__)
        self._torch = torch
        self._ddp = ddp_model
        self._opt = optimizer
        self._dir = dump_dir
        self._want_inputs = bool(inputs)
        self._save_inputs = bool(save_inputs)
        self._max_steps = max_steps
        pg = getattr(ddp_model, "process_group", None)
        self._rank = dist.get_rank(pg)
        self._world = dist.get_world_size(pg)
        try:
            self._backend = str(dist.get_backend(pg))
        except (RuntimeError, ValueError):
            self._backend = "unknown"
        self._module = ddp_model.module
        self._step = 0
        self._recording = max_steps is None or max_steps > 0
        self._pending = {}
        self._inputs = []
        self._input_names = {}
        self._forwards = 0
        self._loss = None
        self._layouts = []  # (step, [[reducer indices], ...]) for each step with buckets
        self._closed = False

        self._state_names = [n for n, _ in self._module.named_parameters()]
        persistent = set(self._module.state_dict().keys())
        self._buffer_names = [n for n, _ in self._module.named_buffers() if n in persistent]
        self._reducer_names, self._reducer_params = self._reducer_list()
        self._name_of = {id(p): n for n, p in zip(self._reducer_names, self._reducer_params)}
        self._index_of = {n: i for i, n in enumerate(self._reducer_names)}

        # The hook: the capture's own, dispatching to the script's (set later) or to
        # PyTorch's allreduce_hook.
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        self._inner_state, self._inner_hook = pg, default_hooks.allreduce_hook
        self._hook_name = "allreduce_hook (libddp_capture's default)"
        try:
            ddp_model.register_comm_hook(self, _capture_hook)
        except RuntimeError as e:
            raise CaptureError(
                "libddp_capture: cannot register the capture's comm hook on this DDP model "
                "(%s). PyTorch allows one hook per model: create the Capture before "
                "ddp_model.register_comm_hook(state, hook); the capture then calls your hook"
                % str(e).strip().splitlines()[0]) from None
        ddp_model.register_comm_hook = self._set_user_hook
        ddp_model.register_builtin_comm_hook = self._set_builtin_hook

        self._orig_forward = ddp_model.forward
        if self._want_inputs:
            ddp_model.forward = self._forward
        self._orig_step = optimizer.step
        self._step_was_own = "step" in optimizer.__dict__  # a scheduler's wrapper
        step_fn = self._step_fn = _make_step(self)
        for attr in ("_with_counter", "_wrapped_by_lr_sched"):
            if hasattr(self._orig_step, attr):
                setattr(step_fn, attr, getattr(self._orig_step, attr))
        optimizer.step = types.MethodType(step_fn, optimizer)

        self._rdir = os.path.join(dump_dir, "rank%d" % self._rank)
        os.makedirs(self._rdir, exist_ok=True)
        self._config = self._config_dict(config)
        if self._recording:
            _write_safetensors(os.path.join(self._rdir, "init.safetensors"),
                               self._state_entries(), {"rank": str(self._rank),
                                                       "producer": PRODUCER})
        self._write_meta()

    # -------------------------------------------------------------- public ----------

    def inputs(self, **tensors):
        """Adds tensors (targets, masks: what the forward does not take) to the step's
        checksums, as input_checksum.<name> (a repeated name gets .1, .2, ...)."""
        if not self._recording:
            return
        for name, t in tensors.items():
            found = []
            _tensors_in(t, name, found)
            for path, x in found:
                self._add_input(path, x)

    def loss(self, value):
        """Adds the loss of a micro-batch to the step's "loss" metadata."""
        if self._recording:
            v = float(value.detach().float().cpu()) if hasattr(value, "detach") else float(value)
            self._loss = v if self._loss is None else self._loss + v

    def close(self):
        """Stops recording and restores forward and optimizer.step (where nothing wrapped
        them since). The comm hook stays registered (PyTorch cannot remove one) and from
        now on only calls the script's."""
        if self._closed:
            return
        self._closed = True
        self._recording = False
        if self._ddp.__dict__.get("forward") == self._forward:
            del self._ddp.__dict__["forward"]
        # Restored only while nobody wrapped it after the capture (a scheduler created
        # later holds the capture's step inside its own wrapper: that one stays, and the
        # capture's step now passes straight through).
        if getattr(self._opt.__dict__.get("step"), "__func__", None) is self._step_fn:
            if self._step_was_own:
                self._opt.step = self._orig_step
            else:
                del self._opt.__dict__["step"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -------------------------------------------------------------- hooks -----------

    def _set_user_hook(self, state, hook):
        if not callable(hook):
            raise CaptureError("libddp_capture: register_comm_hook wants a callable hook, got "
                               "%s" % type(hook).__name__)
        self._inner_state, self._inner_hook = state, hook
        self._hook_name = getattr(hook, "__qualname__", str(hook))
        self._config["comm_hook"] = self._hook_name
        self._write_meta()

    def _set_builtin_hook(self, comm_hook_type):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        table = {"ALLREDUCE": default_hooks.allreduce_hook,
                 "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        if name not in table:
            raise CaptureError("libddp_capture: built-in comm hook %s has no Python "
                               "equivalent here" % name)
        self._set_user_hook(getattr(self._ddp, "process_group", None), table[name])

    def _reducer_list(self):
        """DDP's reducer parameter list (_build_params_for_reducer): per module in
        named_modules() order, its own parameters requiring grad and not ignored, once."""
        ignore = set(getattr(self._ddp, "parameters_to_ignore", ()) or ())
        names, params, seen = [], [], set()
        for mname, m in self._module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                fqn = "%s.%s" % (mname, pname) if mname else pname
                if not p.requires_grad or id(p) in seen or fqn in ignore:
                    continue
                seen.add(id(p))
                names.append(fqn)
                params.append(p)
        # named_parameters() names shared parameters by their first occurrence; use those.
        first = {}
        for n, p in self._module.named_parameters():
            first.setdefault(id(p), n)
        return [first.get(id(p), n) for n, p in zip(names, params)], params

    def _bucket_names(self, bucket):
        out = []
        for p in bucket.parameters():
            n = self._name_of.get(id(p))
            if n is None:
                for q, m in zip(self._reducer_params, self._reducer_names):
                    if q.data_ptr() == p.data_ptr() and q.shape == p.shape:
                        n = m
                        break
            if n is None:
                raise CaptureError("libddp_capture: bucket %d holds a parameter of shape %s "
                                   "that is not in the DDP model's parameter list"
                                   % (bucket.index(), list(p.shape)))
            out.append(n)
        return out

    def _forward(self, *args, **kwargs):
        if self._recording:
            found = []
            _tensors_in(list(args), "fwd%d.args" % self._forwards, found)
            _tensors_in(kwargs, "fwd%d.kwargs" % self._forwards, found)
            for path, t in found:
                self._add_input(path, t)
            self._forwards += 1
        return self._orig_forward(*args, **kwargs)

    def _add_input(self, path, t):
        k = self._input_names.get(path, 0)
        self._input_names[path] = k + 1
        name = path if k == 0 else "%s.%d" % (path, k)
        self._inputs.append(("input_checksum." + name, _checksum(self._torch, t)))
        if self._save_inputs:
            self._inputs.append(("input." + name, t.detach().to("cpu").clone()))

    # -------------------------------------------------------------- the step --------

    def _before_step(self):
        """What must be read before the optimizer changes anything: .grad of parameters
        whose bucket did not report (frozen ones, or no synchronised backward)."""
        self._grads_at_step = {}
        self._none_at_step = []
        in_buckets = set(n for names, _, _ in self._pending.values() for n in names)
        for n, p in self._module.named_parameters():
            if p.grad is None:
                self._none_at_step.append(n)
            elif n not in in_buckets:
                self._grads_at_step[n] = p.grad.detach().clone()

    def _after_step(self):
        torch = self._torch
        k = self._step
        pending = [self._pending[i] for i in sorted(self._pending)]
        locals_, avgs, buckets, seen = [], [], [], set()
        params = dict(self._module.named_parameters())
        for names, local, avg in pending:
            numels = [params[n].numel() for n in names]
            for what, flat in (("local", local), ("averaged", avg)):
                if not flat.is_sparse and flat.numel() != sum(numels):
                    raise CaptureError("libddp_capture: step %d: a bucket's %s gradient has "
                                       "%d elements, its parameters %d" %
                                       (k, what, flat.numel(), sum(numels)))
            off = 0
            for n, c in zip(names, numels):
                shape = params[n].shape
                if local.is_sparse:
                    lv, av = local.to_dense().reshape(shape), avg.to_dense().reshape(shape)
                else:
                    lv = local.reshape(-1)[off:off + c].reshape(shape)
                    av = avg.reshape(-1)[off:off + c].reshape(shape)
                off += c
                locals_.append(("local_grad." + n, lv))
                avgs.append(("grad." + n, av))
                seen.add(n)
            buckets.append(names)
        for n, p in self._module.named_parameters():
            if n not in seen:
                g = self._grads_at_step.get(n)
                avgs.append(("grad." + n, g if g is not None else torch.zeros_like(p)))
        entries = list(self._inputs) + locals_ + avgs + self._state_entries()
        meta = {"step": str(k), "rank": str(self._rank), "producer": PRODUCER,
                "micro_batches": str(self._forwards),
                "grads_none": ",".join(self._none_at_step),
                "local_grads_none": "",
                "buckets": json.dumps(buckets, separators=(",", ":"))}
        if self._loss is not None:
            meta["loss"] = repr(self._loss)
        _write_safetensors(os.path.join(self._rdir, "step%06d.safetensors" % k), entries, meta)
        if buckets:
            self._layouts.append((k, [[self._index_of[n] for n in b] for b in buckets]))
        self._pending.clear()
        self._inputs = []
        self._input_names = {}
        self._forwards = 0
        self._loss = None
        self._grads_at_step = None
        self._step += 1
        self._write_ddp_json()
        self._write_meta()
        if self._max_steps is not None and self._step >= self._max_steps:
            self._recording = False

    def _state_entries(self):
        out = [("param." + n, p) for n, p in self._module.named_parameters()]
        bufs = dict(self._module.named_buffers())
        out += [("buffer." + n, bufs[n]) for n in self._buffer_names]
        return out

    # -------------------------------------------------------------- JSON files ------

    def _config_dict(self, extra):
        ddp, opt = self._ddp, self._opt
        cap = getattr(ddp, "bucket_bytes_cap", None)
        cfg = {
            "world": self._world, "backend": self._backend,
            "bucket_cap_mb": cap / (1024.0 * 1024.0) if cap else None,
            "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
            "broadcast_buffers": getattr(ddp, "broadcast_buffers", None),
            "static_graph": getattr(ddp, "static_graph", None),
            "gradient_as_bucket_view": getattr(ddp, "gradient_as_bucket_view", None),
            "comm_hook": self._hook_name,
            "optim": type(opt).__name__,
            "optim_defaults": _json_safe(getattr(opt, "defaults", {})),
            "device": str(next(iter(self._module.parameters())).device)
            if self._state_names else "none",
        }
        if extra:
            cfg.update(_json_safe(dict(extra)))
        return cfg

    def _write_meta(self):
        if self._rank != 0:
            return
        meta = {"format": FORMAT, "producer": PRODUCER,
                "producer_version": "torch " + self._torch.__version__,
                "world_size": self._world, "steps": self._step, "config": self._config,
                "model": {"class": type(self._module).__module__ + "." +
                          type(self._module).__name__,
                          "parameters": [[n, list(p.shape), str(p.dtype)] for n, p in
                                         self._module.named_parameters()]}}
        os.makedirs(self._dir, exist_ok=True)
        _write_json(os.path.join(self._dir, "meta.json"), meta)

    def _write_ddp_json(self):
        shapes = [list(p.shape) for p in self._reducer_params]
        sizes = [p.numel() * p.element_size() for p in self._reducer_params]
        initial = self._layouts[0][1] if self._layouts else None
        rebuilt = self._layouts[-1][1] if len(self._layouts) > 1 else None
        info = {
            "param_names": self._reducer_names,
            "param_shapes": shapes,
            "state_param_names": self._state_names,
            "buffer_names": self._buffer_names,
            "bucket_layouts": {"initial": initial, "rebuilt": rebuilt},
            "bucket_sizes": {k: [sum(sizes[i] for i in b) for b in v] if v else None
                             for k, v in (("initial", initial), ("rebuilt", rebuilt))},
            "layout_source": "observed: the buckets DDP's comm hook saw at the first and the "
                             "last recorded step",
        }
        try:
            ld = self._ddp._get_ddp_logging_data()
            info["logging_data"] = {k: (v if isinstance(v, (int, float)) else str(v))
                                    for k, v in ld.items()}
        except (AttributeError, RuntimeError):
            pass
        _write_json(os.path.join(self._rdir, "ddp.json"), info)


def _make_step(cap):
    """optimizer.step's replacement (a function bound to the optimizer, so that learning
    rate schedulers created later can wrap it as they wrap the original)."""
    def step(opt, *args, **kwargs):
        if not cap._recording:
            return cap._orig_step(*args, **kwargs)
        cap._before_step()
        out = cap._orig_step(*args, **kwargs)
        cap._after_step()
        return out
    return step
