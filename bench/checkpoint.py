#!/usr/bin/env python3
"""Checkpoint benchmarks, in one session:
1. commit throughput of a SIZE MiB checkpoint to local disk (fsync'd, hashed, committed) beside
   an fsync'd sequential write of the same size (dd conv=fsync) and torch.save + fsync + rename
   (../shared/bench/torch_save.py);
2. training step time of mnist-cnn with a commit every K steps (in flight in the background)
   beside the same run without checkpoints.

Usage: bench/checkpoint.sh [--size MiB] [--runs N] [--every K]
"""
import argparse, json, os, re, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("TRAINERD_SHARED", os.path.join(os.path.dirname(ROOT), "shared"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")

def mbps(out, key="MBps"):
    return [float(x) for x in re.findall(rf"{key}=([\d.]+)", out)]

def dd(size, d):
    f = os.path.join(d, "dd.bin")
    os.sync()
    out = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={size}", "conv=fsync"],
                         check=True, capture_output=True, text=True).stderr
    os.remove(f)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m.group(1)) / float(m.group(2)) / 1e6

def train(steps, every):
    with tempfile.TemporaryDirectory() as d:
        args = [os.path.join(ROOT, "target/release/trainerd"), "run", "--plugin",
                os.path.join(ROOT, "target/release/libmnist_cnn.so"), "--data", DATA, "--epochs", "1",
                "--steps-per-epoch", str(steps), "--threads", "2", "--summary", os.path.join(d, "s.json")]
        if every:
            args += ["--checkpoint-dir", os.path.join(d, "ckpt"), "--checkpoint-every", str(every)]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        commits = out.count(" committed to ")
        return json.load(open(os.path.join(d, "s.json")))["examples_per_second"], commits

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        ours, peer_dd, peer_torch = [], [], []
        for r in range(a.runs):
            peer_dd.append(dd(a.size, d))
            peer_torch += mbps(subprocess.run([sys.executable, os.path.join(SHARED, "bench", "torch_save.py"), str(a.size),
                                               "1", os.path.join(d, "torch")], check=True, capture_output=True,
                                              text=True).stdout)
            ours += mbps(subprocess.run(["cargo", "bench", "-q", "-p", "trainerd-storage", "--bench", "commit", "--",
                                         str(a.size), "1", os.path.join(d, "ours")], cwd=ROOT, check=True,
                                        capture_output=True, text=True).stdout)
        o, dd_, ts = statistics.median(ours), statistics.median(peer_dd), statistics.median(peer_torch)
        print(f"commit {a.size} MiB to local disk, median of {a.runs}: trainerd {o:,.0f} MB/s, dd conv=fsync "
              f"{dd_:,.0f} MB/s ({o / dd_:.2f}x), torch.save+fsync {ts:,.0f} MB/s ({o / ts:.2f}x)")
    plain, with_ckpt, commits = [], [], 0
    for r in range(a.runs):
        plain.append(train(a.steps, 0)[0])
        eps, commits = train(a.steps, a.every)
        with_ckpt.append(eps)
    p, c = statistics.median(plain), statistics.median(with_ckpt)
    print(f"mnist-cnn step time, {a.steps} steps, median of {a.runs}: {1e3 * 64 / p:.2f} ms without checkpoints, "
          f"{1e3 * 64 / c:.2f} ms with a commit every {a.every} steps ({commits} commits in flight in the background): "
          f"{p / c:.3f}x")

if __name__ == "__main__":
    main()
