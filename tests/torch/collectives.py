"""Every torch.distributed call a CPU script uses, on the libddp backend, against values this
script computes itself (run by tests/torch/test_collectives.py under ddprun, 2 and 3 ranks).

Each rank can make every rank's input (seeded by rank), so it computes what each collective
must return: reductions folded in rank order in the element's dtype (fp16/bf16 in fp32,
rounded after every addition), bit for bit. Prints "CHECKS <n>" and exits 0 when all hold;
the first mismatch raises with both values.
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "libddp"
if BACKEND == "libddp":
    import libddp_torch  # noqa: F401  (registers the backend)

checks = 0


def same(what, got, want):
    global checks
    checks += 1
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"rank {R}: {what}: got {got!r}, want {want!r}")


def raises(what, fn, *needles):
    global checks
    checks += 1
    try:
        fn()
    except Exception as e:  # the backend's errors are RuntimeError or ValueError
        msg = str(e)
        for n in needles:
            if n not in msg:
                raise AssertionError(f"rank {R}: {what}: message lacks {n!r}: {msg}")
        return
    raise AssertionError(f"rank {R}: {what}: no error")


class ClaimsCuda(torch.Tensor):
    """A storage-less tensor whose device is cuda:0 (a wrapper subclass): on a CPU-only
    PyTorch it carries c10d's calls to the group the way a real CUDA tensor does; any other
    operation on it fails."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32,
                                                   device=torch.device("cuda", 0))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace != "c10d":
            raise RuntimeError(f"ClaimsCuda has no data for {func}")
        from torch.utils._mode_utils import no_dispatch
        with no_dispatch():
            return func(*args, **(kwargs or {}))


def data(rank, dtype, n=37, salt=0):
    """Rank `rank`'s input: random where rounding order matters, small integers elsewhere."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo, hi = (-9, 10) if dtype in (torch.int8, torch.int32, torch.int64) else (0, 20)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def fold(op, xs):
    """The rank-order fold ((x0 op x1) op x2) ..., in the element's dtype."""
    acc = xs[0].clone()
    for x in xs[1:]:
        if acc.dtype in (torch.float16, torch.bfloat16):
            a, b = acc.float(), x.float()
        else:
            a, b = acc, x
        if op == dist.ReduceOp.SUM:
            r = torch.logical_or(a, b) if a.dtype == torch.bool else a + b
        elif op == dist.ReduceOp.PRODUCT:
            r = torch.logical_and(a, b) if a.dtype == torch.bool else a * b
        elif op == dist.ReduceOp.MIN:
            r = torch.minimum(a, b)
        elif op == dist.ReduceOp.MAX:
            r = torch.maximum(a, b)
        elif op == dist.ReduceOp.BAND:
            r = a & b
        elif op == dist.ReduceOp.BOR:
            r = a | b
        else:
            r = a ^ b
        acc = r.to(acc.dtype)
    return acc


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
ALL = FLOATS + INTS + [torch.bool]


def reductions():
    for dt in ALL:
        ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
        if not dt.is_floating_point:
            ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
        for k, op in enumerate(ops):
            xs = [data(r, dt, salt=k) for r in range(W)]
            t = xs[R].clone()
            dist.all_reduce(t, op=op)
            same(f"all_reduce {dt} {op}", t, fold(op, xs))
            t = xs[R].clone()
            dist.reduce(t, dst=W - 1, op=op)
            if R == W - 1:  # gloo leaves scratch values on the other ranks; libddp does not
                same(f"reduce {dt} {op} (root {W - 1})", t, fold(op, xs))
        if dt.is_floating_point:
            xs = [data(r, dt, salt=50) for r in range(W)]
            t = xs[R].clone()
            if BACKEND == "gloo":  # "Cannot use ReduceOp.AVG with Gloo"
                continue
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            want = fold(dist.ReduceOp.SUM, xs)
            want = (want.float() / W).to(dt) if dt in (torch.float16, torch.bfloat16) else want / W
            same(f"all_reduce {dt} AVG", t, want)
    # complex: torch.distributed reduces its real view
    xs = [torch.complex(data(r, torch.float32), data(r, torch.float32, salt=3)) for r in range(W)]
    t = xs[R].clone()
    dist.all_reduce(t)
    want = torch.view_as_complex(fold(dist.ReduceOp.SUM, [torch.view_as_real(x) for x in xs]))
    same("all_reduce complex64", t, want)
    # coalesced and multi-dimensional
    a = [data(r, torch.float32, 12).view(3, 4) for r in range(W)]
    b = [data(r, torch.float32, 5, salt=9) for r in range(W)]
    ta, tb = a[R].clone(), b[R].clone()
    dist.all_reduce_coalesced([ta, tb])
    same("all_reduce_coalesced a", ta, fold(dist.ReduceOp.SUM, a))
    same("all_reduce_coalesced b", tb, fold(dist.ReduceOp.SUM, b))


def sparse():
    """all_reduce of sparse COO tensors (DDP's gradients of a sparse nn.Embedding): every
    index any rank holds, its values summed in rank order from zero (gloo's sparse sum)."""
    global checks
    for dt in (torch.float32, torch.float64):
        parts = []
        for r in range(W):
            g = torch.Generator().manual_seed(70 + r)
            idx = torch.randint(0, 9, (2, 5 + r), generator=g)  # duplicates, overlaps
            val = torch.randn(5 + r, 3, generator=g, dtype=torch.float64).to(dt)
            parts.append(torch.sparse_coo_tensor(idx, val, (9, 9, 3)))
        t = parts[R].clone()
        dist.all_reduce(t)
        dense = [p.coalesce().to_dense() for p in parts]  # each rank coalesces first
        same(f"sparse all_reduce {dt}", t.to_dense(), fold(dist.ReduceOp.SUM,
                                                           [torch.zeros_like(dense[0])] + dense))
        held = torch.unique(torch.cat([p._indices() for p in parts], 1), dim=1)
        same(f"sparse all_reduce {dt}: indices", t._indices(), held)
        checks += 1
        assert t.is_coalesced(), f"rank {R}: the sparse sum is not coalesced"
    t = parts[R].clone()
    raises("sparse all_reduce MAX", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), "SUM")
    t = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, 3), (4, 4, 3))
    dist.all_reduce(t)  # no rank holds an index
    same("sparse all_reduce, nothing held", t.to_dense(), torch.zeros(4, 4, 3))
    h = torch.sparse_coo_tensor(torch.tensor([[R]]), torch.ones(1, dtype=torch.float16), (W,))
    try:
        h + h
    except RuntimeError:  # 1.13's CPU sparse addition has no Half: refused before any exchange
        raises("sparse all_reduce float16", lambda: dist.all_reduce(h), "cannot be summed")


def timeout_wording():
    """A collective that times out says so in a word scripts (and PyTorch's suite, after
    gloo's "Timed out") look for: rank 0 alone in a barrier of a group with a 1 s timeout."""
    g = dist.new_group(timeout=datetime.timedelta(seconds=1))
    if R == 0:
        raises("barrier alone, 1 s", lambda: dist.barrier(group=g), " with a timeout ",
               "DDP_ERR_TIMEOUT", "waiting for rank 1")
    dist.barrier()


def monitored_failures():
    """dist.monitored_barrier with ranks missing, gloo's messages: rank 0 names the first
    missing rank (every one with wait_all_ranks), or its own timeout; the ranks that came
    fail too, pointing at rank 0. Last of the script: a missing rank leaves its count of
    monitored barriers behind the others'."""
    sec = datetime.timedelta

    def at_zero(timeout, wait_all, *needles):
        raises(f"monitored_barrier, rank 0, timeout {timeout}", lambda: dist.monitored_barrier(
            timeout=timeout, wait_all_ranks=wait_all), *needles)

    def came(timeout, wait_all=False):
        raises(f"monitored_barrier, rank {R} came", lambda: dist.monitored_barrier(
            timeout=timeout, wait_all_ranks=wait_all),
            f"Rank {R} successfully reached monitoredBarrier, but received errors while "
            f"waiting for send/recv from rank 0")
    # rank 0's own timeout ran out before it heard from anyone
    if R == 0:
        at_zero(sec(seconds=0), False, "Rank 0 timed out in monitoredBarrier after 0 ms",
                "No ranks successfully processed")
    else:
        came(sec(seconds=0))
    dist.barrier()
    # rank 1 does not come
    if R == 0:
        at_zero(sec(seconds=1), False, "[Rank 0]: Rank 1 failed to pass monitoredBarrier in "
                "1000 ms")
    elif R != 1:
        came(sec(seconds=1))
    dist.barrier()
    # wait_all_ranks: every rank but 0 stays away, and all are named
    if R == 0:
        at_zero(sec(seconds=0.5), True, "[Rank 0]: Ranks " + ", ".join(map(str, range(1, W))) +
                " failed to pass monitoredBarrier in 500 ms")
    dist.barrier()


def movement():
    for dt in ALL + [torch.complex64, torch.int16]:
        base = data if dt not in (torch.complex64, torch.int16) else \
            (lambda r, d, n=37, salt=0: torch.arange(n).to(d) * (r + 1))
        xs = [base(r, dt) for r in range(W)]
        t = xs[R].clone()
        dist.broadcast(t, src=W - 1)
        same(f"broadcast {dt}", t, xs[W - 1])
        outs = [torch.empty_like(xs[0]) for _ in range(W)]
        dist.all_gather(outs, xs[R])
        for r in range(W):
            same(f"all_gather {dt} [{r}]", outs[r], xs[r])
    xs = [data(r, torch.float32, 6) for r in range(W)]
    out = torch.empty(W * 6)
    dist.all_gather_into_tensor(out, xs[R])
    same("all_gather_into_tensor", out, torch.cat(xs))
    ys = [data(r, torch.int64, 3, salt=4) for r in range(W)]
    outs = [[torch.empty(6), torch.empty(3, dtype=torch.int64)] for _ in range(W)]
    # all_gather_coalesced takes one dtype per call, as gloo does
    outs = [[torch.empty(6), torch.empty(6)] for _ in range(W)]
    dist.all_gather_coalesced(outs, [xs[R], xs[R] * 2])
    for r in range(W):
        same(f"all_gather_coalesced [{r}]", torch.cat(outs[r]), torch.cat([xs[r], xs[r] * 2]))
    # gather and scatter, root 1
    root = 1 % W
    g = [torch.empty(6) for _ in range(W)] if R == root else None
    dist.gather(xs[R], gather_list=g, dst=root)
    if R == root:
        for r in range(W):
            same(f"gather [{r}]", g[r], xs[r])
    parts = [data(r, torch.float64, 5, salt=7) for r in range(W)]
    out = torch.empty(5, dtype=torch.float64)
    dist.scatter(out, scatter_list=parts if R == root else None, src=root)
    same("scatter", out, parts[R])
    # reduce_scatter: rank r's block j is data(r, salt=j)
    blocks = [[data(r, torch.float32, 7, salt=20 + j) for j in range(W)] for r in range(W)]
    out = torch.empty(7)
    dist.reduce_scatter(out, blocks[R])
    same("reduce_scatter", out, fold(dist.ReduceOp.SUM, [blocks[r][R] for r in range(W)]))
    out = torch.empty(7)
    dist.reduce_scatter_tensor(out, torch.cat(blocks[R]))
    same("reduce_scatter_tensor", out, fold(dist.ReduceOp.SUM, [blocks[r][R] for r in range(W)]))
    out = torch.empty(7, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, torch.cat([b.to(torch.int32) for b in blocks[R]]),
                               op=dist.ReduceOp.MAX)
    same("reduce_scatter_tensor int32 MAX", out,
         fold(dist.ReduceOp.MAX, [blocks[r][R].to(torch.int32) for r in range(W)]))


def leaf_outputs_and_profiler():
    """Parameters synced by hand: every call writes a leaf that requires grad as data (no
    autograd error, as a raw write); torch.profiler shows each call as libddp:<name>."""
    from torch.profiler import profile, ProfilerActivity
    xs = [data(r, torch.float32, 6) for r in range(W)]
    p = torch.nn.Parameter(torch.zeros(6))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = [torch.nn.Parameter(torch.zeros(6)) for _ in range(W)]
        dist.all_gather(outs, xs[R])
        for r in range(W):
            same(f"all_gather into parameters [{r}]", outs[r].detach(), xs[r])
        dist.scatter(p, scatter_list=xs if R == 0 else None, src=0)
        same("scatter into a parameter", p.detach(), xs[R])
        q = [torch.nn.Parameter(xs[R].clone()), torch.nn.Parameter(xs[R][:3].clone())]
        dist.all_reduce_coalesced(q)
        same("all_reduce_coalesced of parameters", q[1].detach(),
             fold(dist.ReduceOp.SUM, [x[:3] for x in xs]))
        ins = [torch.nn.Parameter(torch.zeros(6)) for _ in range(W)]
        dist.all_to_all(ins, [xs[R] + j for j in range(W)])
        same("all_to_all into parameters", ins[W - 1].detach(), xs[W - 1] + R)
    global checks
    names = {e.name for e in prof.events()}
    for want in ("libddp:all_gather", "libddp:scatter", "libddp:all_reduce_coalesced",
                 "libddp:all_to_all"):
        checks += 1
        assert want in names, f"rank {R}: profiler events lack {want}: {sorted(names)[:20]}"


def views():
    """Strided tensors (slices, transposes, channels_last) as inputs and outputs of every
    call: the result is the same call's on contiguous copies, written through the view, and
    the base's other elements stay as they were."""
    def bases(dt=torch.float32, salt=30):
        return [data(r, dt, 24, salt=salt).reshape(4, 6) for r in range(W)]

    def cols(b):  # a 4 x 3 view with strides (6, 2)
        return b[:, 1::2]

    def after(b, view_of, value):  # b with view_of(b) replaced by value
        b = b.clone()
        view_of(b).copy_(value)
        return b

    bs = bases()
    mine = bs[R].clone()
    dist.all_reduce(cols(mine))
    same("all_reduce of a slice", mine,
         after(bs[R], cols, fold(dist.ReduceOp.SUM, [cols(b) for b in bs])))
    ib = bases(torch.int64, 31)
    mine = ib[R].clone()
    dist.all_reduce(mine.t(), op=dist.ReduceOp.MAX)
    same("all_reduce MAX of a transpose", mine, fold(dist.ReduceOp.MAX, ib))
    cl = [b.reshape(1, 4, 2, 3).contiguous(memory_format=torch.channels_last) for b in bs]
    mine = cl[R].clone()
    dist.all_reduce(mine)
    same("all_reduce of channels_last", mine.contiguous(),
         fold(dist.ReduceOp.SUM, [c.contiguous() for c in cl]))
    mine = bs[R].clone()
    dist.broadcast(cols(mine), src=W - 1)
    same("broadcast into a slice", mine, after(bs[R], cols, cols(bs[W - 1])))
    mine = bs[R].clone()
    dist.reduce(mine[:, 2], dst=0)
    want = after(bs[R], lambda b: b[:, 2], fold(dist.ReduceOp.SUM, [b[:, 2] for b in bs]))
    same("reduce into a slice", mine, want if R == 0 else bs[R])
    outs = [torch.zeros(6, 4).t() for _ in range(W)]
    dist.all_gather(outs, bs[R].t().contiguous().t())  # bs[R]'s values, strides (1, 4)
    for r in range(W):
        same(f"all_gather into transposes [{r}]", outs[r].contiguous(), bs[r])
    out = torch.zeros(6, 4 * W).t()
    dist.all_gather_into_tensor(out, bs[R].t().contiguous().t())
    same("all_gather_into_tensor into a transpose", out.contiguous(), torch.cat(bs))
    outs = [torch.zeros(3, 4).t() for _ in range(W)]
    dist.all_gather(outs, cols(bs[R]))
    for r in range(W):
        same(f"all_gather of a slice [{r}]", outs[r], cols(bs[r]))
    # reduce_scatter_tensor: rank r's block j is bs[r].view(-1)[6j:6j + 6], the input held
    # transposed, the output a column
    out = torch.zeros(6, W + 1)
    dist.reduce_scatter_tensor(out[:, 1], bs[R].reshape(-1)[:6 * W].reshape(W, 6).t()
                               .contiguous().t())
    same("reduce_scatter_tensor into a column", out,
         after(torch.zeros(6, W + 1), lambda b: b[:, 1],
               fold(dist.ReduceOp.SUM, [b.reshape(-1)[6 * R:6 * R + 6] for b in bs])))
    # all_to_all_single, even blocks, a transposed input and output: rank r's input rows
    # are (2W x 3) = bs[r][:2W rows of its 6 x 4 transpose]
    inp = bs[R].t()[:, :3] if 2 * W <= 6 else None
    if inp is not None:
        out = torch.zeros(3, 2 * W).t()
        dist.all_to_all_single(out, inp[:2 * W])
        want = torch.cat([bs[j].t()[2 * R:2 * R + 2, :3] for j in range(W)])
        same("all_to_all_single of transposes", out.contiguous(), want)
    nxt, prv = (R + 1) % W, (R - 1) % W
    got = torch.zeros(4, 6)  # received through got.t(), 6 x 4 as the sender's
    if R % 2 == 0:
        dist.send(bs[R].t(), nxt)
        dist.recv(got.t(), prv)
    else:
        dist.recv(got.t(), prv)
        dist.send(bs[R].t(), nxt)
    same("send and recv of transposes", got, bs[prv])
    root = W - 1
    mine = torch.zeros(4, 6)
    dist.scatter(mine[:, ::2], scatter_list=[cols(b) for b in bs] if R == root else None,
                 src=root)
    same("scatter into a slice", mine, after(torch.zeros(4, 6), lambda b: b[:, ::2], cols(bs[R])))
    g = [torch.zeros(3, 4).t() for _ in range(W)] if R == root else None
    dist.gather(cols(bs[R]), gather_list=g, dst=root)
    if R == root:
        for r in range(W):
            same(f"gather of slices [{r}]", g[r], cols(bs[r]))
    q = [bs[R].clone().t(), bs[R][1:3, ::3].clone()]
    dist.all_reduce_coalesced(q)
    same("all_reduce_coalesced of a transpose", q[0], fold(dist.ReduceOp.SUM, bs).t())
    raises("an expanded output", lambda: dist.all_reduce(torch.ones(1).expand(4)),
           "elements that share memory", "strides [0]")


def all_to_all():
    # even: rank r sends block j (2 rows) = r*100 + j to rank j
    inp = torch.cat([torch.full((2, 3), float(R * 100 + j)) for j in range(W)])
    out = torch.empty(2 * W, 3)
    dist.all_to_all_single(out, inp)
    same("all_to_all_single even", out, torch.cat([torch.full((2, 3), float(j * 100 + R))
                                                   for j in range(W)]))
    # uneven: rank r sends r + j + 1 rows to rank j
    ins = [r_j + 1 for r_j in (R + j for j in range(W))]
    outs = [j + R + 1 for j in range(W)]
    inp = torch.cat([torch.full((ins[j], 2), float(R * 100 + j)) for j in range(W)])
    out = torch.empty(sum(outs), 2)
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins)
    same("all_to_all_single uneven", out, torch.cat([torch.full((outs[j], 2), float(j * 100 + R))
                                                     for j in range(W)]))
    # list form with tensors of different sizes
    inl = [torch.arange(R + j + 1, dtype=torch.int64) + 10 * R for j in range(W)]
    outl = [torch.empty(j + R + 1, dtype=torch.int64) for j in range(W)]
    dist.all_to_all(outl, inl)
    for j in range(W):
        same(f"all_to_all [{j}]", outl[j], torch.arange(j + R + 1, dtype=torch.int64) + 10 * j)


def point_to_point_and_async():
    global checks
    nxt, prv = (R + 1) % W, (R - 1) % W
    mine = torch.full((4,), float(R))
    got = torch.empty(4)
    if R % 2 == 0:
        dist.send(mine, nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(mine, nxt)
    same("send/recv ring", got, torch.full((4,), float(prv)))
    got = torch.empty(4)
    reqs = [dist.isend(mine * 2, nxt), dist.irecv(got, prv)]
    for q in reqs:
        q.wait()
    same("isend/irecv", got, torch.full((4,), float(prv) * 2))
    # any source: every other rank sends its rank to rank 0 twice (recv, then irecv)
    if R == 0:
        senders = []
        for k in range(2 * (W - 1)):
            t = torch.empty(3)
            if k % 2 == 0:
                s = dist.recv(t)
            else:
                wk = dist.irecv(t)
                wk.wait()
                s = wk._source_rank()
            same(f"recv from any source #{k} (rank {s})", t, torch.full((3,), float(s)))
            senders.append(s)
        global checks
        checks += 1
        assert sorted(senders) == sorted(list(range(1, W)) * 2), senders
    else:
        dist.send(torch.full((3,), float(R)), 0)
        dist.send(torch.full((3,), float(R)), 0)
    # async work: wait, is_completed, exception, futures chained as comm hooks do
    t = torch.ones(5)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    same("future then", fut.wait(), torch.full((5,), 2.0 * W))
    work.wait()
    checks += 1
    # (Work.exception() has no Python conversion in 1.13, on any backend)
    assert work.is_completed() and work.is_success()
    same("async allreduce", t, torch.full((5,), float(W)))
    # a future asked for only after the work ended (the backend makes it then, completed)
    t = torch.full((6,), 3.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    fut = work.get_future()
    checks += 1
    assert fut.done(), f"rank {R}: the future of a finished work is not done"
    same("future asked after wait", fut.wait()[0], torch.full((6,), 3.0 * W))
    dist.barrier()
    # 1.13's own dist.monitored_barrier refuses every backend but gloo; importing libddp_torch
    # puts one in its place that takes libddp groups too
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    objs = [None] * W
    dist.all_gather_object(objs, {"rank": R, "name": f"r{R}"})
    checks += 1
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(W)], objs
    lst = [f"from {R}", R] if R == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    checks += 1
    assert lst == ["from 0", 0], lst


def subgroups():
    sub = dist.new_group([0, 1])
    evens = dist.new_group(list(range(0, W, 2)))
    if R in (0, 1):
        t = torch.tensor([float(R + 1)])
        dist.all_reduce(t, group=sub)
        same("new_group [0, 1]", t, torch.tensor([3.0]))
    if R % 2 == 0:
        t = torch.tensor([R + 1], dtype=torch.int64)
        dist.all_reduce(t, group=evens)
        same("new_group evens", t, torch.tensor([sum(r + 1 for r in range(0, W, 2))]))
    dist.barrier()


def group_memory():
    """libddp_torch.empty: tensors in the group's communication memory (the shm segment, or
    ordinary memory on tcp) behave as any tensor in every collective; the memory outlives
    destroy_process_group while a tensor holds it. Returns such a tensor."""
    import libddp_torch
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        t = libddp_torch.empty(5, 7, dtype=dtype)
        same(f"empty {dtype} shape", torch.tensor(t.shape), torch.tensor([5, 7]))
        checks_dtype = t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
        same(f"empty {dtype} dtype, contiguous, 64-byte aligned", torch.tensor(checks_dtype),
             torch.tensor(True))
        xs = [data(r, dtype, 35, salt=7).view(5, 7) for r in range(W)]
        t.copy_(xs[R])
        dist.all_reduce(t)
        same(f"all_reduce on empty {dtype}", t, fold(dist.ReduceOp.SUM, xs))
        outs = [libddp_torch.empty(5, 7, dtype=dtype) for _ in range(W)]
        t.copy_(xs[R])
        dist.all_gather(outs, t)
        for r in range(W):
            same(f"all_gather into empty {dtype}, from rank {r}", outs[r], xs[r])
    b = libddp_torch.empty((3,), dtype=torch.int32)
    b.fill_(R + 10)
    dist.broadcast(b, src=W - 1)
    same("broadcast on empty", b, torch.full((3,), W - 1 + 10, dtype=torch.int32))
    sub = dist.new_group([0, 1], backend="libddp")
    if R in (0, 1):
        s = libddp_torch.empty(4, group=sub)
        s.fill_(R + 1)
        dist.all_reduce(s, group=sub)
        same("empty in a subgroup", s, torch.full((4,), 3.0))
    gloo = dist.new_group(backend="gloo")
    raises("empty on a gloo group", lambda: libddp_torch.empty(3, group=gloo),
           "not a libddp group")
    moving(gloo)
    kept = libddp_torch.empty(1000, dtype=torch.float64)
    kept.fill_(R)
    return kept


def moving(gloo):
    """libddp_torch.to_group_memory_: an ordinary tensor's storage moves into the group's
    memory (on shm; tcp's is ordinary memory and nothing moves) with its values, and its
    views follow; memory lent by numpy stays, with an error that says why."""
    import numpy
    import libddp_torch
    shm = dist.distributed_c10d._get_default_group().transport == "shm"
    xs = [data(r, torch.float64, 40, salt=11) for r in range(W)]
    t = xs[R].clone()
    view = t[5:9]
    got = libddp_torch.to_group_memory_(t)
    same("to_group_memory_ returns the tensor", torch.tensor(got is t), torch.tensor(True))
    same("to_group_memory_ keeps the values", t, xs[R])
    same("to_group_memory_: in the group's memory on shm only",
         torch.tensor([libddp_torch.in_group_memory(t), libddp_torch.in_group_memory(view)]),
         torch.tensor([shm, shm]))
    view.fill_(R + 0.5)  # the view writes into the moved storage
    dist.all_reduce(t)
    want = fold(dist.ReduceOp.SUM, [torch.cat([x[:5], torch.full((4,), r + 0.5, dtype=x.dtype),
                                               x[9:]]) for r, x in enumerate(xs)])
    same("all_reduce after to_group_memory_ (a view written)", t, want)
    same("the view of a moved tensor", view, want[5:9])
    libddp_torch.to_group_memory_(t)  # there already: nothing changes
    same("to_group_memory_ twice", t, want)
    same("a tensor not moved is not in the group's memory",
         torch.tensor(libddp_torch.in_group_memory(torch.ones(3))), torch.tensor(False))
    lent = torch.from_numpy(numpy.zeros(6, dtype=numpy.float32))
    if shm:
        raises("to_group_memory_ of numpy's memory", lambda: libddp_torch.to_group_memory_(lent),
               "to_group_memory_", "lent", "torch.from_numpy")
    raises("to_group_memory_ on a gloo group",
           lambda: libddp_torch.to_group_memory_(torch.ones(2), group=gloo), "not a libddp group")


def deferred_start():
    """libddp_torch.Options(defer_start=...): a synchronous call gives the same values either
    way, and work that nobody waits for, tests or asks a future of still runs: the tensor
    is polled, the work left alone, until the reduction lands."""
    global checks
    import libddp_torch
    eager = dist.new_group(backend="libddp", pg_options={"defer_start": False})
    n = (2 << 20) // 4  # above both transports' start-at-once limits
    for name, g in (("deferred", None), ("eager", eager)):
        t = torch.arange(n, dtype=torch.float32) + R
        dist.all_reduce(t, group=g)
        same(f"{name}: synchronous all_reduce", t,
             torch.arange(n, dtype=torch.float32) * W + sum(range(W)))
        t = torch.full((n,), float(R + 1))
        work = dist.all_reduce(t, async_op=True, group=g)
        want = float(sum(range(1, W + 1)))
        deadline = time.monotonic() + 30
        while t[n - 1].item() != want and time.monotonic() < deadline:
            time.sleep(0.001)
        checks += 1
        assert t[n - 1].item() == want, (
            f"rank {R}: {name}: an async all_reduce nobody waited for did not run in 30 s "
            f"(last element {t[n - 1].item()}, want {want})")
        work.wait()
        same(f"{name}: async all_reduce, never waited for until done", t,
             torch.full((n,), want))
    raises("defer_start not a bool", lambda: libddp_torch.Options(defer_start="yes"),
           "defer_start", "'yes'")
    checks += 1
    got = repr(libddp_torch.Options.of({"defer_start": False}))
    assert "defer_start=False" in got, got
    raises("bucket_memory unknown", lambda: libddp_torch.Options(bucket_memory="shared"),
           "bucket_memory", "'shared'", "group, ordinary")


def bad_input():
    raises("AVG on int64", lambda: dist.all_reduce(torch.ones(3, dtype=torch.int64),
                                                   op=dist.ReduceOp.AVG), "AVG", "Long")
    raises("BAND on float32", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
           "BAND", "Float")
    if torch.cuda.is_available():
        raises("CUDA tensor", lambda: dist.all_reduce(torch.ones(3, device="cuda")), "cuda:0",
               "nccl backend for CUDA tensors")
    # Without CUDA, a tensor that only claims cuda:0 takes the same road: c10d's ops are
    # dispatcher operators, and below the Python key a cuda:0 tensor reaches their CUDA
    # kernels, which call the group's collective with it.
    for name, call in [("all_reduce", lambda t: dist.all_reduce(t)),
                       ("broadcast", lambda t: dist.broadcast(t, src=0)),
                       ("all_gather", lambda t: dist.all_gather([torch.empty(3)] * W, t)),
                       ("send", lambda t: dist.send(t, dst=(R + 1) % W))]:
        raises(f"{name} of a cuda:0 tensor", lambda: call(ClaimsCuda((3,))),
               "the tensor is on cuda:0", "CPU tensors only", "nccl backend for CUDA tensors")
    sp = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3,))
    raises("all_gather of a sparse tensor", lambda: dist.all_gather(
        [torch.empty(3) for _ in range(W)], sp), "Sparse tensors are not supported here")
    raises("gather of a sparse tensor", lambda: dist.gather(
        sp, [torch.empty(3) for _ in range(W)] if R == 0 else None, dst=0),
        "Sparse tensors are not supported here")
    raises("all_gather size", lambda: dist.all_gather([torch.empty(2) for _ in range(W)],
                                                      torch.ones(3)), "Float[2]", "Float[3]")
    import libddp_torch
    raises("unknown option", lambda: libddp_torch.Options.of({"transprot": "tcp"}),
           "unknown backend option 'transprot'")
    raises("unknown transport", lambda: libddp_torch.Options(transport="ucx"), "ucx")


def main():
    global R, W
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, timeout=datetime.timedelta(seconds=60))
    R, W = dist.get_rank(), dist.get_world_size()
    want = os.environ.get("DDP_BACKEND")
    if BACKEND == "libddp" and want:
        got = dist.distributed_c10d._get_default_group().transport
        assert got == want, f"rank {R}: DDP_BACKEND={want} but the group runs on {got}"
    parts = os.environ.get("COLL_PARTS", "reductions,movement,all_to_all,p2p").split(",")
    if "reductions" in parts:
        reductions()
        sparse()
    if "movement" in parts:
        movement()
    if "all_to_all" in parts:
        all_to_all()
    if "p2p" in parts:
        point_to_point_and_async()
    if W >= 2:
        subgroups()
    kept = None
    if BACKEND == "libddp":
        kept = group_memory()
        views()
        deferred_start()
        leaf_outputs_and_profiler()
        bad_input()
        timeout_wording()
    if "p2p" in parts:
        monitored_failures()
    dist.destroy_process_group()
    if kept is not None:
        # The group's memory outlives the group while a tensor holds it.
        kept += 1
        same("empty after destroy_process_group", kept, torch.full((1000,), R + 1.0,
                                                                    dtype=torch.float64))
        del kept
    print(f"CHECKS {checks} rank {R}", flush=True)


if __name__ == "__main__":
    main()
