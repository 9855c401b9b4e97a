#!/usr/bin/env python3
"""What a resume costs in memory, on 4 CPU workers, in one session: each run trains
bench/wide_mlp.py (25.8 M parameters with "depth=25 width=1000") with Adam for 2S steps,
committing at step S; then its commits past step S are removed and it resumes from step S and
trains S steps more. Per worker, the resumed run's peak RSS (trainerd: the summary's
peak_rss_bytes; PyTorch: getrusage's ru_maxrss) and its resident memory while it trains on (read
every 50 ms, from 35% to 85% of the run's time), beside the same for the first run:
  - trainerd unsharded, and `--shard optimizer` (ZeRO stage 1): the coordinator restores the
    commit, and each worker reads its own ranges of the optimizer state from it (before
    2026-12-02 the formation sent the whole state to every worker, which cut its ranges from it);
  - PyTorch DDP (gloo) with ZeroRedundancyOptimizer(Adam), resumed as its documentation has it:
    every rank torch.load()s the consolidated checkpoint rank 0 saved and load_state_dict()s it
    (ZeroRedundancyOptimizer keeps its own partition of the whole state it is given).

Usage: bench/resume.sh [--steps S] [--batch B] [--runs N] [--model-args "depth=25 width=1000"]
Environment: DATA, TARGET (as bench/sharded.py's).

Internally `resume.py --peer first|resumed --rank R ...` is one PyTorch process (prints JSON).
"""
import argparse, json, os, resource, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sharded  # noqa: E402  (bench/sharded.py: the model, the data, the trainerd command)

WORKERS = sharded.WORKERS


def trainerd(steps, batch, shard, d):
    """trainerd `local` on 4 workers for 2 * `steps` steps committing every `steps`, then resumed
    from its first commit (the later ones removed) for the rest: both runs' figures."""
    ckpt = os.path.join(d, "ckpt")
    cmd = [os.path.join(sharded.TARGET, "trainerd"), "local", "--workers", str(WORKERS), "--restart-delay", "0",
           "--plugin", os.path.join(sharded.TARGET, "libpython_model.so"), "--plugin-arg", f"module={sharded.MODULE}",
           *[a for k, v in sharded.MODEL_ARGS.items() for a in ("--plugin-arg", f"{k}={v}")],
           "--data", sharded.DATA, "--epochs", "1", "--steps-per-epoch", str(2 * steps), "--batch-size", str(batch),
           "--threads", "1", "--optimizer", "adam", "--lr", str(sharded.LR), "--no-evaluation",
           "--checkpoint-dir", ckpt, "--checkpoint-every", str(steps), "--keep-checkpoints", "10",
           "--summary", os.path.join(d, "s.json")]
    if shard:
        cmd += ["--shard", shard]
    figures = []
    for run in ("first", "resumed"):
        if run == "resumed":
            records = sorted(os.listdir(os.path.join(ckpt, "commits")))
            for r in records[1:]:
                os.remove(os.path.join(ckpt, "commits", r))
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, mid = sharded.sampled(p)
        if out.returncode != 0:
            sys.exit(f"trainerd failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        if run == "resumed" and f"global step {steps})" not in out.stdout:
            sys.exit(f"trainerd did not resume at step {steps}:\n{out.stdout[-3000:]}")
        workers = [json.load(open(os.path.join(d, f"s.worker{w}.json"))) for w in range(WORKERS)]
        figures.append({"rss": [w["peak_rss_bytes"] for w in workers], "mid": mid,
                        "read": [line for line in out.stdout.splitlines() if "this worker read its" in line]})
    return figures


def peer(run, rank, port, steps, batch, out_dir):
    """One rank of DDP + ZeroRedundancyOptimizer: `first` trains `steps` steps and saves the
    consolidated state on rank 0; `resumed` loads it on every rank and trains `steps` more."""
    import importlib.util
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    spec = importlib.util.spec_from_file_location("wide_mlp", sharded.MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    net = DDP(module.model(sharded.MODEL_ARGS))
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.Adam, lr=sharded.LR)
    path = os.path.join(out_dir, "ckpt.pt")
    first = 0
    if run == "resumed":
        whole = torch.load(path, map_location="cpu")
        net.module.load_state_dict(whole["model"])
        opt.load_state_dict(whole["optimizer"])
        first = steps
        del whole
    raw, labels, n = sharded.load_images()
    images = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(n, 1, 28, 28)
    targets = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for step in range(first, first + steps):
        rows = order[(step * WORKERS + rank) * batch:(step * WORKERS + rank + 1) * batch]
        x, y = images[rows].float() / 255.0, targets[rows]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    if run == "first":
        opt.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save({"model": net.module.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    print(json.dumps({"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    dist.destroy_process_group()


def pytorch(steps, batch, d):
    """The peer's first run and its resume: both runs' figures."""
    figures = []
    for run in ("first", "resumed"):
        port = sharded.free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--peer", run, "--rank", str(r), "--port", str(port),
                                   "--steps", str(steps), "--batch", str(batch), "--out", d],
                                  stdout=subprocess.PIPE, text=True) for r in range(WORKERS)]
        results = []
        for p in procs:
            out, _ = p.communicate()
            if p.returncode != 0:
                sys.exit(f"the peer's {run} run failed")
            results.append(json.loads(out.strip().splitlines()[-1]))
        figures.append({"rss": [r["rss"] for r in results]})
    return figures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--model-args", default="depth=25 width=1000")
    ap.add_argument("--peer")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ["SHARDED_MODEL_ARGS"] = a.model_args
    sharded.MODEL_ARGS.update(kv.split("=", 1) for kv in a.model_args.split())
    if a.peer:
        return peer(a.peer, a.rank, a.port, a.steps, a.batch, a.out)
    kinds = {"trainerd": None, "trainerd --shard optimizer": "optimizer",
             "DDP + ZeroRedundancyOptimizer": "peer"}
    runs = {name: [] for name in kinds}
    for i in range(a.runs):
        print(f"run {i + 1}/{a.runs}", flush=True)
        for name, kind in kinds.items():
            with tempfile.TemporaryDirectory() as d:
                runs[name].append(pytorch(a.steps, a.batch, d) if kind == "peer" else trainerd(a.steps, a.batch, kind, d))
    mb = lambda b: f"{b / 1e6:,.0f}"
    params = sharded.parameter_count()
    print(f"\n{WORKERS} workers, bench/wide_mlp.py {a.model_args} ({params / 1e6:.1f} M parameters), Adam, batch "
          f"{a.batch} per worker, {a.steps} steps then {a.steps} resumed, 1 thread each; medians of {a.runs} run(s)")
    print("| | peak RSS MB, first run (max of workers) | peak RSS MB, resumed run (max) | resumed, others than "
          "worker 0 (max) | resident MB while the resumed run trains (trainerd; max) |")
    print("|---|---|---|---|---|")
    med = lambda rs, i, f: statistics.median(f(r[i]) for r in rs)
    for name, rs in runs.items():
        mid = mb(med(rs, 1, lambda r: r["mid"])) if "mid" in rs[0][1] else "-"
        print(f"| {name} | {mb(med(rs, 0, lambda r: max(r['rss'])))} | {mb(med(rs, 1, lambda r: max(r['rss'])))} | "
              f"{mb(med(rs, 1, lambda r: max(r['rss'][1:])))} | {mid} |")
    for line in runs["trainerd --shard optimizer"][0][1]["read"]:
        print(line)


if __name__ == "__main__":
    main()
