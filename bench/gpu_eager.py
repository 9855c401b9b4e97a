# PyTorch eager on one GPU: the tutorials' CNN (mnist-cnn's model: Conv 32 3x3 ReLU -> MaxPool 2 ->
# Dense 64 ReLU -> Dense 10), Adam 1e-3, on Fashion-MNIST, beside trainerd's single-worker CUDA run.
# Two loops are timed:
#   same-work: what trainerd does each step: gather the batch's bytes on the CPU, scale to floats, copy
#              to the GPU, forward, backward, Adam, and read the step's loss and correct count (the
#              progress line's global figures);
#   best-case: the whole dataset on the GPU as floats, no per-step read (one sync at the end).
# With --deterministic, the same-work loop alone, under the guarantees trainerd gives (bitwise
# repeatable): torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG=:4096:8.
# Usage: python gpu_eager.py DATA_DIR BATCH STEPS [DEVICE] [--deterministic] [--autocast bf16|fp16]
# Prints: torch_eager loop=... batch=... steps=... examples_per_s=...
import gzip, os, sys, time

DETERMINISTIC = "--deterministic" in sys.argv
if DETERMINISTIC:
    sys.argv.remove("--deterministic")
# --autocast bf16|fp16: the forward pass and the loss under torch.autocast to that dtype (fp16 with
# a GradScaler at its defaults), as trainerd's --precision.
AUTOCAST = None
if "--autocast" in sys.argv:
    at = sys.argv.index("--autocast")
    AUTOCAST = sys.argv[at + 1]
    del sys.argv[at:at + 2]
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts, as trainerd does
import numpy as np
import torch
import torch.nn as nn


def load(data, split):
    prefix = "train" if split == "train" else "t10k"
    with gzip.open(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")) as f:
        img = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        lab = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    n = lab.shape[0]
    return torch.from_numpy(img.copy()).view(n, 1, 28, 28), torch.from_numpy(lab.copy()).long()


def model():
    return nn.Sequential(nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(32 * 13 * 13, 64), nn.ReLU(), nn.Linear(64, 10))


def run(loop, x_u8, y, batch, steps, device):
    torch.manual_seed(0)
    m = model().to(device)
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    lossf = nn.CrossEntropyLoss()
    dtype = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[AUTOCAST]
    scaler = torch.amp.GradScaler(device.type) if AUTOCAST == "fp16" else None
    n = y.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234))
    if loop == "best-case":
        xg, yg = (x_u8.float() / 255).to(device), y.to(device)
        permg = perm.to(device)

    def step(i):
        pos = (i * batch) % (n - batch)
        if loop == "best-case":
            idx = permg[pos:pos + batch]
            xs, ys = xg[idx], yg[idx]
        else:
            idx = perm[pos:pos + batch]
            xs = (x_u8[idx].float() / 255).to(device)
            ys = y[idx].to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = m(xs)
            loss = lossf(logits, ys)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if loop == "same-work":
            loss.item(), (logits.argmax(-1) == ys).sum().item()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(30):
        step(i)
    sync()
    t = time.perf_counter()
    for i in range(steps):
        step(30 + i)
    sync()
    return steps * batch / (time.perf_counter() - t)


if __name__ == "__main__":
    data, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cuda:0")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    x, y = load(data, "train")
    if DETERMINISTIC:
        torch.use_deterministic_algorithms(True)
    for loop in ["same-work"] if DETERMINISTIC else ["same-work", "best-case"]:
        eps = run(loop, x, y, batch, steps, device)
        name = loop + ("-deterministic" if DETERMINISTIC else "") + (f"-{AUTOCAST}" if AUTOCAST else "")
        print(f"torch_eager loop={name} batch={batch} steps={steps} examples_per_s={eps:.0f} "
              f"torch={torch.__version__} device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}",
              flush=True)
