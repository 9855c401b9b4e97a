#!/usr/bin/env python3
"""Mixed precision on the CPU: single-worker throughput of the tutorials' CNN (mnist-cnn) in fp32
and under bf16 autocast, trainerd (`--precision fp32|bf16`) beside PyTorch eager (the same loop
with and without `torch.autocast("cpu", dtype=torch.bfloat16)`), same model, Adam 1e-3, batch,
threads and data, alternating runs in one session; prints the medians, each bf16/fp32 gain, and
trainerd/PyTorch per precision. Accuracy is printed too (same steps, the test split).

Usage: bench/precision.sh  (builds first)   or   python bench/precision.py [--runs N] [--steps N]
"""
import argparse, gzip, json, os, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")


def eager(precision, batch, threads, steps):
    """PyTorch eager: the loop trainerd runs (bytes to floats per batch, forward and loss under
    autocast when bf16, backward, Adam, the step's loss and correct count read)."""
    import numpy as np
    import torch
    import torch.nn as nn
    torch.set_num_threads(threads)

    def load(prefix):
        with gzip.open(os.path.join(DATA, f"{prefix}-images-idx3-ubyte.gz")) as f:
            x = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
        with gzip.open(os.path.join(DATA, f"{prefix}-labels-idx1-ubyte.gz")) as f:
            y = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
        return torch.from_numpy(x.copy()).view(-1, 1, 28, 28), torch.from_numpy(y.copy()).long()

    x, y = load("train")
    tx, ty = load("t10k")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                      nn.Linear(32 * 13 * 13, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    perm = torch.randperm(y.shape[0], generator=torch.Generator().manual_seed(1))
    bf16 = precision == "bf16"

    def step(i):
        idx = perm[(i * batch) % (y.shape[0] - batch):][:batch]
        xs, ys = x[idx].float() / 255, y[idx]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = m(xs)
            loss = nn.functional.cross_entropy(logits, ys)
        loss.backward()
        opt.step()
        loss.item(), (logits.argmax(-1) == ys).sum().item()

    for i in range(20):
        step(i)
    began = time.perf_counter()
    for i in range(steps):
        step(20 + i)
    rate = steps * batch / (time.perf_counter() - began)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        correct = sum((m(tx[i:i + 1000].float() / 255).argmax(-1) == ty[i:i + 1000]).sum().item()
                      for i in range(0, ty.shape[0], 1000))
    return rate, correct / ty.shape[0]


def trainerd(precision, batch, threads, steps):
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        subprocess.run([os.path.join(ROOT, "target/release/trainerd"), "run",
                        "--plugin", os.path.join(ROOT, "target/release/libmnist_cnn.so"), "--data", DATA,
                        "--epochs", "1", "--batch-size", str(batch), "--threads", str(threads),
                        "--steps-per-epoch", str(steps), "--precision", precision, "--summary", summary],
                       check=True, capture_output=True, text=True)
        s = json.load(open(summary))
        return s["examples_per_second"], s["test_accuracy"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    rates = {(who, p): [] for who in ("trainerd", "eager") for p in ("fp32", "bf16")}
    accuracy = {}
    for r in range(a.runs):
        for p in ("fp32", "bf16"):
            rate, acc = eager(p, a.batch, a.threads, a.steps)
            rates[("eager", p)].append(rate)
            accuracy[("eager", p)] = acc
            rate, acc = trainerd(p, a.batch, a.threads, a.steps + 20)
            rates[("trainerd", p)].append(rate)
            accuracy[("trainerd", p)] = acc
        print(f"run {r + 1}: " + ", ".join(f"{w} {p} {v[-1]:,.0f}" for (w, p), v in rates.items()) + " examples/s",
              flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"mnist-cnn on the CPU, batch {a.batch}, {a.threads} threads, median of {a.runs} (examples/s; test accuracy "
          f"after {a.steps} steps):")
    for who, name in (("trainerd", "trainerd"), ("eager", "PyTorch eager")):
        print(f"  {name:14} fp32 {med[(who, 'fp32')]:8,.0f} (acc {accuracy[(who, 'fp32')]:.4f})   "
              f"bf16 {med[(who, 'bf16')]:8,.0f} (acc {accuracy[(who, 'bf16')]:.4f})   "
              f"bf16/fp32 {med[(who, 'bf16')] / med[(who, 'fp32')]:.2f}x")
    for p in ("fp32", "bf16"):
        print(f"  trainerd/PyTorch eager, {p}: {med[('trainerd', p)] / med[('eager', p)]:.2f}x")


if __name__ == "__main__":
    main()
