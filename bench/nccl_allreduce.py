#!/usr/bin/env python3
"""torch.distributed all-reduce with NCCL, every rank on one GPU (each with its own NCCL_HOSTID,
as trainerd's bench does), in the format of daemon/benches/allreduce.rs.

Usage: python bench/nccl_allreduce.py WORLD [cuda:N] [PORT]
Prints: torch-nccl world=W bytes=B mean_ms=.. median_ms=.. busbw_GBps=..
"""
import os, sys, time

SIZES = [(4096, 2000), (1 << 20, 200), (25 << 20, 20), (100 << 20, 8)]


def member(rank, world, device, port):
    os.environ["NCCL_HOSTID"] = f"torch-bench-{rank}"
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    for size, iters in SIZES:
        x = torch.ones(size // 4, device=dev)
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize(dev)
        dist.barrier()
        times = []
        start = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            dist.all_reduce(x)
            torch.cuda.synchronize(dev)  # as trainerd's completes each all-reduce before returning
            times.append(time.perf_counter() - t)
        mean = (time.perf_counter() - start) / iters
        times.sort()
        if rank == 0:
            busbw = size / mean / 1e9 * 2 * (world - 1) / world
            print(f"torch-nccl world={world} bytes={size} mean_ms={mean * 1e3:.3f} "
                  f"median_ms={times[iters // 2] * 1e3:.3f} busbw_GBps={busbw:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda:0"
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 29533
    import torch.multiprocessing as mp
    mp.spawn(member, args=(world, device, port), nprocs=world)
