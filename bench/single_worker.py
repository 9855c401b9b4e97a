#!/usr/bin/env python3
"""Single-worker training throughput of the tutorials' CNN: trainerd (mnist-cnn plugin) beside
PyTorch eager (../shared/bench/torch_cnn.py), same model, optimizer (Adam 1e-3), batch and thread
count, alternating runs in one session; prints the medians and the ratio.

Usage: bench/single_worker.sh  (builds first)   or   python bench/single_worker.py [--runs N]
trainerd's figure covers every step of its run, warm-up included; PyTorch's excludes 20 warm-up
steps, so the comparison leans slightly toward PyTorch.
"""
import argparse, json, os, re, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")

def torch_eager(batch, threads, steps):
    out = subprocess.run([sys.executable, os.path.join(SHARED, "bench", "torch_cnn.py"), "single",
                          str(batch), str(threads), str(steps)], check=True, capture_output=True, text=True,
                         env={**os.environ, "DATA": DATA}).stdout
    return float(re.search(r"examples_per_s=(\d+)", out).group(1))

def trainerd(batch, threads, steps):
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        subprocess.run([os.path.join(ROOT, "target/release/trainerd"), "run",
                        "--plugin", os.path.join(ROOT, "target/release/libmnist_cnn.so"), "--data", DATA,
                        "--epochs", "1", "--batch-size", str(batch), "--threads", str(threads),
                        "--steps-per-epoch", str(steps), "--summary", summary],
                       check=True, capture_output=True, text=True)
        return json.load(open(summary))["examples_per_second"]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    ours, theirs = [], []
    for r in range(a.runs):
        theirs.append(torch_eager(a.batch, a.threads, a.steps))
        ours.append(trainerd(a.batch, a.threads, a.steps + 20))
        print(f"run {r + 1}: trainerd {ours[-1]:,.0f}  pytorch-eager {theirs[-1]:,.0f} examples/s", flush=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"single-worker mnist-cnn, batch {a.batch}, {a.threads} threads, median of {a.runs}: "
          f"trainerd {o:,.0f} examples/s, PyTorch eager {t:,.0f} examples/s, ratio {o / t:.2f}x")

if __name__ == "__main__":
    main()
