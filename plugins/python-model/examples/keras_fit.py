"""Keras's own training of a Keras model file (a compiled Keras 3 model on the torch backend), on
MNIST-format data: the reference that trainerd's Keras runs are compared against, and the peer of
bench/keras.sh.

    python keras_fit.py --module FILE --data DIR --seed S --out RESULT.json
        [--order ORDER.json [--parquet DIR] --steps N | --batch B --steps N] [--fit [--warmup W]] [--test]
        [--init WEIGHTS.safetensors] [--predict N] [--threads 1] [--ddp 2]

The model: model(args) of the file after keras.backend.clear_session() and
keras.utils.set_random_seed(S % 2**32), as trainerd builds it, so that the initial weights are
trainerd's; with --init, the weights of `trainerd ckpt export` assigned to its variables by path
(the README's one-liner).

The data: the training split's images as float32 [N, 28, 28, 1] in [0, 1] (one float32 division by
255 per pixel, as trainerd scales them), channels-last as Keras takes them; labels int64. Step s
trains on the rows ORDER.json lists s-th (trainerd's global batch, from --log-examples; [file,
row] ids of `trainerd data convert`'s Parquet, named by --parquet, are the same rows), or on rows
s*B .. s*B+B-1.

Without --fit, each step is model.train_on_batch (the train step fit runs, its loss that of the
step alone), and the losses are written. With --fit, the steps' rows are laid out in order and
model.fit(x, y, batch_size, shuffle=False) trains on them; the rate (examples/s) leaves out the
first W steps. With --ddp 2, two processes (gloo on 127.0.0.1) train the model wrapped in PyTorch's
DistributedDataParallel, each on its half of every global batch of B, with Keras's loss and
Keras's optimizer as Keras's own torch train step applies them.

Writes JSON: {"losses": [...], "seconds": training time, "rate": examples/s, "test": {"loss",
"accuracy"} with --test (model.evaluate on the test split), "predictions": the first N test
images' outputs with --predict N}.
"""
import os
import sys

os.environ["KERAS_BACKEND"] = "torch"
# This directory holds tokenize.py, which shadows the standard library's `tokenize`.
_here = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _here]

import argparse
import gzip
import importlib.util
import json
import socket
import time

import numpy as np


def load_module(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_split(data, split):
    """(images float32 [N, 28, 28, 1] in [0, 1], labels int64 [N]) of an MNIST-format directory."""
    prefix = {"train": "train", "test": "t10k"}[split]
    with gzip.open(os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8).astype(np.int64)
    images = images.reshape(-1, 28, 28, 1).astype(np.float32) / np.float32(255.0)
    return images, labels


def build(a):
    """The file's model as trainerd builds it, and the weights of --init over it."""
    import keras

    mod = load_module(a.module)
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(a.seed % 2**32)
    with keras.device("cpu"):
        model = mod.model(dict(getattr(mod, "arguments", {})))
    if a.init:
        from safetensors.numpy import load_file

        w = load_file(a.init)
        # The README's one-liner: every variable the export holds, by its path.
        [v.assign(w[v.path]) for v in model.variables if v.path in w]
    return model


def parquet_offsets(data):
    """The first row number of each training file of the Parquet dataset `data` (file-name order)."""
    import pyarrow.parquet as pq

    files = sorted(n for n in os.listdir(data) if n.startswith("train") and n.endswith(".parquet"))
    counts = [pq.ParquetFile(os.path.join(data, n)).metadata.num_rows for n in files]
    return [sum(counts[:i]) for i in range(len(counts))]


def orders(a, rows):
    if a.order:
        with open(a.order) as f:
            order = json.load(f)[: a.steps]
        if order and order[0] and isinstance(order[0][0], list):
            # [file, row] ids of a Parquet run's --log-examples (`trainerd data convert`'s files, whose
            # rows are the MNIST-format files' in order).
            if not a.parquet:
                raise SystemExit("keras_fit.py: --order lists [file, row] ids: give --parquet DIR, their dataset")
            offsets = parquet_offsets(a.parquet)
            order = [[offsets[f] + r for f, r in step] for step in order]
        if len(order) < a.steps:
            raise SystemExit(f"keras_fit.py: {a.order} lists {len(order)} steps, fewer than --steps {a.steps}")
        return order
    return [[(s * a.batch + j) % rows for j in range(a.batch)] for s in range(a.steps)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_rank(rank, world, a, port, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build(a)
    x, y = load_split(a.data, "train")
    order = orders(a, len(y))
    net = torch.nn.parallel.DistributedDataParallel(model)
    trainable = model.trainable_weights
    half = len(order[0]) // world

    def step(rows):
        rows = rows[rank * half:(rank + 1) * half]
        xb, yb = torch.from_numpy(x[rows]), torch.from_numpy(y[rows])
        model.zero_grad()
        out = net(xb, training=True)
        loss = model.compute_loss(x=xb, y=yb, y_pred=out, training=True)
        loss.backward()
        # As Keras's own torch train step applies them.
        with torch.no_grad():
            model.optimizer.apply([v.value.grad for v in trainable], trainable)
        return loss

    for rows in order[: a.warmup]:
        step(rows)
    dist.barrier()
    began = time.perf_counter()
    for rows in order[a.warmup:]:
        loss = step(rows)
    dist.barrier()
    seconds = time.perf_counter() - began
    if rank == 0:
        timed = len(order) - a.warmup
        with open(out, "w") as f:
            json.dump({"rate": timed * len(order[0]) / seconds, "seconds": seconds, "loss": loss.item()}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--order", help="JSON list of each step's rows (numbers, or [file, row] ids with --parquet)")
    p.add_argument("--parquet", help="the Parquet dataset whose [file, row] ids --order lists")
    p.add_argument("--batch", type=int, default=64, help="rows per step without --order")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--fit", action="store_true")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--test", action="store_true")
    p.add_argument("--init")
    p.add_argument("--predict", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ddp", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    if a.ddp:
        import torch.multiprocessing as mp

        mp.spawn(ddp_rank, args=(a.ddp, a, free_port(), a.out), nprocs=a.ddp)
        print(open(a.out).read())
        return
    model = build(a)
    result = {}
    if a.steps:
        x, y = load_split(a.data, "train")
        order = orders(a, len(y))
        if a.fit:
            import keras

            rows = np.concatenate([np.asarray(r) for r in order])
            marks = {}

            class Clock(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    if batch + 1 in (a.warmup, len(order)):
                        marks[batch + 1] = time.perf_counter()

            began = time.perf_counter()
            model.fit(x[rows], y[rows], batch_size=len(order[0]), shuffle=False, epochs=1, verbose=0,
                      callbacks=[Clock()])
            result["seconds"] = time.perf_counter() - began
            result["rate"] = (len(order) - a.warmup) * len(order[0]) / (marks[len(order)] - marks[a.warmup])
        else:
            losses = []
            began = time.perf_counter()
            for rows in order:
                out = model.train_on_batch(x[rows], y[rows])
                losses.append(float(out[0] if isinstance(out, (list, tuple)) else out))
            result["seconds"] = time.perf_counter() - began
            result["losses"] = losses
    if a.test or a.predict:
        tx, ty = load_split(a.data, "test")
        if a.test:
            values = model.evaluate(tx, ty, batch_size=500, verbose=0, return_dict=True)
            result["test"] = {k: float(v) for k, v in values.items()}
        if a.predict:
            result["predictions"] = np.asarray(model.predict(tx[: a.predict], verbose=0)).tolist()
    with open(a.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("losses", "predictions")}))


if __name__ == "__main__":
    main()
