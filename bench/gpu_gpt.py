#!/usr/bin/env python3
"""PyTorch DDP over NCCL, 2 ranks on one GPU (each with its own NCCL_HOSTID, the set-up of
trainerd's GPU check), training the GPT example (plugins/python-model/examples/gpt.py: its
model(args) under torch.manual_seed(seed), its loss) on token Parquet (tokenize.py's output), with
torch.autocast to bfloat16 around the forward pass and the loss (fp32: no autocast), Adam lr 1e-3,
doing each step what trainerd's does: the batch's rows gathered on the CPU and copied to the GPU,
forward, backward (DDP all-reduces its buckets behind it), Adam, and the step's loss read back.
Each epoch is a seeded permutation of the rows, each global batch split between the ranks. The
first WARMUP steps are left out of the time.

Usage: python bench/gpu_gpt.py DATA_DIR BATCH_PER_RANK STEPS [--precision bf16|fp32] [--device cuda:N]
       [--port P] [--warmup W] [--module gpt.py]
Prints: torch_ddp model=gpt precision=P world=2 batch=B steps=S tokens_per_s=X examples_per_s=Y (global)
"""
import argparse, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_model import MODULE, TOKENS, load_module, token_rows  # the CPU bench's module, rows and loader


def member(rank, world, a):
    os.environ["NCCL_HOSTID"] = f"torch-ddp-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "1")))
    # (gloo on the CPU: a dry run of this loop where there is no GPU.)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=world, device_id=dev if cuda else None)
    mod = load_module(a.module)
    torch.manual_seed(a.seed)
    net = mod.model(dict(getattr(mod, "arguments", {}))).to(dev)
    parameters = sum(p.numel() for p in net.parameters())
    net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[dev.index] if cuda else None)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    net.train()
    ids = token_rows(a.data)
    per_epoch = ids.shape[0] // (world * a.batch)
    g = torch.Generator().manual_seed(a.seed)
    perm, epoch = None, -1
    half = a.precision == "bf16"

    def step(s):
        nonlocal perm, epoch
        if s // per_epoch != epoch:
            epoch, perm = s // per_epoch, torch.randperm(ids.shape[0], generator=g)
        start = (s % per_epoch) * world * a.batch + rank * a.batch
        x = ids[perm[start:start + a.batch]].to(dev, non_blocking=True)
        batch = {"input_ids": x, "attention_mask": torch.ones_like(x)}
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=half):
            loss = mod.loss(net, batch)[0]
        loss.backward()
        opt.step()
        return loss.item()

    for s in range(a.warmup):
        step(s)
    if cuda:
        torch.cuda.synchronize(dev)
    dist.barrier()
    began = time.perf_counter()
    for s in range(a.warmup, a.warmup + a.steps):
        last = step(s)
    if cuda:
        torch.cuda.synchronize(dev)
    took = time.perf_counter() - began
    if rank == 0:
        rate = a.steps * world * a.batch / took
        print(f"torch_ddp model=gpt precision={a.precision} world={world} batch={a.batch} steps={a.steps} "
              f"tokens_per_s={rate * TOKENS:.0f} examples_per_s={rate:.0f} parameters={parameters} loss={last:.4f} "
              f"torch={torch.__version__}", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("batch", type=int, help="per rank")
    ap.add_argument("steps", type=int, help="timed steps")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--port", type=int, default=29545)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--module", default=MODULE)
    a = ap.parse_args()
    import torch.multiprocessing as mp

    mp.spawn(member, args=(2, a), nprocs=2)


if __name__ == "__main__":
    main()
