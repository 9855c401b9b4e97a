"""PyTorch eager training of a scripted model's twin, in trainerd's data order: the comparison
that checks trainerd's optimizer, data order and plugin boundary against what PyTorch does.

    python eager.py --model cnn --module OUT.pt --data DATA_DIR --order ORDER.bin \
        --workers 2 --batch 32 --steps 300 [--epochs 1] [--lr 1e-3] --out result.json

The initial weights (and buffers) are the scripted file's, loaded into models.py's eager module.
ORDER.bin holds each epoch's permutation of the training split as little-endian int64 (trainerd's
order, trainerd_sdk::data::epoch_permutation). Step s of an epoch covers positions s*G..(s+1)*G of
it (G = workers x batch), worker k the k-th slice of `batch`, as trainerd shards it. The workers
are emulated as trainerd runs them: each slice's forward pass on its own (BatchNorm's batch
statistics are a worker's), the gradient of the mean of the slices' mean losses, the buffers
(BatchNorm's running statistics) averaged over the workers after the step. Adam with PyTorch's
defaults. Writes JSON: each step's loss (the mean over the workers) and the test accuracy.
"""
import argparse
import gzip
import json
import os

import numpy as np
import torch

import models


def load(data, prefix):
    with gzip.open(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    n = labels.shape[0]
    x = torch.from_numpy(images.copy()).view(n, 1, 28, 28).to(torch.float32) / 255.0
    return x, torch.from_numpy(labels.copy()).long()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(models.MODELS))
    p.add_argument("--module", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--order", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    model = models.MODELS[a.model]()
    model.load_state_dict(torch.jit.load(a.module).state_dict())
    shape = models.INPUT_SHAPE[a.model]
    x, y = load(a.data, "train")
    tx, ty = load(a.data, "t10k")
    order = np.fromfile(a.order, dtype="<i8").reshape(a.epochs, -1)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    global_batch = a.workers * a.batch
    losses = []
    model.train()
    for epoch in range(a.epochs):
        for step in range(a.steps):
            start = step * global_batch
            buffers = {k: v.clone() for k, v in model.named_buffers()}
            after = []
            opt.zero_grad(set_to_none=True)
            step_losses = []
            for k in range(a.workers):
                for name, value in model.named_buffers():
                    value.copy_(buffers[name])
                idx = torch.from_numpy(order[epoch, start + k * a.batch:start + (k + 1) * a.batch].copy())
                loss = torch.nn.functional.cross_entropy(model(x[idx].reshape(-1, *shape)), y[idx])
                (loss / a.workers).backward()
                step_losses.append(loss.item())
                after.append({k2: v.clone() for k2, v in model.named_buffers()})
            with torch.no_grad():
                for name, value in model.named_buffers():
                    if value.is_floating_point():
                        value.copy_(sum(b[name] for b in after) / a.workers)
            opt.step()
            losses.append(sum(step_losses) / a.workers)
    model.eval()
    with torch.no_grad():
        correct = sum((model(tx[i:i + 500].reshape(-1, *shape)).argmax(-1) == ty[i:i + 500]).sum().item()
                      for i in range(0, ty.shape[0], 500))
    result = {"losses": losses, "test_accuracy": correct / ty.shape[0]}
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({"first_losses": losses[:3], "test_accuracy": result["test_accuracy"]}))


if __name__ == "__main__":
    main()
