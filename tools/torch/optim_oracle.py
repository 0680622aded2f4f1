#!/usr/bin/python3
"""PyTorch oracle for tests/test_optim.c: optimizer steps, clipping and LR schedules.

Run with Debian's interpreter (/usr/bin/python3, torch 1.13). Exit status 77 means torch is
not available, and the calling test skips.

  optim_oracle.py steps IN OUT   run the optimizer cases described in IN, write OUT
  optim_oracle.py sched IN OUT   evaluate LR schedule multipliers

Input of `steps`, one directive per line (floats are IEEE bit patterns in hex: 8 digits for
f32, 16 for f64):
  case NAME KIND key=value ...   KIND sgd|adam|adamw; keys lr momentum dampening nesterov
                                 weight_decay maximize beta1 beta2 eps amsgrad dtype clip
                                 sched warmup total cycles
  shape D0 D1 ...                one line per parameter
  steps K
  p HEX...                       initial values, one line per parameter
  g HEX...                       K * nparams lines: step-major gradients
  end
Output: for each case "case NAME", then per step "lr REPR", "norm HEX" (when clipping) and
one "p HEX..." line per parameter with the values after that step.

Input of `sched`: lines "KIND WARMUP TOTAL CYCLES NSTEPS BASE_LR [KWARGS]" (KWARGS: the
schedule's other lr_scheduler_kwargs as JSON with no spaces); output per line the
multipliers for steps 0..NSTEPS-1 computed from the Hugging Face formulas restated in
hf_schedules.py,
then the learning rates torch's LambdaLR produces with them ("lam ..." and "lr ...").
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_schedules  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
try:
    import numpy as np
    import torch
except Exception:  # torch or numpy missing: let the test skip
    sys.exit(77)

torch.set_num_threads(1)


def lam(kind, w, t, c, base, kwargs=None):
    """Hugging Face's schedule multiplier (tools/torch/hf_schedules.py) as LambdaLR's
    function of the step, with num_cycles c for the cosine kinds, the base lr as the
    optimizer's and lr_scheduler_kwargs (a dict) for the rest."""
    kw = dict(kwargs or {})
    if kind in ("cosine", "cosine_with_restarts", "cosine_with_min_lr"):
        kw["num_cycles"] = c
    return lambda s: hf_schedules.lr_lambda(kind, s, w, t, base, **kw)


def decode(words, dtype):
    if dtype == "f32":
        return torch.from_numpy(np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32))
    return torch.from_numpy(np.array([int(w, 16) for w in words], dtype=np.uint64).view(np.float64))


def encode(t):
    a = t.detach().contiguous().numpy().reshape(-1)
    if a.dtype == np.float32:
        return " ".join("%08x" % v for v in a.view(np.uint32))
    return " ".join("%016x" % v for v in a.view(np.uint64))


def run_case(header, shapes, steps, pvals, gvals, out):
    name, kind = header[1], header[2]
    kv = dict(item.split("=", 1) for item in header[3:])
    dtype = kv.get("dtype", "f32")
    tdt = torch.float32 if dtype == "f32" else torch.float64
    params = []
    for shape, words in zip(shapes, pvals):
        p = decode(words, dtype).to(tdt).reshape(shape).clone().requires_grad_(True)
        params.append(p)
    lr = float(kv["lr"])
    wd = float(kv.get("weight_decay", "0"))
    maximize = kv.get("maximize", "0") == "1"
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=float(kv.get("momentum", "0")),
                              dampening=float(kv.get("dampening", "0")),
                              nesterov=kv.get("nesterov", "0") == "1", weight_decay=wd,
                              maximize=maximize)
    else:
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        opt = cls(params, lr=lr, betas=(float(kv["beta1"]), float(kv["beta2"])),
                  eps=float(kv["eps"]), weight_decay=wd, amsgrad=kv.get("amsgrad", "0") == "1",
                  maximize=maximize)
    sched = None
    if kv.get("sched", "none") != "none":
        fn = lam(kv["sched"], int(kv["warmup"]), int(kv["total"]), float(kv["cycles"]), lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    clip = float(kv["clip"]) if "clip" in kv else None
    out.write("case %s\n" % name)
    n = len(params)
    for k in range(steps):
        for i, p in enumerate(params):
            p.grad = decode(gvals[k * n + i], dtype).to(tdt).reshape(shapes[i]).clone()
        out.write("lr %r\n" % opt.param_groups[0]["lr"])
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            out.write("norm %s\n" % encode(norm.reshape(1)))
        opt.step()
        if sched is not None:
            sched.step()
        for p in params:
            out.write("p %s\n" % encode(p))


def steps_mode(inp, outp):
    with open(inp) as f, open(outp, "w") as out:
        header, shapes, steps, pvals, gvals = None, [], 0, [], []
        for line in f:
            tok = line.split()
            if not tok:
                continue
            if tok[0] == "case":
                header, shapes, steps, pvals, gvals = tok, [], 0, [], []
            elif tok[0] == "shape":
                shapes.append([int(x) for x in tok[1:]])
            elif tok[0] == "steps":
                steps = int(tok[1])
            elif tok[0] == "p":
                pvals.append(tok[1:])
            elif tok[0] == "g":
                gvals.append(tok[1:])
            elif tok[0] == "end":
                run_case(header, shapes, steps, pvals, gvals, out)


def sched_mode(inp, outp):
    with open(inp) as f, open(outp, "w") as out:
        for line in f:
            tok = line.split()
            if not tok:
                continue
            kind, w, t, c, n, base = tok[0], int(tok[1]), int(tok[2]), float(tok[3]), int(tok[4]), float(tok[5])
            fn = lam(kind, w, t, c, base, json.loads(tok[6]) if len(tok) > 6 else None)
            out.write("lam %s\n" % " ".join(repr(fn(s)) for s in range(n)))
            p = torch.zeros(1, requires_grad=True)
            opt = torch.optim.SGD([p], lr=base)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
            lrs = []
            for _ in range(n):
                lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
            out.write("lr %s\n" % " ".join(repr(x) for x in lrs))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("steps", "sched"):
        sys.stderr.write(__doc__)
        sys.exit(2)
    (steps_mode if sys.argv[1] == "steps" else sched_mode)(sys.argv[2], sys.argv[3])
