#!/usr/bin/env python3
"""Training throughput of the Python model plugin (libpython_model.so) on the small GPT example
(plugins/python-model/examples/gpt.py) over token Parquet (tokenize.py's defaults: rows of 128
tokens, a 512-id BPE), in one session:
  - 2 workers on the CPU: `trainerd local --workers 2` beside PyTorch DDP (gloo, 2 processes on
    127.0.0.1) training the same module; goal: trainerd at least 1.2x DDP;
  - 1 worker: `trainerd run` beside a plain PyTorch eager loop; goal: at least 1.0x;
  - the time a step waits for its token batch (goal: none): the summary's `step_phases` (compute,
    next batch, optimizer, in ms per step).
Same module (the file's model(args) under torch.manual_seed(seed)), loss (the file's loss),
per-worker batch, number of steps, Adam lr 1e-3, T libtorch threads per process; runs alternate
(trainerd, peer, trainerd, peer, ...) and the medians are printed. Throughput is tokens/s
(examples/s x 128) over every worker. The peers keep the rows in memory as one tensor, each
epoch a seeded permutation (DDP: each global batch's rows split in halves), and exclude their
--warmup steps; trainerd's figure is its summary's examples_per_second (its training steps'
time: start-up excluded, its first steps included); the line beside it, `steady`, is from the
metrics log's wall clock, its first --warmup steps excluded and everything between steps
(progress lines, epoch ends) included.

Usage: bench/python_model.sh [--runs N] [--batch B] [--epochs E] [--epochs-single E] [--only ddp|eager]
Environment: THREADS (libtorch threads per worker process, default 1), DATA (the token Parquet;
default: tokenize.py's output, made once under $TRAINERD_CACHE/bench), TARGET (where trainerd and
libpython_model.so are; default target/release).

Internally `python_model.py --peer ddp|eager ...` is the PyTorch side of one run (prints JSON).
"""
import argparse, importlib.util, json, os, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "plugins", "python-model", "examples")
MODULE = os.path.join(EXAMPLES, "gpt.py")
TARGET = os.environ.get("TARGET", os.path.join(ROOT, "target", "release"))
CACHE = os.environ.get("TRAINERD_CACHE", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                      "trainerd"))
DATA = os.environ.get("DATA") or os.path.join(CACHE, "bench", "lm-gpt")
THREADS = int(os.environ.get("THREADS", "1"))
TOKENS = 128  # gpt.py's CONTEXT: every row is this many tokens
LR = 1e-3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_files(data):
    names = sorted(os.listdir(data))
    return [os.path.join(data, n) for n in names
            if n.endswith(".parquet") and (n.startswith("train-") or n == "train.parquet")]


def train_rows(data):
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in train_files(data))


def ensure_data():
    """DATA, made with tokenize.py's defaults when it is not there (its output is the same on every
    run, so it is made once)."""
    if os.environ.get("DATA") or os.path.exists(os.path.join(DATA, "meta.json")):
        return
    print(f"making the token dataset: tokenize.py --out {DATA}", flush=True)
    tmp = DATA + ".partial"
    subprocess.run([sys.executable, os.path.join(EXAMPLES, "tokenize.py"), "--out", tmp], check=True,
                   stdout=subprocess.DEVNULL)
    os.replace(tmp, DATA)


# ---- trainerd ----

def trainerd(workers, batch, threads, epochs, seed, warmup, extra=()):
    """One trainerd run: its summary's rate, a steady rate from the metrics log's clock, and the
    per-step phases (ms, the summary's step_phases) of worker 0."""
    with tempfile.TemporaryDirectory() as d:
        summary, metrics = os.path.join(d, "s.json"), os.path.join(d, "m.jsonl")
        head = [os.path.join(TARGET, "trainerd")]
        head += ["local", "--workers", str(workers), "--restart-delay", "0"] if workers > 1 else ["run"]
        cmd = head + ["--plugin", os.path.join(TARGET, "libpython_model.so"), "--plugin-arg", f"module={MODULE}",
                      "--data", DATA, "--batch-size", str(batch), "--threads", str(threads), "--epochs", str(epochs),
                      "--optimizer", "adam", "--lr", str(LR), "--seed", str(seed), "--no-evaluation",
                      "--summary", summary, "--metrics-log", metrics, *extra]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"trainerd failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        suffix = ".worker0" if workers > 1 else ""
        s = json.load(open(os.path.join(d, f"s{suffix}.json")))
        lines = [json.loads(l) for l in open(os.path.join(d, f"m{suffix}.jsonl"))]
    steady = None
    if len(lines) > warmup + 1:
        first, last = lines[warmup], lines[-1]
        steady = (last["global_step"] - first["global_step"]) * s["global_batch_size"] / (last["time"] - first["time"])
    ph = s["step_phases"]
    return {"rate": s["examples_per_second"], "steady": steady, "steps": s["steps"], "seconds": s["train_seconds"],
            "phases_ms": [ph["compute_ms"], ph["next_batch_ms"], ph["optimizer_ms"]],
            "exposed_ms": ph.get("exposed_communication_ms"), "fwd_bwd_ms": ph.get("forward_backward_ms")}


# ---- the PyTorch peers ----

def load_module(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def token_rows(data):
    """The training split's token rows, one int64 tensor [rows, TOKENS]."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    rows = []
    for f in train_files(data):
        rows.extend(pq.read_table(f, columns=["input_ids"]).column("input_ids").to_pylist())
    ids = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    assert ids.shape[1] == TOKENS, ids.shape
    return ids


def peer_rank(rank, world, a, port, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    if world > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    mod = load_module(a.module)
    torch.manual_seed(a.seed)
    net = mod.model(dict(getattr(mod, "arguments", {})))
    parameters = sum(p.numel() for p in net.parameters())
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(net.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    net.train()
    ids = token_rows(a.data)
    mask = torch.ones_like(ids)  # trainerd adds it for a tokens column: every row is full here
    per_epoch = ids.shape[0] // (world * a.batch)
    g = torch.Generator().manual_seed(a.seed)
    perm, epoch = None, -1

    # Host time per phase, as trainerd's phases: the batch, forward+loss+backward (with DDP's
    # all-reduce, which overlaps the backward), the optimizer (the CPU computes synchronously).
    clock = [0.0, 0.0, 0.0]

    def step(s):
        nonlocal perm, epoch
        t0 = time.perf_counter()
        if s // per_epoch != epoch:
            epoch, perm = s // per_epoch, torch.randperm(ids.shape[0], generator=g)
        start = (s % per_epoch) * world * a.batch + rank * a.batch
        take = perm[start:start + a.batch]
        batch = {"input_ids": ids[take], "attention_mask": mask[take]}
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = mod.loss(net, batch)[0]
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for i, d in enumerate((t2 - t1, t1 - t0, t3 - t2)):
            clock[i] += d
        return loss

    for s in range(a.warmup):
        step(s)
    if world > 1:
        dist.barrier()
    clock[:] = [0.0, 0.0, 0.0]
    began = time.perf_counter()
    for s in range(a.warmup, a.warmup + a.steps):
        loss = step(s)
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - began
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rate": a.steps * world * a.batch / seconds, "seconds": seconds, "steps": a.steps,
                       "parameters": parameters, "loss": loss.item(),
                       "phases_ms": [c * 1000 / a.steps for c in clock]}, f)
    if world > 1:
        dist.destroy_process_group()


def peer_main(a):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        if a.peer == "ddp":
            import torch.multiprocessing as mp

            mp.spawn(peer_rank, args=(2, a, free_port(), out), nprocs=2)
        else:
            peer_rank(0, 1, a, 0, out)
        print(open(out).read())


def peer(kind, batch, threads, steps, seed, warmup):
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", kind, "--module", MODULE, "--data", DATA,
           "--batch", str(batch), "--threads", str(threads), "--steps", str(steps), "--seed", str(seed),
           "--warmup", str(warmup), "--lr", str(LR)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"the PyTorch {kind} peer failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- the comparison ----

def compare(name, workers, a, epochs, goal):
    steps = train_rows(DATA) // (workers * a.batch) * epochs
    kind = "ddp" if workers > 1 else "eager"
    peer_name = "PyTorch DDP (gloo)" if workers > 1 else "PyTorch eager"
    ours, theirs, off = [], [], []
    buckets = ["--bucket-mb", str(a.bucket_mb)] if a.bucket_mb else []
    for r in range(a.runs):
        ours.append(trainerd(workers, a.batch, a.threads, epochs, a.seed, a.warmup, buckets))
        if workers > 1:
            off.append(trainerd(workers, a.batch, a.threads, epochs, a.seed, a.warmup, [*buckets, "--overlap", "off"]))
            print(f"  {name} run {r + 1}: exposed communication per step {ours[-1]['exposed_ms']:.2f} ms with "
                  f"--overlap on, {off[-1]['exposed_ms']:.2f} ms off (forward+backward {ours[-1]['fwd_bwd_ms']:.1f} "
                  f"and {off[-1]['fwd_bwd_ms']:.1f} ms; {off[-1]['rate'] * TOKENS:,.0f} tokens/s off)", flush=True)
        if ours[-1]["steps"] != steps:
            raise SystemExit(f"trainerd took {ours[-1]['steps']} steps, expected {steps}")
        theirs.append(peer(kind, a.batch, a.threads, steps, a.seed, a.warmup))
        o, t = ours[-1], theirs[-1]
        ph, tp = o["phases_ms"], t["phases_ms"]
        phase = f"; per step {ph[0]:.1f} ms fwd+bwd+all-reduce, {ph[1]:.2f} ms next batch, {ph[2]:.1f} ms optimizer"
        steady = f"steady {o['steady'] * TOKENS:,.0f}; " if o["steady"] else ""
        print(f"  {name} run {r + 1}: trainerd {o['rate'] * TOKENS:,.0f} tokens/s ({steady}"
              f"{o['seconds']:.1f} s){phase} | {peer_name} {t['rate'] * TOKENS:,.0f} tokens/s ({t['seconds']:.1f} s; "
              f"{tp[0]:.1f} ms fwd+bwd{'+all-reduce' if workers > 1 else ''}, {tp[1]:.2f} ms batch, {tp[2]:.1f} ms "
              f"optimizer)",
              flush=True)
    med = lambda xs: statistics.median(xs)
    o, t = med([x["rate"] for x in ours]), med([x["rate"] for x in theirs])
    steady = [x["steady"] for x in ours if x["steady"]]
    steady = f"; steady {med(steady) * TOKENS:,.0f}" if steady else ""
    phases = [x["phases_ms"] for x in ours]
    wait, step_ms = med([p[1] for p in phases]), med([p[0] + p[1] + p[2] for p in phases])
    params = theirs[0]["parameters"] / 1e6
    print(f"{name}, gpt.py ({params:.2f} M parameters), batch {a.batch} x {TOKENS} tokens per worker "
          f"(global {workers * a.batch}), {a.threads} thread(s) per worker, {steps} steps, median of {a.runs}: "
          f"trainerd {o * TOKENS:,.0f} tokens/s ({o:,.0f} examples/s{steady}), {peer_name} "
          f"{t * TOKENS:,.0f} tokens/s ({t:,.0f} examples/s), ratio {o / t:.2f}x (goal >= {goal:.1f}x: "
          f"{'met' if o / t >= goal else 'NOT met'})", flush=True)
    if off:
        on_ms, off_ms = med([x["exposed_ms"] for x in ours]), med([x["exposed_ms"] for x in off])
        print(f"{name}: exposed communication {on_ms:.2f} ms per step with --overlap on, {off_ms:.2f} ms off: "
              f"{on_ms / off_ms:.2f}x (goal <= 0.25x: {'met' if on_ms <= 0.25 * off_ms else 'NOT met'}); "
              f"--overlap off {med([x['rate'] for x in off]) * TOKENS:,.0f} tokens/s", flush=True)
    print(f"{name}: trainerd's step waits {wait:.2f} ms for its token batch ({100 * wait / step_ms:.1f}% of a "
          f"{step_ms:.1f} ms step; goal: none)", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--epochs", type=int, default=6, help="of the 2-worker runs")
    ap.add_argument("--epochs-single", type=int, default=3, help="of the 1-worker runs (the same steps as --epochs)")
    ap.add_argument("--warmup", type=int, default=5, help="steps the peers (and `steady`) leave out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=THREADS, help="per worker process (default: $THREADS or 1)")
    ap.add_argument("--only", choices=["ddp", "eager"])
    ap.add_argument("--bucket-mb", type=float, help="trainerd's --bucket-mb (default: its own, 25)")
    # The peer's own arguments (a subprocess of this script).
    ap.add_argument("--peer", choices=["ddp", "eager"], help=argparse.SUPPRESS)
    ap.add_argument("--module", default=MODULE, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=DATA, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=LR, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer_main(a)
    ensure_data()
    print(f"data {DATA} ({train_rows(DATA)} training rows of {TOKENS} tokens), binaries {TARGET}", flush=True)
    if a.only != "eager":
        compare("2 workers", 2, a, a.epochs, 1.2)
    if a.only != "ddp":
        compare("1 worker", 1, a, a.epochs_single, 1.0)


if __name__ == "__main__":
    main()
