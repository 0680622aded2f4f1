#!/usr/bin/python3
"""The torch.distributed backend "libddp" against gloo, and against libddp's own ddp-bench
(docs/benchmarks.md, "The torch backend"; docs/torch.md).

    tools/bench/bench_torch.py [--build build] [--rounds 3] [--max-bytes 256M] [--steps 10]
                               [--ddp-rounds 15] [--part dispatch,allreduce,ddp]

Part 1, all_reduce: one ddprun job of 2 ranks (1 thread each) holds a libddp group (shm, the
default on one host) and a gloo group side by side. For every size from 4 B up (x4) it times,
interleaved in six chunks (the series' order rotating from chunk to chunk) so that each
series sees the same moments of the machine:
torch.distributed.all_reduce on the libddp group, on an ordinary tensor and on one from
libddp_torch.empty (in the group's segment); libddp's own blocking ddp_allreduce on the same
group and the same two tensors (the call ddp-bench times, made from C++ with no Python in the
loop: libddp_torch._C._bench_allreduce); the group's ProcessGroup::allreduce and Work::wait
called from that same C++ loop ("c10d": the plugin's whole path, as DDP's reducer calls it,
without PyTorch's Python wrapper and bindings); and gloo. After each job, ddp-bench (2 shm ranks,
blocking calls, in place) times the same sizes in its own processes, on private memory and
on the segment, for reference. The table gives the median over rounds of each p50,
torch/gloo (goal: never above 1), each torch series over the native call on the same
memory in the same job (goal: at most 1.2 from 64 KiB up), and c10d over native (the same
goal, for what the plugin itself adds).

Part 2, DDP steps: the benchmark MLP of ddp-bench-ddp (784-1024-1024-1024-10, batch 64,
SGD), real PyTorch DistributedDataParallel on 2 ranks with 1 thread each, over gloo, libddp
shm (its default: DDP's buckets in the group's segment), libddp shm with
Options(bucket_memory="ordinary") (the buckets in ordinary memory, reduced through the
staging area, as any ordinary tensor), libddp tcp, and with a hook that communicates nothing
(the ceiling of any backend), one model each, built once; every round runs --steps steps of
each in turn, so a round's figures are measured side by side. Verdict: the median over rounds of each round's
ratio to gloo (goals: shm at least 1.3x gloo, tcp at least 1.1x). Prints the lines and exits
0; goals that fail are marked FAIL (a benchmark, not a test: the exit status only says
whether it ran).
"""
import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time

PY = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1]] if s[-1] in mult else int(s)


def sizes_up_to(top):
    out, b = [], 4
    while b <= top:
        out.append(b)
        b *= 4
    return out


def human(b):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k:
            return f"{b // k} {unit}"
    return f"{b} B"


# ---------------------------------------------------------------- the ranks' side ------

def worker(args):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import libddp_torch
    torch.set_num_threads(1)
    dist.init_process_group("libddp")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    groups = {"libddp": None, "gloo": gloo}
    if args.part == "allreduce":
        pg = dist.distributed_c10d._get_default_group()
        for size in sizes_up_to(args.max_bytes):
            n = max(1, size // 4)
            # at least 24 calls a series (6 chunks of 4) even at 256 MiB: the p50 of five
            # calls let one slow call in a chunk move a large size's figure by 1.5x
            iters = max(24, min(2000, (64 << 20) // size))
            plain, seg = torch.ones(n), libddp_torch.empty(n).fill_(1)
            # Six series, interleaved in chunks so that each sees the same moments of the
            # machine: torch.distributed.all_reduce on the libddp group (an ordinary tensor,
            # then one in the group's segment), libddp's own blocking ddp_allreduce on the
            # same group and the same two tensors (the call ddp-bench times) and the group's
            # c10d allreduce, both timed in a C++ loop (None), and gloo. The order rotates
            # from chunk to chunk, so that every series takes every place once: the first
            # calls after the barrier run slower on this VM (1 MiB: the first ten of a chunk
            # 1.2-1.7x its last ten), which a fixed order made one series pay more than the
            # others.
            series = {
                "libddp": lambda: dist.all_reduce(plain),
                "native": None,
                "c10d": None,
                "libddp-seg": lambda: dist.all_reduce(seg),
                "native-seg": None,
                "gloo": lambda: dist.all_reduce(plain, group=gloo),
            }
            times = {name: [] for name in series}
            bench = libddp_torch._C._bench_allreduce
            for name, call in series.items():  # warm-up
                for _ in range(3):
                    call() if call else bench(pg, seg if name == "native-seg" else plain, 1,
                                              name == "c10d")
            order = list(series)
            chunks = len(order)
            for c in range(chunks):
                for name in order[c:] + order[:c]:
                    call = series[name]
                    dist.barrier(group=gloo)
                    k = iters // chunks
                    if call is None:
                        times[name] += bench(pg, seg if name == "native-seg" else plain, k,
                                             name == "c10d")
                        continue
                    for _ in range(k):
                        t0 = time.perf_counter()
                        call()
                        times[name].append((time.perf_counter() - t0) * 1e6)
            if rank == 0:
                for name, v in times.items():
                    print(f"AR {name} {size} {statistics.median(v):.3f}", flush=True)
            del plain, seg
    else:
        tcp = dist.new_group(backend="libddp", pg_options=libddp_torch.Options(transport="tcp"))
        from torch.nn.parallel import DistributedDataParallel as DDP
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.rand(64, 784, generator=g) * 2 - 1
        y = torch.randint(0, 10, (64,), generator=g)
        # One DDP model per series, built once; rounds of args.steps steps run the series in
        # turn, so that each round pairs them over the same few seconds of the machine.
        # Every series but "no-comm" runs DDP's default reduction; "libddp-shm" has its
        # buckets in the group's segment, "libddp-shm-ordinary" in ordinary memory.
        # "no-comm" is the ceiling: DDP on the libddp group with a hook that returns the
        # bucket as it is (no communication at all, DDP's own bucket copies kept).
        def no_comm(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        models = {}
        ordinary = dist.new_group(backend="libddp",
                                  pg_options=libddp_torch.Options(bucket_memory="ordinary"))
        for name, pg in (("gloo", gloo), ("libddp-shm", None), ("libddp-shm-ordinary", ordinary),
                         ("libddp-tcp", tcp), ("no-comm", None)):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                      torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                      torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                      torch.nn.Linear(1024, 10))
            model = DDP(net, process_group=pg)
            if name == "no-comm":
                model.register_comm_hook(None, no_comm)
            models[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01), pg)

        def step(model, opt):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        for model, opt, _ in models.values():
            for _ in range(5):
                step(model, opt)
        for r in range(args.rounds):
            for name, (model, opt, pg) in models.items():
                dist.barrier(group=pg)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(model, opt)
                dist.barrier(group=pg)
                el = time.perf_counter() - t0
                if rank == 0:
                    print(f"DDP {name} {r} {args.steps / el:.3f}", flush=True)
    dist.destroy_process_group()


def dispatch(iters=20000):
    """Per-call cost of a process group's dispatch, one rank, no communication: libddp's
    C++ group against a Python ProcessGroup subclass whose allreduce returns a completed
    work at once (PyTorch's test_c10d_pypg pattern), both called through the C++ virtual
    (ProcessGroup.allreduce(pg, [t]).wait()), the way DDP's reducer calls a group."""
    import torch
    import torch.distributed as dist
    import libddp_torch  # noqa: F401

    class DoneWork(dist._Work):
        def __init__(self, result):
            super().__init__()
            self.fut = torch.futures.Future()
            self.fut.set_result(result)

        def wait(self, timeout=None):
            return True

        def get_future(self):
            return self.fut

    class PythonGroup(dist.ProcessGroup):
        def __init__(self):
            super().__init__(0, 1)
            self.works = []

        def allreduce(self, tensors, opts):
            w = DoneWork(tensors)
            self.works.append(w)  # 1.13: C++ must not outlive a Python work (spec)
            if len(self.works) > 64:
                del self.works[:32]
            return w

        def getBackendName(self):
            return "python"
    torch.set_num_threads(1)
    store = dist.HashStore()
    lib = libddp_torch._C.create(dist.PrefixStore("b", store), 0, 1, 60000, "shm", "bench",
                                 "auto", False)
    groups = {"libddp (C++)": lib, "Python group (no work)": PythonGroup()}
    t = torch.ones(1)
    out = {}
    for _ in range(3):
        for name, pg in groups.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.ProcessGroup.allreduce(pg, [t]).wait()
            out.setdefault(name, []).append((time.perf_counter() - t0) / iters * 1e6)
    print("dispatch, one rank, ProcessGroup.allreduce(pg, [4 B]).wait(), best of 3 (us per "
          "call):")
    for name, v in out.items():
        print(f"  {name:24} {min(v):7.2f}")


# ---------------------------------------------------------------- the driver ----------

def run_job(args, part):
    env = dict(os.environ, PYTHONPATH=os.path.join(args.build, "src", "torch"),
               OMP_NUM_THREADS="1")
    env.pop("DDP_BACKEND", None)
    cmd = [os.path.join(args.build, "tools", "ddprun"), "--standalone", "--nproc_per_node", "2", PY,
           os.path.abspath(__file__), "--worker", part, "--max-bytes", str(args.max_bytes),
           "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--ddp-rounds", str(args.ddp_rounds)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_torch: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return [line.split(": ", 1)[-1].split() for line in p.stdout.splitlines()]


def native(args, tmp, memory):
    path = os.path.join(tmp, f"native-{memory}.csv")
    cmd = [os.path.join(args.build, "tools", "ddp-bench"), "-w", "2", "--backends", "shm",
           "--algos", "auto", "-b", "4", "-e", str(args.max_bytes), "-f", "4", "--no-calib",
           "--memory", memory, "--csv", path]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_torch: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    with open(path) as f:
        return {int(r["bytes"]): float(r["p50_us"]) for r in csv.DictReader(f)
                if r["kind"] == "allreduce"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--steps", type=int, default=10, help="DDP steps per series and round")
    ap.add_argument("--ddp-rounds", type=int, default=15, help="DDP rounds")
    ap.add_argument("--worker", choices=["allreduce", "ddp"])
    ap.add_argument("--part", default="dispatch,allreduce,ddp",
                    help="comma-separated: dispatch, allreduce, ddp")
    args = ap.parse_args()
    args.max_bytes = parse_size(str(args.max_bytes))
    if args.worker:
        args.part = args.worker
        return worker(args)
    parts = args.part.split(",")
    if "dispatch" in parts:
        sys.path.insert(0, os.path.join(args.build, "src", "torch"))
        dispatch()
    if "allreduce" in parts:
        names = ("libddp", "libddp-seg", "native", "native-seg", "gloo", "c10d")
        job = {name: {} for name in names}
        bench = {"private": {}, "group": {}}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for kind, name, size, us in run_job(args, "allreduce"):
                    if kind == "AR":
                        job[name].setdefault(int(size), []).append(float(us))
                for memory, into in bench.items():
                    for size, us in native(args, tmp, memory).items():
                        into.setdefault(size, []).append(us)
                print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        print("all_reduce p50 (us), 2 ranks, median over rounds. torch: "
              "torch.distributed.all_reduce on the libddp group, on an ordinary tensor and on "
              "one from libddp_torch.empty (the group's segment, 'seg'); native: libddp's own "
              "blocking ddp_allreduce on the same group and tensors, interleaved with them in "
              "the same job; ddp-bench: the same sizes in a separate ddp-bench run (private "
              "memory, segment); c10d: the group's ProcessGroup::allreduce and Work::wait from "
              "C++ (the plugin without PyTorch's Python layer) on the ordinary tensor. Goals: "
              "torch/gloo <= 1 everywhere, torch/native <= 1.2 from 64 KiB, the same for "
              "c10d/native")
        print(f"{'size':>9} {'torch':>9} {'torch-seg':>9} {'gloo':>9} {'native':>9} "
              f"{'nat-seg':>9} {'c10d':>9} {'bench':>9} {'bench-seg':>9} {'torch/gloo':>10} "
              f"{'torch/native':>13} {'seg/nat-seg':>12} {'c10d/native':>12}")
        med = statistics.median
        nan = float("nan")

        def m(series, size):
            return med(series[size]) if size in series else nan
        for size in sorted(job["libddp"]):
            L, LS, N, NS, G, C = (m(job[k], size) for k in names)
            P, S = m(bench["private"], size), m(bench["group"], size)
            g_ok = "ok" if max(L, LS) <= G else "FAIL"

            def verdict(x, native):
                return "" if size < (64 << 10) else ("ok" if x <= 1.2 * native else "FAIL")
            print(f"{human(size):>9} {L:9.1f} {LS:9.1f} {G:9.1f} {N:9.1f} {NS:9.1f} {C:9.1f} "
                  f"{P:9.1f} {S:9.1f} {L / G:5.2f} {g_ok:<4} {L / N:7.2f} {verdict(L, N):<5} "
                  f"{LS / NS:6.2f} {verdict(LS, NS):<5} {C / N:6.2f} {verdict(C, N):<5}")
    if "ddp" in parts:
        rates = {}
        ddp_args = argparse.Namespace(**vars(args))
        ddp_args.rounds = args.ddp_rounds
        for kind, name, _, sps in run_job(ddp_args, "ddp"):
            if kind == "DDP":
                rates.setdefault(name, []).append(float(sps))
        med = statistics.median
        print(f"DDP steps/s, MLP 784-1024x3-10, 2 ranks x 1 thread, {args.ddp_rounds} rounds of "
              f"{args.steps} steps, the series in turn within each round:")
        for name in ("gloo", "libddp-shm", "libddp-shm-ordinary", "libddp-tcp", "no-comm"):
            print(f"  {name:19} median {med(rates[name]):7.2f}  (rounds: "
                  f"{', '.join(f'{v:.2f}' for v in rates[name])})")
        print("  against gloo: the median of the rounds' ratios (each round's pair measured "
              "side by side), the ratio of the medians, and the rounds' ratios sorted")
        for name, goal in (("libddp-shm", 1.3), ("libddp-shm-ordinary", None),
                           ("libddp-tcp", 1.1), ("no-comm", None)):
            ratios = sorted(a / b for a, b in zip(rates[name], rates["gloo"]))
            verdict = med(ratios)
            mark = ("(the most any backend could reach)" if name == "no-comm" else
                    "(the buckets staged)" if goal is None else
                    f"(goal {goal}) {'ok' if verdict >= goal else 'FAIL'}")
            print(f"  {name:19} / gloo {verdict:.3f} {mark}; of medians "
                  f"{med(rates[name]) / med(rates['gloo']):.3f}; rounds "
                  f"{' '.join(f'{v:.2f}' for v in ratios)}")


if __name__ == "__main__":
    main()
