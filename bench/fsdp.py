#!/usr/bin/env python3
"""A decoder-only transformer of about 100 M parameters on 4 CPU workers, in one session:
  - trainerd unsharded, `--shard optimizer` (ZeRO stage 1) and `--shard gradients` (stage 2), each
    `trainerd local --workers 4`;
  - PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard` on each transformer block, then on the
    root; gloo, 4 processes on 127.0.0.1);
training the same module (plugins/python-model/examples/gpt.py at --model-args, by default
d_model=1024 n_layer=8 n_head=16: 101 M parameters, its head tied to the token embedding) from the
same initial weights (the file's model(args) under torch.manual_seed(seed)) on the same batches
(each FSDP2 rank takes, at each step, the rows trainerd's worker of that rank trained on, read
from the unsharded run's --log-examples), Adam lr 1e-3, B rows per worker, 1 libtorch thread per
process, S steps.

Per worker it prints:
  - model state: trainerd's summary `memory` (parameters, gradients, own optimizer state; each at
    its peak, so the gradients' count the buckets in flight; the buddy copies apart); FSDP2's
    local shards of the parameters, of their gradients and of Adam's state after the last step
    (what it keeps between steps: the blocks it all-gathers for a forward or backward pass are
    freed after it, and show in the peak RSS);
  - the peak RSS (the largest over the workers, and over those but worker 0, which writes the
    unsharded run's commits alone: trainerd's peak_rss_bytes, FSDP2's ru_maxrss);
  - tokens/s over every worker, from the step clock after --warmup steps (trainerd's metrics log,
    FSDP2's timer);
  - the largest difference of the first 20 step losses from FSDP2's (FSDP2's: the mean of its
    ranks', as trainerd's is the mean over its workers).
`--shard parameters` (ZeRO stage 3) is not built yet: no column for it.

Usage: bench/fsdp.sh [--steps S] [--batch B] [--warmup W] [--model-args "d_model=1024 n_layer=8 n_head=16"]
Environment: DATA (token Parquet; default: tokenize.py's output, made once under
$TRAINERD_CACHE/bench), TARGET (trainerd and libpython_model.so; default target/release).

Internally `fsdp.py --peer RANK ...` is one FSDP2 process.
"""
import argparse, json, os, resource, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_model import DATA, MODULE, TARGET, TOKENS, ensure_data, free_port, load_module, token_rows, train_files

WORKERS = 4
LR = 1e-3
LOSSES = 20


def model_args(text):
    return dict(kv.split("=", 1) for kv in text.split())


# ---- trainerd ----

def trainerd(level, a, d):
    """One trainerd run at --shard `level` (None: unsharded) in directory `d`: its summaries,
    worker 0's metrics log, and the example ids each worker trained on, step by step."""
    os.makedirs(d)
    cmd = [os.path.join(TARGET, "trainerd"), "local", "--workers", str(WORKERS), "--restart-delay", "0",
           "--plugin", os.path.join(TARGET, "libpython_model.so"), "--plugin-arg", f"module={MODULE}"]
    for k, v in model_args(a.model_args).items():
        cmd += ["--plugin-arg", f"{k}={v}"]
    cmd += ["--data", DATA, "--batch-size", str(a.batch), "--threads", "1", "--epochs", "1",
            "--steps-per-epoch", str(a.steps), "--optimizer", "adam", "--lr", str(LR), "--seed", str(a.seed),
            "--no-evaluation", "--summary", os.path.join(d, "s.json"), "--metrics-log", os.path.join(d, "m.jsonl"),
            "--log-examples", os.path.join(d, "ex.jsonl"), "--checkpoint-dir", os.path.join(d, "ckpt"),
            "--checkpoint-every", str(10 * a.steps)]
    if level:
        cmd += ["--shard", level]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"trainerd failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    summaries = [json.load(open(os.path.join(d, f"s.worker{w}.json"))) for w in range(WORKERS)]
    lines = [json.loads(l) for l in open(os.path.join(d, "m.worker0.jsonl"))]
    ids = [[json.loads(l)["ids"] for l in open(os.path.join(d, f"ex.worker{w}.jsonl"))] for w in range(WORKERS)]
    first, last = lines[a.warmup], lines[-1]
    tokens = (last["global_step"] - first["global_step"]) * WORKERS * a.batch * TOKENS
    memory = [s["memory"] for s in summaries]
    kinds = {k: max(m[k] for m in memory) for k in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")}
    return {
        "state": max(m["parameter_bytes"] + m["gradient_bytes"] + m["optimizer_state_bytes"] for m in memory),
        "kinds": [kinds["parameter_bytes"], kinds["gradient_bytes"], kinds["optimizer_state_bytes"]],
        "buddy": max(m["buddy_state_bytes"] for m in memory),
        "rss": max(s["peak_rss_bytes"] for s in summaries),
        "rss_others": max(s["peak_rss_bytes"] for s in summaries[1:]),
        "rate": tokens / (last["time"] - first["time"]),
        "losses": [l["loss"] for l in lines[:LOSSES]],
        "params": summaries[0]["params_sha256"],
        "ids": ids,
    }


# ---- FSDP2 ----

def peer_rank(a):
    """One FSDP2 process: rank a.peer of WORKERS; writes its JSON to a.out."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(a.port)
    dist.init_process_group("gloo", rank=a.peer, world_size=WORKERS)
    mod = load_module(MODULE)
    args = {**getattr(mod, "arguments", {}), **model_args(a.model_args)}
    torch.manual_seed(a.seed)
    net = mod.model(args)
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    net.train()
    import pyarrow.parquet as pq

    ids = token_rows(DATA)
    # trainerd's ids are (file, row): each file's first row in token_rows' concatenation.
    offsets = [0]
    for f in train_files(DATA)[:-1]:
        offsets.append(offsets[-1] + pq.ParquetFile(f).metadata.num_rows)
    order = json.load(open(a.order))[a.peer]
    losses, began = [], None
    for s, step_ids in enumerate(order):
        if s == a.warmup:
            dist.barrier()
            began = time.perf_counter()
        take = torch.tensor([offsets[f] + r for f, r in step_ids])
        batch = {"input_ids": ids[take], "attention_mask": torch.ones_like(ids[take])}
        opt.zero_grad(set_to_none=True)
        loss = mod.loss(net, batch)[0]
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORKERS)
    dist.barrier()
    seconds = time.perf_counter() - began

    def local_bytes(t):
        return t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()

    kinds = [sum(local_bytes(p) for p in net.parameters()),
             sum(local_bytes(p.grad) for p in net.parameters() if p.grad is not None),
             sum(local_bytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(f"{a.out}.{a.peer}", "w") as f:
        json.dump({"state": sum(kinds), "kinds": kinds, "rss": rss, "losses": losses[:LOSSES],
                   "rate": (len(order) - a.warmup) * WORKERS * a.batch * TOKENS / seconds}, f)
    dist.destroy_process_group()


def fsdp2(a, order, d):
    path = os.path.join(d, "order.json")
    json.dump(order, open(path, "w"))
    out, port = os.path.join(d, "fsdp2"), free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--peer", str(r), "--order", path,
                               "--out", out, "--port", str(port), "--seed", str(a.seed), "--batch", str(a.batch),
                               "--warmup", str(a.warmup), "--model-args", a.model_args],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
             for r in range(WORKERS)]
    for r, p in enumerate(procs):
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"FSDP2 rank {r} failed ({p.returncode}):\n{err[-3000:]}")
    ranks = [json.load(open(f"{out}.{r}")) for r in range(WORKERS)]
    return {"state": max(r["state"] for r in ranks), "kinds": [max(r["kinds"][k] for r in ranks) for k in range(3)],
            "buddy": 0, "rss": max(r["rss"] for r in ranks), "rss_others": max(r["rss"] for r in ranks[1:]),
            "rate": ranks[0]["rate"], "losses": ranks[0]["losses"]}


# ---- the table ----

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", type=int, help=argparse.SUPPRESS)
    p.add_argument("--order", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=1, help="rows of 128 tokens per worker and step")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of tokens/s")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--model-args", default="d_model=1024 n_layer=8 n_head=16")
    a = p.parse_args()
    if a.peer is not None:
        return peer_rank(a)
    if a.steps < max(LOSSES, a.warmup + 2):
        raise SystemExit(f"--steps {a.steps}: expected at least {max(LOSSES, a.warmup + 2)}")
    ensure_data()
    mod = load_module(MODULE)
    import torch

    torch.manual_seed(a.seed)
    n = sum(p.numel() for p in mod.model({**mod.arguments, **model_args(a.model_args)}).parameters())
    print(f"gpt.py {a.model_args}: {n / 1e6:.1f} M parameters ({4 * n / 1e6:.0f} MB in float32), {WORKERS} "
          f"workers, {a.batch} row(s) of {TOKENS} tokens each per step, {a.steps} steps, Adam", flush=True)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="trainerd-bench-fsdp-") as d:
        for name, level in [("trainerd", None), ("--shard optimizer", "optimizer"), ("--shard gradients", "gradients")]:
            rows[name] = trainerd(level, a, os.path.join(d, level or "none"))
            print(f"  {name}: done", flush=True)
        rows["FSDP2 (gloo)"] = fsdp2(a, rows["trainerd"]["ids"], d)
        print("  FSDP2: done", flush=True)
    peer = rows["FSDP2 (gloo)"]
    whole = rows["trainerd"]
    print(f"\n| per worker | parameters MB | gradients MB | optimizer state MB | model state MB | buddy copies MB "
          f"| peak RSS MB (all, others) | tokens/s | first {LOSSES} losses, max diff from FSDP2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        diff = max(abs(x - y) for x, y in zip(r["losses"], peer["losses"]))
        kinds = " | ".join(f"{k / 1e6:,.0f}" for k in r["kinds"])
        print(f"| {name} | {kinds} | {r['state'] / 1e6:,.0f} | {r['buddy'] / 1e6:,.0f} | "
              f"{r['rss'] / 1e6:,.0f}, {r['rss_others'] / 1e6:,.0f} | {r['rate']:,.0f} | {diff:.2e} |")
    for name in ("--shard optimizer", "--shard gradients"):
        r = rows[name]
        same = "the same bits" if r["params"] == whole["params"] else "OTHER BITS"
        print(f"{name}: model state {r['state'] / peer['state']:.2f}x FSDP2's, "
              f"{(r['state'] + r['buddy']) / whole['state']:.2f}x the unsharded run's with its buddy copies; "
              f"{r['rate'] / peer['rate']:.2f}x FSDP2's tokens/s; {same} as unsharded")


if __name__ == "__main__":
    main()
