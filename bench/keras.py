#!/usr/bin/env python3
"""A Keras model under trainerd beside Keras's own training, in one session: the multi-worker
Keras tutorial's CNN (plugins/python-model/examples/keras_multi_worker.py, compiled with SGD at
0.001, Keras 3 on its torch backend) on Fashion-MNIST.

  - The losses, 1 process: the first 20 losses of one trainerd worker beside Keras's train step
    (model.train_on_batch, the step fit runs) from the same initial weights (both seed Keras with
    the run's seed before the build), on the same batches (trainerd's order, from --log-examples of
    a run on `trainerd data convert`'s Parquet, whose rows are the MNIST-format files' in order)
    with the same optimizer; goal: within 1e-5 relative.
  - Speed, 1 process: `trainerd run` beside Keras's `model.fit(x, y, batch_size, shuffle=False)`
    over arrays in memory; goal: trainerd at least 1.5x fit's examples/s.
  - Speed, 2 workers: `trainerd local --workers 2` beside the same Keras model wrapped in PyTorch's
    DistributedDataParallel (gloo, 2 processes on 127.0.0.1), Keras's loss and optimizer applied as
    Keras's torch train step applies them; goal: at least 1.0x.

Both sides: the same threads per process (stated), the same batch per worker, the same steps.
trainerd's rate is its metrics log's (the clock of its step records, the first --warmup steps left
out); the peers leave out the same first steps. Runs alternate (trainerd, peer, ...) and the
medians are printed.

Usage: bench/keras.sh [--runs N] [--steps N] [--batch B] [--threads-single T] [--threads T]
Environment: DATA (MNIST-format, default /usr/share/datasets/fashion-mnist), TARGET (default
target/release).
"""
import argparse, json, os, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "plugins", "python-model", "examples")
MODULE = os.path.join(EXAMPLES, "keras_multi_worker.py")
FIT = os.path.join(EXAMPLES, "keras_fit.py")
TARGET = os.environ.get("TARGET", os.path.join(ROOT, "target", "release"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def trainerd(workers, data, batch, threads, steps, seed, warmup, log_examples=False):
    """One trainerd run: (examples/s after the warmup, its metrics lines, its directory)."""
    d = tempfile.mkdtemp(prefix="keras-bench-")
    extra = ["--log-examples", os.path.join(d, "ex.jsonl")] if log_examples else []
    head = [os.path.join(TARGET, "trainerd")]
    head += ["local", "--workers", str(workers), "--restart-delay", "0"] if workers > 1 else ["run"]
    cmd = head + ["--plugin", os.path.join(TARGET, "libpython_model.so"), "--plugin-arg", f"module={MODULE}",
                  "--data", data, "--batch-size", str(batch), "--threads", str(threads), "--epochs", "1",
                  "--steps-per-epoch", str(steps), "--seed", str(seed), "--no-evaluation",
                  "--summary", os.path.join(d, "s.json"), "--metrics-log", os.path.join(d, "m.jsonl"), *extra]
    run(cmd)
    suffix = ".worker0" if workers > 1 else ""
    lines = [json.loads(l) for l in open(os.path.join(d, f"m{suffix}.jsonl"))]
    first, last = lines[warmup - 1], lines[-1]
    rate = (last["global_step"] - first["global_step"]) * batch * workers / (last["time"] - first["time"])
    return rate, lines, d


def keras(args, threads):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "k.json")
        run([sys.executable, FIT, "--module", MODULE, "--data", DATA, "--threads", str(threads), "--out", out, *args],
            env=env)
        return json.load(open(out))


def parquet():
    """`trainerd data convert`'s Parquet of DATA, made once beside the build."""
    out = os.path.join(TARGET, "keras-bench-parquet")
    if not os.path.isdir(out):
        run([os.path.join(TARGET, "trainerd"), "data", "convert", DATA, out + ".tmp"])
        os.replace(out + ".tmp", out)
    return out


def losses(a):
    data = parquet()
    _, lines, d = trainerd(1, data, a.batch, a.threads_single, 20, a.seed, 1, log_examples=True)
    order = [json.loads(l)["ids"] for l in open(os.path.join(d, "ex.jsonl"))]
    order_file = os.path.join(d, "order.json")
    json.dump(order, open(order_file, "w"))
    theirs = keras(["--order", order_file, "--parquet", data, "--steps", "20", "--seed", str(a.seed)],
                   a.threads_single)["losses"]
    ours = [l["loss"] for l in lines]
    worst = max(abs(x - y) / abs(y) for x, y in zip(ours, theirs))
    print(f"losses, 1 process, batch {a.batch}: the first 20 of trainerd and of Keras's train step "
          f"(train_on_batch) from the same weights on the same batches: worst relative difference {worst:.1e} "
          f"(goal <= 1e-5: {'met' if worst <= 1e-5 else 'NOT met'}); step 1 {ours[0]:.7f} vs {theirs[0]:.7f}, "
          f"step 20 {ours[19]:.7f} vs {theirs[19]:.7f}", flush=True)


def speed(a, workers):
    threads = a.threads if workers > 1 else a.threads_single
    peer_name = "Keras model under DDP (gloo)" if workers > 1 else "Keras fit"
    ours, theirs = [], []
    for r in range(a.runs):
        ours.append(trainerd(workers, DATA, a.batch, threads, a.steps, a.seed, a.warmup)[0])
        args = ["--steps", str(a.steps), "--batch", str(a.batch * workers), "--seed", str(a.seed),
                "--warmup", str(a.warmup)]
        args += ["--ddp", str(workers)] if workers > 1 else ["--fit"]
        theirs.append(keras(args, threads)["rate"])
        print(f"  {workers} worker(s) run {r + 1}: trainerd {ours[-1]:,.0f} examples/s | {peer_name} "
              f"{theirs[-1]:,.0f} examples/s", flush=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    goal = 1.0 if workers > 1 else 1.5
    print(f"{workers} worker(s), keras_multi_worker.py, batch {a.batch} per worker (global {a.batch * workers}), "
          f"{threads} thread(s) per process, {a.steps} steps ({a.warmup} left out), median of {a.runs}: trainerd "
          f"{o:,.0f} examples/s, {peer_name} {t:,.0f} examples/s, ratio {o / t:.2f}x (goal >= {goal:.1f}x: "
          f"{'met' if o / t >= goal else 'NOT met'})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="per worker (the tutorial's 64)")
    ap.add_argument("--threads-single", type=int, default=2, help="threads of the 1-process runs")
    ap.add_argument("--threads", type=int, default=1, help="threads per process of the 2-worker runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["losses", "single", "ddp"])
    a = ap.parse_args()
    if a.only in (None, "losses"):
        losses(a)
    if a.only in (None, "single"):
        speed(a, 1)
    if a.only in (None, "ddp"):
        speed(a, 2)


if __name__ == "__main__":
    main()
