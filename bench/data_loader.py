#!/usr/bin/env python3
"""The peer of trainerd's input pipeline: PyTorch's DataLoader over Parquet files in Hugging Face's
layout, as a PyTorch user writes it: an IterableDataset whose workers split the row groups
(shuffled per epoch), read them with pyarrow's `iter_batches`, decode each PNG with PIL into a
float tensor in [0, 1] of shape [1, 28, 28], and shuffle through a buffer; the DataLoader batches
them. No model: the figure is examples per second delivered to the training loop.

Usage: data_loader.py DIR WORKERS EPOCHS [BATCH] [BUFFER]
Prints: examples_per_s=N examples=N seconds=S
"""
import glob
import io
import os
import random
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class ParquetImages(IterableDataset):
    def __init__(self, directory, epoch, buffer, seed=0):
        self.files = sorted(glob.glob(os.path.join(directory, "train-*.parquet")))
        self.groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        self.epoch, self.buffer, self.seed = epoch, buffer, seed

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        torch.set_num_threads(1)
        rng = random.Random(self.seed * 100003 + self.epoch)
        groups = list(self.groups)
        rng.shuffle(groups)
        mine = groups[worker::workers]
        buffer = []
        for path in self.files:
            row_groups = [g for f, g in mine if f == path]
            if not row_groups:
                continue
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, row_groups=row_groups,
                                                           columns=["image", "label"]):
                images = batch.column("image").field("bytes").to_pylist()
                labels = batch.column("label").to_pylist()
                for png, label in zip(images, labels):
                    pixels = np.asarray(Image.open(io.BytesIO(png)), dtype=np.float32) / 255.0
                    buffer.append((torch.from_numpy(pixels).unsqueeze(0), label))
                    if len(buffer) >= self.buffer:
                        i = rng.randrange(len(buffer))
                        buffer[i], buffer[-1] = buffer[-1], buffer[i]
                        yield buffer.pop()
        rng.shuffle(buffer)
        yield from buffer


def main():
    directory, workers, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    buffer = int(sys.argv[5]) if len(sys.argv) > 5 else 10_000
    torch.set_num_threads(1)
    examples = 0
    started = time.perf_counter()
    for epoch in range(epochs):
        loader = DataLoader(ParquetImages(directory, epoch, buffer), batch_size=batch, num_workers=workers)
        for xs, ys in loader:
            examples += xs.shape[0]
    seconds = time.perf_counter() - started
    print(f"examples_per_s={examples / seconds:.0f} examples={examples} seconds={seconds:.2f}")


if __name__ == "__main__":
    main()
