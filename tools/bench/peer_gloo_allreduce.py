#!/usr/bin/python3
"""PyTorch gloo's all_reduce on ddp-bench's sweep, for tools/bench/bench_peers.sh.

Same schedule, data and timing as ddp-bench (docs/benchmarks.md): f32 sum, in place; 0.5 s
of untimed 4-byte all-reduces to settle; then at each size, warm-up then timed iterations,
each refilled with (rank+1) * g, g = ((i + 5k) mod 13) + 1, preceded by a barrier, timed
from the call to its return and checked element by element against W(W+1)/2 * g. An
iteration's time is the slowest rank's.
Rank 0 prints a table and writes ddp-bench's CSV columns.

    /usr/bin/python3 tools/bench/peer_gloo_allreduce.py [--world 2] [-b 4] [-e 256M] [-f 2]
        [-n 200] [--min-iters 5] [--budget 256M] [--warmup 5] [--csv FILE] [--label gloo]

Without RANK in the environment it starts --world copies of itself on 127.0.0.1 (a free
port, GLOO_SOCKET_IFNAME=lo, one BLAS/OpenMP thread each) and waits for them. Needs Debian's
python3-torch (run it with /usr/bin/python3). Exit status: 0 when every element was right,
1 otherwise, 2 for a usage error.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
import peer_launch  # noqa: E402


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip()
    if s and s[-1].upper() in mult:
        v = int(s[:-1]) * mult[s[-1].upper()]
    else:
        v = int(s)
    if v <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return v


def args_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("-b", "--minbytes", type=parse_size, default=4)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=256 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-n", "--iters", type=int, default=200)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--budget", type=parse_size, default=256 << 20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timeout", type=int, default=600, help="seconds for the whole run")
    p.add_argument("--csv")
    p.add_argument("--label", default="gloo")
    return p


def iters_for(a, nbytes):
    return max(min(a.budget // nbytes, a.iters), min(a.min_iters, a.iters))


def warmup_for(a, nbytes):
    if a.warmup == 0:
        return 0
    return max(1, min(a.budget // (4 * nbytes), a.warmup))


def pct(sorted_v, p):
    n = len(sorted_v)
    k = min(n, max(1, int((p / 100.0) * n + 0.999999999)))
    return sorted_v[k - 1]


def rank_main(a):
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=peer_launch.init_method(),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    sizes = []
    s = a.minbytes
    while s <= a.maxbytes:
        if s // 4 > 0:
            sizes.append((s // 4) * 4)
        s *= a.stepfactor
    maxcount = sizes[-1] // 4
    # pattern[j] = (j mod 13) + 1; iteration k's g is the slice starting at (5k) mod 13.
    pattern = (torch.arange(maxcount + 13, dtype=torch.int64) % 13 + 1).to(torch.float32)
    expected = pattern * float(world * (world + 1) // 2)
    buf = torch.empty(maxcount, dtype=torch.float32)
    out = None
    if rank == 0:
        print("# %-10s %12s %6s %10s %10s %10s %9s %9s %7s" % (
            "impl", "size(B)", "iters", "p50(us)", "p99(us)", "max(us)", "algbw", "busbw",
            "#wrong"), flush=True)
        if a.csv:
            out = open(a.csv, "w")
            out.write("kind,backend,algorithm,place,op,dtype,world,bytes,count,warmup,iters,"
                      "min_us,p50_us,p99_us,max_us,algbw_gbs,busbw_gbs,wrong\n")
    # Settle as ddp-bench does: untimed 4-byte all-reduces for 0.5 s by rank 0's clock.
    settle_end = time.monotonic() + 0.5
    flag = torch.zeros(1, dtype=torch.int32)
    while True:
        flag[0] = 1 if rank == 0 and time.monotonic() < settle_end else 0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag[0]) == 0:
            break
    it = 0
    total_wrong = 0
    for nbytes in sizes:
        count = nbytes // 4
        x = buf[:count]
        nw, ni = warmup_for(a, nbytes), iters_for(a, nbytes)
        times = torch.zeros(ni, dtype=torch.float64)
        wrong = 0
        for k in range(nw + ni):
            off = (5 * it) % 13
            x.copy_(pattern[off:off + count]).mul_(float(rank + 1))
            dist.barrier()
            t0 = time.perf_counter_ns()
            dist.all_reduce(x)
            t1 = time.perf_counter_ns()
            if k >= nw:
                times[k - nw] = (t1 - t0) / 1e3
            wrong += int(torch.ne(x, expected[off:off + count]).sum())
            it += 1
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        w = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(w)
        wrong = int(w[0])
        total_wrong += wrong
        if rank == 0:
            t = sorted(times.tolist())
            p50, p99 = pct(t, 50), pct(t, 99)
            algbw = nbytes / (p50 * 1e3)
            busbw = algbw * 2.0 * (world - 1) / world
            print("  %-10s %12d %6d %10.2f %10.2f %10.2f %9.3f %9.3f %7d" % (
                a.label, nbytes, ni, p50, p99, t[-1], algbw, busbw, wrong), flush=True)
            if out:
                out.write("allreduce,%s,default,in,SUM,F32,%d,%d,%d,%d,%d,%.3f,%.3f,%.3f,%.3f,"
                          "%.6f,%.6f,%d\n" % (a.label, world, nbytes, count, nw, ni, t[0], p50,
                                              p99, t[-1], algbw, busbw, wrong))
    if out:
        out.close()
    dist.destroy_process_group()
    return 1 if total_wrong else 0


def main():
    a = args_parser().parse_args()
    if a.world < 1 or a.stepfactor < 2 or a.iters < 1 or a.min_iters < 1 or a.warmup < 0:
        print("peer_gloo_allreduce: bad --world, --stepfactor, --iters, --min-iters or --warmup",
              file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        return peer_launch.launch_ranks(a.world, a.timeout, {
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    return rank_main(a)


if __name__ == "__main__":
    sys.exit(main())
