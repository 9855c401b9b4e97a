#!/usr/bin/env python3
"""All-reduce latency (4 KiB) and bus bandwidth (1, 25, 100 MiB) of trainerd's ring beside
PyTorch gloo (../shared/bench/gloo_allreduce.py), world sizes 2 and 4, alternating runs in one
session; prints the medians and ratios.

Usage: bench/allreduce.sh [--runs N] [--worlds 2,4]
busbw = bytes / seconds * 2(n-1)/n for both. World 4 oversubscribes this 2-core machine.
"""
import argparse, os, re, statistics, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
LINE = re.compile(r"^(\w+) world=(\d+) bytes=(\d+) mean_ms=([\d.]+) median_ms=([\d.]+) busbw_GBps=([\d.]+)")

def parse(out):
    rows = {}
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m:
            rows[int(m.group(3))] = (float(m.group(4)), float(m.group(6)))
    return rows

def gloo(world, port):
    return parse(subprocess.run([sys.executable, os.path.join(SHARED, "bench", "gloo_allreduce.py"), str(world),
                                 str(port), "1"], check=True, capture_output=True, text=True).stdout)

def ours(world):
    return parse(subprocess.run(["cargo", "bench", "-q", "-p", "trainerd", "--bench", "allreduce", "--", str(world)],
                                cwd=ROOT, check=True, capture_output=True, text=True).stdout)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--worlds", default="2,4")
    a = ap.parse_args()
    for world in [int(w) for w in a.worlds.split(",")]:
        runs_ours, runs_gloo = [], []
        for r in range(a.runs):
            runs_gloo.append(gloo(world, 29511 + r))
            runs_ours.append(ours(world))
        print(f"\nall-reduce, world {world}, median of {a.runs} runs (1 thread per rank, loopback)")
        print(f"{'size':>9} | {'trainerd':>22} | {'gloo':>22} | ratio")
        for size in sorted(runs_ours[0]):
            med = lambda runs, i: statistics.median(run[size][i] for run in runs)
            if size <= 4096:
                o, g = med(runs_ours, 0), med(runs_gloo, 0)
                print(f"{size:>9} | {o:>16.3f} ms mean | {g:>16.3f} ms mean | {g / o:.2f}x faster")
            else:
                o, g = med(runs_ours, 1), med(runs_gloo, 1)
                print(f"{size:>9} | {o:>14.3f} GB/s busbw | {g:>14.3f} GB/s busbw | {o / g:.2f}x")

if __name__ == "__main__":
    main()
