#!/usr/bin/env python3
"""Input pipeline and training from Parquet, in one session, alternating runs, medians:

1. Examples/s delivered to the step, the model excluded, on Fashion-MNIST as Parquet in Hugging
   Face's layout (PNG bytes; made once by `trainerd data convert`): trainerd's pipeline
   (`trainerd data read`: the plugin's declared columns, through the plugin boundary, the
   batches the step receives) beside PyTorch's DataLoader with pyarrow and PIL
   (bench/data_loader.py), at 1 and 2 loader threads, 2 epochs, batch 64. Neither holds the
   dataset: trainerd shuffles in windows of 10,000 rows, the DataLoader through a buffer of 10,000.
2. mnist-cnn's training examples/s from that Parquet copy beside the in-memory path (the idx
   files), 1 epoch, on 2 workers of 1 thread (every core trains) and on 1 worker of 1 thread (a
   core to spare, as on a GPU node), with the default loader threads; and the time a step waited
   for its batch.

Usage: bench/data.sh [--runs N]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target/release")
IDX = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")
CACHE = os.environ.get("TRAINERD_CACHE", os.path.expanduser("~/.cache/trainerd"))
PARQUET = os.path.join(CACHE, "bench-fashion-mnist-parquet")


def parquet_copy():
    """Fashion-MNIST as Parquet, whole once renamed into place."""
    if not os.path.isdir(PARQUET):
        partial = PARQUET + ".partial"
        subprocess.run(["rm", "-rf", partial], check=True)
        subprocess.run([os.path.join(BIN, "trainerd"), "data", "convert", IDX, partial], check=True, capture_output=True)
        os.rename(partial, PARQUET)
    return PARQUET


def trainerd_read(threads):
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "read.json")
        subprocess.run([os.path.join(BIN, "trainerd"), "data", "read", "--plugin", os.path.join(BIN, "libmnist_cnn.so"),
                        "--data", PARQUET, "--epochs", "2", "--batch-size", "64", "--shuffle-window", "10000",
                        "--loader-threads", str(threads), "--summary", summary], check=True, capture_output=True)
        return json.load(open(summary))["examples_per_second"]


def dataloader(threads):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench/data_loader.py"), PARQUET, str(threads), "2"],
                         check=True, capture_output=True, text=True).stdout
    return float(re.search(r"examples_per_s=(\d+)", out).group(1))


def train(data, workers):
    """examples/s and the microseconds a step waited for its next batch, from worker 0."""
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        head = ["local", "--workers", str(workers)] if workers > 1 else ["run"]
        out = subprocess.run([os.path.join(BIN, "trainerd"), *head, "--plugin", os.path.join(BIN, "libmnist_cnn.so"),
                              "--data", data, "--epochs", "1", "--threads", "1", "--seed", "3", "--summary", summary],
                             check=True, capture_output=True, text=True, env={**os.environ, "TRAINERD_LOG": "trainerd=debug"})
        wait = re.search(r"(\d+) us next batch", out.stdout + out.stderr)
        s = json.load(open(summary if workers == 1 else os.path.join(d, "s.worker0.json")))
        return s["examples_per_second"], int(wait.group(1)) if wait else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    parquet_copy()
    pipe = {(who, t): [] for who in ("trainerd", "dataloader") for t in (1, 2)}
    for r in range(a.runs):
        for t in (1, 2):
            pipe[("dataloader", t)].append(dataloader(t))
            pipe[("trainerd", t)].append(trainerd_read(t))
        print(f"run {r + 1}: " + ", ".join(f"{w} {t}: {v[-1]:,.0f}" for (w, t), v in pipe.items()) + " examples/s",
              flush=True)
    for t in (1, 2):
        ours, peer = statistics.median(pipe[("trainerd", t)]), statistics.median(pipe[("dataloader", t)])
        print(f"input pipeline, {t} loader thread(s), median of {a.runs}: trainerd {ours:,.0f} examples/s, "
              f"PyTorch DataLoader (pyarrow + PIL) {peer:,.0f} ({ours / peer:.1f}x)")
    for workers in (2, 1):
        runs = {"idx": [], "parquet": []}
        waits = {"idx": [], "parquet": []}
        for r in range(a.runs):
            for name, data in (("idx", IDX), ("parquet", PARQUET)):
                rate, wait = train(data, workers)
                runs[name].append(rate)
                waits[name].append(wait)
        med = {k: statistics.median(v) for k, v in runs.items()}
        wait = {k: statistics.median(w for w in v if w is not None) for k, v in waits.items()}
        print(f"mnist-cnn training, {workers} worker(s) of 1 thread, median of {a.runs}: from Parquet "
              f"{med['parquet']:,.0f} examples/s, in memory (idx) {med['idx']:,.0f} "
              f"({med['parquet'] / med['idx']:.2f}x); a step waited {wait['parquet']} us for its batch from Parquet, "
              f"{wait['idx']} us in memory")


if __name__ == "__main__":
    main()
