#!/usr/bin/env python3
"""PyTorch DDP over NCCL, 2 ranks on one GPU (each with its own NCCL_HOSTID, the set-up trainerd's
GPU check uses), training mnist-cnn-big's model (Conv 32 3x3 ReLU -> Flatten -> Dense 128 ReLU ->
Dense 10; Adam 1e-3) on Fashion-MNIST, doing each step what trainerd does: gather the batch's
bytes on the CPU, scale, copy to the GPU, forward, backward (DDP all-reduces in buckets,
overlapped with backward by its autograd hooks), Adam, and read the step's loss and correct count
(locally: trainerd's figures are global, riding in its all-reduce).

Usage: python bench/gpu_ddp.py DATA_DIR BATCH_PER_RANK STEPS [cuda:N] [--deterministic] [PORT]
TORCH_THREADS=N sets each rank's intra-op threads (as trainerd's --threads).
Prints: torch_ddp loop=same-work[-deterministic] world=2 batch=B steps=S examples_per_s=X (global)
"""
import os, sys, time

DETERMINISTIC = "--deterministic" in sys.argv
if DETERMINISTIC:
    sys.argv.remove("--deterministic")


def member(rank, world, data, batch, steps, device, port):
    os.environ["NCCL_HOSTID"] = f"torch-ddp-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    import torch
    import torch.nn as nn
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_eager import load
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    if os.environ.get("TORCH_THREADS"):
        torch.set_num_threads(int(os.environ["TORCH_THREADS"]))
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if DETERMINISTIC:
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 26 * 26, 128), nn.ReLU(),
                      nn.Linear(128, 10)).to(dev)
    m = nn.parallel.DistributedDataParallel(m, device_ids=[dev.index])
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    x_u8, y = load(data, "train")
    n = y.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))

    def step(i):
        pos = ((i * world + rank) * batch) % (n - batch)
        idx = perm[pos:pos + batch]
        xs = (x_u8[idx].float() / 255).to(dev)
        ys = y[idx].to(dev)
        opt.zero_grad(set_to_none=True)
        logits = m(xs)
        loss = lossf(logits, ys)
        loss.backward()
        opt.step()
        # The step's figures, read locally (trainerd's are global, riding in its all-reduce; DDP
        # would need another collective for that, which this loop spares it).
        loss.item(), (logits.argmax(-1) == ys).sum().item()

    for i in range(20):
        step(i)
    torch.cuda.synchronize(dev)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(20 + i)
    torch.cuda.synchronize(dev)
    took = time.perf_counter() - t0
    if rank == 0:
        name = "same-work" + ("-deterministic" if DETERMINISTIC else "")
        print(f"torch_ddp loop={name} world={world} batch={batch} steps={steps} "
              f"examples_per_s={steps * batch * world / took:.0f} torch={torch.__version__}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    data, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cuda:0"
    port = int(sys.argv[5]) if len(sys.argv) > 5 else 29544
    import torch.multiprocessing as mp
    mp.spawn(member, args=(2, data, batch, steps, device, port), nprocs=2)
