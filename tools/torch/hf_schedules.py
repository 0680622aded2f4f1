"""Hugging Face's learning-rate schedules (transformers.get_scheduler), restated in Python.

Each is the LambdaLR multiplier of the optimizer's base learning rate at the scheduler's
step count, computed in double in the order Python evaluates transformers' lr_lambda
functions, with get_scheduler's defaults (no lr_scheduler_kwargs): cosine half a wave
(num_cycles 0.5), cosine_with_restarts one cycle, polynomial to lr_end 1e-7 with power
1.0, inverse_sqrt on a timescale of the warmup steps (10000 without warmup),
cosine_with_min_lr half a wave down to its min_lr or min_lr_rate; lr_scheduler_kwargs
change them as get_scheduler passes them on. libddp's C
side is src/optim/schedule.c; tests/test_optim.c holds the two against each other bit for
bit (through optim_oracle.py), and torch_reference.py and libddp_optim.py use this one.
"""
import math

NAMES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
         "polynomial", "inverse_sqrt", "cosine_with_min_lr")

# The arguments each schedule takes through lr_scheduler_kwargs (get_scheduler passes them on).
KWARGS = {"cosine": ("num_cycles",), "cosine_with_restarts": ("num_cycles",),
          "polynomial": ("lr_end", "power"), "inverse_sqrt": ("timescale",),
          "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate")}


def lr_lambda(kind, step, warmup, total, lr_init, **kwargs):
    """The multiplier at `step`; lr_init is the optimizer's learning rate (HF's
    optimizer.defaults["lr"]); kwargs are lr_scheduler_kwargs."""
    bad = set(kwargs) - set(KWARGS.get(kind, ()))
    if bad:
        raise TypeError("lr_scheduler_kwargs %s: not arguments of %s" % (sorted(bad), kind))
    num_cycles = kwargs.get("num_cycles")
    if kind == "constant":
        return 1.0
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    if kind in ("cosine", "cosine_with_restarts", "cosine_with_min_lr"):
        progress = float(step - warmup) / float(max(1, total - warmup))
        if kind == "cosine":
            c = 0.5 if num_cycles is None else num_cycles
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(c) * 2.0 * progress)))
        if kind == "cosine_with_min_lr":
            c = 0.5 if num_cycles is None else num_cycles
            min_lr, rate = kwargs.get("min_lr"), kwargs.get("min_lr_rate")
            if (min_lr is None) == (rate is None):
                raise ValueError("cosine_with_min_lr takes one of min_lr or min_lr_rate")
            if min_lr is not None:
                rate = min_lr / lr_init
            factor = 0.5 * (1.0 + math.cos(math.pi * float(c) * 2.0 * progress))
            factor = factor * (1 - rate) + rate
            return max(0, factor)
        c = 1 if num_cycles is None else num_cycles
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(c) * progress) % 1.0))))
    if kind == "polynomial":
        lr_end, power = kwargs.get("lr_end", 1e-7), kwargs.get("power", 1.0)
        if step > total:
            return lr_end / lr_init
        lr_range = lr_init - lr_end
        pct_remaining = 1 - (step - warmup) / (total - warmup)
        return (lr_range * pct_remaining ** power + lr_end) / lr_init
    if kind == "inverse_sqrt":
        timescale = kwargs.get("timescale") or warmup or 10_000
        shift = timescale - warmup
        return 1.0 / math.sqrt((step + shift) / timescale)
    raise ValueError("lr_scheduler_type %r: not one of %s" % (kind, ", ".join(NAMES)))
