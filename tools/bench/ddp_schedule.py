#!/usr/bin/python3
"""The fastest step DDP's schedule allows over a link, from a libddp reducer trace.

    tools/bench/ddp_schedule.py TRACE --rate BITS_PER_S --world W [--rank R] [--skip N]

TRACE is the Chrome trace of ddp-bench-ddp --trace (docs/ddp.md, "Timeline"): per rank,
forward, backward and finalize on tid 0 and each bucket's allreduce on tid 1, its
launch being the moment the bucket's last gradient became ready. The file has no
closing bracket and a trailing comma, as the format allows.

Why: DDP cannot send a gradient before backward has produced it, and the next forward
needs every averaged gradient, so a bound of 1 / max(compute, wire) (full overlap) is
out of reach whenever the wire takes longer than backward. This script models the step
DDP can reach with the bucket layout of the trace, on a link of the given rate with no
other cost:

  - backward takes B, the p50 of the rank's no_sync backward (compute only);
  - bucket i becomes ready at f_i * B, where f_i is its launch time as a fraction of the
    backward compute of a synchronised step (backward start to finalize start), so a
    backward slowed by the communication's CPU work does not move the buckets;
  - the buckets cross the link one after the other, in launch order, each taking
    bytes_i * 2(W-1)/W * 8 / rate (what ring and canonical send per rank): e = r_0 +
    w_0, then e = max(e, r_i) + w_i;
  - the step then ends tail = max(0, e - B) after backward: the communication no
    schedule of this layout can hide.

The tail is computed per synchronised step and its p50 printed; the bound on steps/s is
1000 / (no_sync step p50 + tail), the no_sync step being forward, backward, the loss and
the optimizer step. Prints one line "SCHEDULE key=value ...": steps (synchronised steps
used), buckets, nosync_backward_ms (B), first_ready_ms (r_0's p50), wire_ms (the whole
gradient), last_wire_ms (the last bucket), tail_ms. Exit status 1 for a trace it cannot
use (named in the message), 2 for bad arguments.
"""
import argparse
import json
import statistics
import sys


def load_events(path):
    """The trace's events; tolerates the missing ']' and the trailing comma."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text.endswith("]"):
        text = text[:-1].rstrip()
    text = text.rstrip(",")
    if not text.startswith("["):
        raise ValueError("does not start with '['")
    return json.loads(text + "]")


def steps_of(events, rank):
    """Rank's steps in time order: (forward, backward, finalize or None, [buckets])."""
    mine = sorted((e for e in events if e.get("pid") == rank), key=lambda e: e["ts"])
    forwards = [i for i, e in enumerate(mine) if e["name"] == "forward"]
    steps = []
    for k, i in enumerate(forwards):
        end = forwards[k + 1] if k + 1 < len(forwards) else len(mine)
        part = mine[i:end]
        bwd = [e for e in part if e["name"] == "backward"]
        fin = [e for e in part if e["name"] == "finalize"]
        buckets = [e for e in part if e["name"].startswith("allreduce bucket ")]
        if bwd:
            steps.append((mine[i], bwd[0], fin[0] if fin else None, buckets))
    return steps


def tail_of(step, nosync_bwd, wire_of):
    """The tail of one synchronised step (module docstring), and its first ready time."""
    _, bwd, fin, buckets = step
    compute = fin["ts"] - bwd["ts"]
    if compute <= 0:
        raise ValueError("a finalize starts before its backward")
    end = 0.0
    first = None
    for b in sorted(buckets, key=lambda e: e["ts"]):
        ready = min(max(b["ts"] - bwd["ts"], 0.0) / compute, 1.0) * nosync_bwd
        first = ready if first is None else first
        end = max(end, ready) + wire_of(b["args"]["bytes"])
    return max(0.0, end - nosync_bwd), first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--rate", type=float, required=True, help="link rate, bits per second")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--skip", type=int, default=2,
                    help="synchronised steps left out at the start (bucket rebuild, warm-up)")
    a = ap.parse_args()
    if a.rate <= 0 or a.world < 2 or a.rank < 0 or a.rank >= a.world or a.skip < 0:
        ap.error("--rate must be > 0, --world >= 2, 0 <= --rank < --world, --skip >= 0")
    try:
        events = load_events(a.trace)
    except (OSError, ValueError) as e:
        print(f"ddp_schedule.py: {a.trace}: not a readable trace: {e}", file=sys.stderr)
        return 1
    steps = steps_of(events, a.rank)
    nosync = [s[1]["dur"] for s in steps if s[2] is None]
    sync = [s for s in steps if s[2] is not None and s[3]][a.skip:]
    if sync:  # the layout in force at the end (a rebuild changes it after the first step)
        nb = len(sync[-1][3])
        sync = [s for s in sync if len(s[3]) == nb]
    if len(nosync) < 1 or len(sync) < 1:
        print(f"ddp_schedule.py: {a.trace}: rank {a.rank} has {len(nosync)} no_sync and "
              f"{len(sync)} usable synchronised steps; need at least one of each",
              file=sys.stderr)
        return 1
    scale = 2.0 * (a.world - 1) / a.world * 8.0 / a.rate * 1e6  # bytes -> microseconds

    def wire_of(nbytes):
        return nbytes * scale

    bwd = statistics.median(nosync)
    tails, firsts = zip(*(tail_of(s, bwd, wire_of) for s in sync))
    last = max(sync[-1][3], key=lambda e: e["ts"])
    total = sum(b["args"]["bytes"] for b in sync[-1][3])
    fields = {
        "steps": len(sync),
        "buckets": len(sync[-1][3]),
        "nosync_backward_ms": f"{bwd / 1e3:.3f}",
        "first_ready_ms": f"{statistics.median(firsts) / 1e3:.3f}",
        "wire_ms": f"{wire_of(total) / 1e3:.3f}",
        "last_wire_ms": f"{wire_of(last['args']['bytes']) / 1e3:.3f}",
        "tail_ms": f"{statistics.median(tails) / 1e3:.3f}",
    }
    print("SCHEDULE " + " ".join(f"{k}={v}" for k, v in fields.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
