#!/usr/bin/env python3
"""Sharded optimizer state (ZeRO stage 1) on 4 CPU workers, in one session:
  - trainerd, unsharded (`trainerd local --workers 4`);
  - trainerd --shard optimizer (ZeRO stage 1), and --shard gradients (stage 2: the gradients let
    go once reduce-scattered, only each worker's ranges kept);
  - PyTorch DDP (gloo) with torch.distributed.optim.ZeroRedundancyOptimizer(Adam);
  - plain PyTorch DDP (gloo) with Adam;
each training bench/wide_mlp.py (25.8 M parameters) on Fashion-MNIST, Adam lr 1e-3, batch B per
worker, 1 libtorch thread per process, for S steps. Per worker: the optimizer-state bytes it
holds (trainerd: the summary's optimizer_state_bytes; PyTorch: the bytes of its optimizer's state
tensors), its peak RSS (trainerd: peak_rss_bytes; PyTorch: getrusage's ru_maxrss; the max over
every worker, and over the workers other than worker 0, which commits in every column), examples/s
over every worker (trainerd: the summary's; PyTorch: timed steps after --warmup), and the time to
commit the whole state once on local disk and, for trainerd, on the S3 test server (SeaweedFS on
loopback, started here; a run of 5 steps each) (trainerd: its commit line at the end of the epoch;
ZeroRedundancyOptimizer: consolidate_state_dict(to=0) then torch.save of the model's and the
optimizer's state dicts with fsync; DDP: the torch.save alone).

Usage: bench/sharded.sh [--steps S] [--batch B] [--runs N] [--model-args "depth=25 width=1000"]
Environment: DATA (an MNIST-format directory; default /usr/share/datasets/fashion-mnist),
TARGET (trainerd and libpython_model.so; default target/release).

Internally `sharded.py --peer zero|ddp --rank R ...` is one PyTorch process (prints JSON).
"""
import argparse, gzip, json, os, re, resource, shutil, socket, statistics, struct, subprocess, sys, tempfile, time, uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = os.path.join(ROOT, "bench", "wide_mlp.py")
TARGET = os.environ.get("TARGET", os.path.join(ROOT, "target", "release"))
DATA = os.environ.get("DATA", "/usr/share/datasets/fashion-mnist")
WORKERS = 4
LR = 1e-3
# bench/wide_mlp.py's arguments (--model-args "depth=25 width=1000"; none: its defaults), read
# from the environment so that the peers' processes build the same model.
MODEL_ARGS = dict(kv.split("=", 1) for kv in os.environ.get("SHARDED_MODEL_ARGS", "").split())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3:
    """The test S3-compatible server (SeaweedFS `weed mini`, started as testkit/src/s3.rs starts
    it) on loopback, every port free; stopped by stop()."""
    KEY, SECRET = "trainerd-test", "trainerd-test-secret"
    FLAGS = ["master.port", "volume.port", "filer.port", "s3.port", "admin.port", "s3.port.iceberg",
             "s3.port.lance", "debug.port", "s3.debug.port"]

    def __init__(self):
        cache = os.environ.get("TRAINERD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "trainerd"))
        weed = os.environ.get("TRAINERD_WEED", os.path.join(cache, "venv-s3", "bin", "weed"))
        if not os.path.exists(weed):
            sys.exit(f"no SeaweedFS at {weed} (run scripts/setup.sh --tests, or set TRAINERD_WEED)")
        self.dir = tempfile.mkdtemp(prefix="trainerd-bench-s3-")
        ports = []
        while len(ports) < len(self.FLAGS):
            # weed derives gRPC ports as port + 10000: both must be free.
            p = free_port()
            if p + 10000 < 65536 and p not in ports and self.free(p + 10000):
                ports.append(p)
        cmd = [weed, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-bucket=ckpt",
               "-admin.ui=false", "-webdav=false", "-master.telemetry=false"]
        cmd += [f"-{flag}={port}" for flag, port in zip(self.FLAGS, ports)]
        self.endpoint = f"http://127.0.0.1:{ports[3]}"
        log = open(os.path.join(self.dir, "weed.log"), "w")
        self.p = subprocess.Popen(cmd, env={**os.environ, **self.env()}, stdout=log, stderr=log)
        deadline = time.time() + 60
        while subprocess.run([os.path.join(TARGET, "trainerd"), "ckpt", "list", "s3://ckpt/ready"],
                             env={**os.environ, **self.env()}, capture_output=True).returncode != 0:
            if time.time() > deadline or self.p.poll() is not None:
                sys.exit(f"the S3 test server did not answer: see {self.dir}/weed.log")
            time.sleep(0.5)

    @staticmethod
    def free(port):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    def env(self):
        return {"AWS_ACCESS_KEY_ID": self.KEY, "AWS_SECRET_ACCESS_KEY": self.SECRET, "AWS_REGION": "us-east-1",
                "AWS_ENDPOINT_URL": self.endpoint}

    def stop(self):
        self.p.terminate()
        self.p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def trainerd(steps, batch, shard, s3=None):
    """One trainerd run of 1 epoch of `steps` steps, `--shard shard` (None: unsharded), committed
    at its end (on local disk, or to `s3`): per-worker figures."""
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        location = f"s3://ckpt/bench-{uuid.uuid4()}" if s3 else os.path.join(d, "ckpt")
        cmd = [os.path.join(TARGET, "trainerd"), "local", "--workers", str(WORKERS), "--restart-delay", "0",
               "--plugin", os.path.join(TARGET, "libpython_model.so"), "--plugin-arg", f"module={MODULE}",
               *[a for k, v in MODEL_ARGS.items() for a in ("--plugin-arg", f"{k}={v}")], "--data", DATA, "--epochs", "1", "--steps-per-epoch", str(steps), "--batch-size", str(batch),
               "--threads", "1", "--optimizer", "adam", "--lr", str(LR), "--no-evaluation",
               "--checkpoint-dir", location, "--summary", summary]
        if shard:
            cmd += ["--shard", shard]
        env = {**os.environ, **(s3.env() if s3 else {})}
        out, mid = sampled(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        if out.returncode != 0:
            sys.exit(f"trainerd failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        commits = re.findall(r"checkpoint \d+ committed to .* \(step \d+, [\d.]+ MB, ([\d.]+)s\)", out.stdout)
        workers = [json.load(open(os.path.join(d, f"s.worker{w}.json"))) for w in range(WORKERS)]
        return {
            "state": [w["optimizer_state_bytes"] for w in workers],
            "rss": [w["peak_rss_bytes"] for w in workers],
            "rate": workers[0]["examples_per_second"],
            "commit": float(commits[-1]) if commits else None,
            "mid": mid,
            "memory": [w["memory"] for w in workers],
        }


def sampled(p):
    """`trainerd local` (`p`) run to its end while its workers' resident memory (VmRSS) is read
    every 50 ms: its output, and the most any worker held in the middle of the run (from 35% to
    85% of its time: training, past the start's state transfer and before the last commit)."""
    import threading
    got = {}
    readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read())) for k, f in
               (("stdout", p.stdout), ("stderr", p.stderr))]
    [r.start() for r in readers]
    t0, samples = time.time(), []
    while p.poll() is None:
        kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
        for k in kids:
            try:
                status = open(f"/proc/{k}/status").read()
                samples.append((time.time() - t0, int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024))
            except (OSError, AttributeError):
                pass
        time.sleep(0.05)
    [r.join() for r in readers]
    end = time.time() - t0
    mid = [rss for t, rss in samples if 0.35 * end <= t <= 0.85 * end]
    return subprocess.CompletedProcess(p.args, p.returncode, got["stdout"], got["stderr"]), max(mid, default=0)


def load_images():
    def read(path):
        return gzip.open(path + ".gz").read() if os.path.exists(path + ".gz") else open(path, "rb").read()
    images, labels = read(f"{DATA}/train-images-idx3-ubyte"), read(f"{DATA}/train-labels-idx1-ubyte")
    n = struct.unpack(">I", images[4:8])[0]
    return images[16:], labels[8:], n


def peer(kind, rank, port, steps, batch, warmup, out_dir):
    """One PyTorch process of a DDP job (ZeroRedundancyOptimizer or plain Adam): its JSON."""
    import importlib.util
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    spec = importlib.util.spec_from_file_location("wide_mlp", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    net = DDP(module.model(MODEL_ARGS))
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=LR)
    raw, labels, n = load_images()
    images = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(n, 1, 28, 28)
    targets = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    began = None
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            began = time.perf_counter()
        rows = order[(step * WORKERS + rank) * batch:(step * WORKERS + rank + 1) * batch]
        x, y = images[rows].float() / 255.0, targets[rows]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    dist.barrier()
    seconds = time.perf_counter() - began
    # What this rank holds of the optimizer's state (ZeroRedundancyOptimizer: its partition).
    inner = opt.optim if kind == "zero" else opt
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    commit_began = time.perf_counter()
    if kind == "zero":
        opt.consolidate_state_dict(to=0)
    if rank == 0:
        path = os.path.join(out_dir, "ckpt.pt")
        whole = {"model": net.module.state_dict(), "optimizer": opt.state_dict()}
        with open(path + ".tmp", "wb") as f:
            torch.save(whole, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    dist.barrier()
    commit = time.perf_counter() - commit_began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"state": state, "rss": rss, "examples": (steps - warmup) * batch * WORKERS,
                      "seconds": seconds, "commit": commit}))
    dist.destroy_process_group()


def pytorch(kind, steps, batch, warmup):
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, __file__, "--peer", kind, "--rank", str(r), "--port", str(port),
                                   "--steps", str(steps), "--batch", str(batch), "--warmup", str(warmup),
                                   "--out", d], stdout=subprocess.PIPE, text=True) for r in range(WORKERS)]
        results = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                sys.exit(f"the {kind} peer failed")
            results.append(json.loads(out.strip().splitlines()[-1]))
    seconds = max(r["seconds"] for r in results)
    return {
        "state": [r["state"] for r in results],
        "rss": [r["rss"] for r in results],
        "rate": results[0]["examples"] / seconds,
        "commit": results[0]["commit"],
    }


def parameter_count():
    """bench/wide_mlp.py's parameters with MODEL_ARGS."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("wide_mlp", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sum(p.numel() for p in module.model(MODEL_ARGS).parameters())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--model-args", help='bench/wide_mlp.py\'s arguments, such as "depth=25 width=1000"')
    ap.add_argument("--peer")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.model_args:
        # The peers' processes read them from the environment too.
        os.environ["SHARDED_MODEL_ARGS"] = a.model_args
        MODEL_ARGS.update(kv.split("=", 1) for kv in a.model_args.split())
    if a.peer:
        return peer(a.peer, a.rank, a.port, a.steps, a.batch, a.warmup, a.out)
    levels = {"trainerd": None, "trainerd --shard optimizer": "optimizer", "trainerd --shard gradients": "gradients"}
    runs = {**{name: [] for name in levels}, "DDP + ZeroRedundancyOptimizer": [], "DDP": []}
    s3_commits = {"trainerd": [], "trainerd --shard optimizer": []}
    s3 = S3()
    try:
        for i in range(a.runs):
            print(f"run {i + 1}/{a.runs}", flush=True)
            for name, shard in levels.items():
                runs[name].append(trainerd(a.steps, a.batch, shard))
            runs["DDP + ZeroRedundancyOptimizer"].append(pytorch("zero", a.steps, a.batch, a.warmup))
            runs["DDP"].append(pytorch("ddp", a.steps, a.batch, a.warmup))
            # The same commit to the S3 test server (a short run: only its commit is read).
            for name in s3_commits:
                s3_commits[name].append(trainerd(min(a.steps, 5), a.batch, levels[name], s3)["commit"])
    finally:
        s3.stop()
    mb = lambda b: f"{b / 1e6:,.0f}"
    params = parameter_count()
    print(f"\n{WORKERS} workers, bench/wide_mlp.py {MODEL_ARGS or ''} ({params / 1e6:.1f} M parameters), Adam, "
          f"batch {a.batch} per worker, "
          f"{a.steps} steps, 1 thread each; medians of {a.runs} run(s)")
    print(f"| {'':30} | optimizer state MB per worker (max) | peak RSS MB per worker (max) | "
          f"peak RSS MB of the others than the committer (max) | RSS MB mid-run (trainerd; max) | examples/s | "
          f"commit s (local disk) | commit s (S3 test server) |")
    print(f"|{'-' * 32}|---|---|---|---|---|---|---|")
    figures = {}
    for name, rs in runs.items():
        state = statistics.median(max(r["state"]) for r in rs)
        rss = statistics.median(max(r["rss"]) for r in rs)
        # Worker 0 (rank 0) commits in every column: the others' peak is the steady state's.
        others = statistics.median(max(r["rss"][1:]) for r in rs)
        rate = statistics.median(r["rate"] for r in rs)
        commit = statistics.median(r["commit"] for r in rs if r["commit"] is not None)
        figures[name] = (state, rss, rate, commit)
        on_s3 = f"{statistics.median(s3_commits[name]):.2f}" if name in s3_commits else "-"
        mid = mb(statistics.median(r["mid"] for r in rs)) if "mid" in rs[0] else "-"
        print(f"| {name:30} | {mb(state)} | {mb(rss)} | {mb(others)} | {mid} | {rate:,.0f} | {commit:.2f} | {on_s3} |")
        if "mid" in rs[0]:
            figures[name] += (statistics.median(r["mid"] for r in rs),)
    (s0, r0, e0, c0, _), (s1, r1, e1, c1, m1) = figures["trainerd"], figures["trainerd --shard optimizer"]
    _, r2, e2, _, m2 = figures["trainerd --shard gradients"]
    _, rz, ez, _ = figures["DDP + ZeroRedundancyOptimizer"][:4]
    print(f"\nsharded / unsharded trainerd: optimizer state {s1 / s0:.2f}x (goal at most 0.55x), "
          f"examples/s {e1 / e0:.2f}x (goal at least 1.0x), commit {c1 / c0:.2f}x")
    print(f"sharded trainerd / ZeroRedundancyOptimizer: peak RSS {r1 / rz:.2f}x (goal at most 1.0x), "
          f"examples/s {e1 / ez:.2f}x (goal at least 1.3x)")
    print(f"--shard gradients / --shard optimizer: peak RSS {r2 / r1:.2f}x, RSS mid-run {m2 / m1:.2f}x "
          f"({(m2 - m1) / 1e6:+,.0f} MB; the gradients are {params * 4 / 1e6:,.0f} MB), examples/s {e2 / e1:.2f}x")
    # What trainerd's summary measured of each worker's model state, at each kind's peak.
    kinds = ["parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "buddy_state_bytes"]
    print(f"\n| trainerd's summary, MB per worker (max) | parameters | gradients | optimizer state | buddy copies | "
          f"model state | model state / unsharded |")
    print(f"|{'-' * 41}|---|---|---|---|---|---|")
    whole = None
    for name, rs in runs.items():
        if "memory" not in rs[0]:
            continue
        each = [statistics.median(max(m[k] for m in r["memory"]) for r in rs) for k in kinds]
        whole = whole or sum(each)
        print(f"| {name:39} | {' | '.join(mb(b) for b in each)} | {mb(sum(each))} | {sum(each) / whole:.2f}x |")


if __name__ == "__main__":
    main()
