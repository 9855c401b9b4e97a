#!/usr/bin/env python3
"""Writes a synthetic dataset whose size is the point, with pyarrow, in Hugging Face's file layout:
{out}/train-{i:05d}-of-{n:05d}.parquet and {out}/test-00000-of-00001.parquet, each row a
`pixels` column (fixed_size_list<float>[784]: a 28x28 image as floats) and an int64 `label`.

The pixels are noise drawn with a fixed seed, and the files are written uncompressed, so the bytes
on disk are what a reader must hold: a dataset several times larger than a memory bound is
`--rows` times 3,136 bytes. The label is a function of the pixels (the class of the brightest of
ten bands), so a model can learn it.

  scripts/setup.sh --tests --no-build      # pyarrow, in the PyTorch virtualenv
  ~/.cache/trainerd/venv-torch-2.13.0/bin/python scripts/synthetic_parquet.py --rows 200000 --out /tmp/big   # about 630 MB

Train on it with a plugin that declares these columns, e.g. the test fixture (built by
`cargo build --release -p test-fixture`; the main job builds only mnist-cnn):
  TRAINERD_FIXTURE_COLUMNS='[{"name":"pixels","decode":{"kind":"numbers","shape":[1,28,28]}},
                             {"name":"label","decode":{"kind":"integer"}}]' \\
  trainerd run --plugin target/release/libtest_fixture.so --data /tmp/big
"""

import argparse
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


def table(rows: int, rng: np.random.Generator) -> pa.Table:
    pixels = rng.random((rows, 784), dtype=np.float32)
    bands = pixels[:, :780].reshape(rows, 10, 78).sum(axis=2)
    label = bands.argmax(axis=1).astype(np.int64)
    values = pa.array(pixels.reshape(-1), type=pa.float32())
    return pa.table({"pixels": pa.FixedSizeListArray.from_arrays(values, 784), "label": label})


def write(split: str, rows: int, files: int, row_group: int, out: str, rng: np.random.Generator) -> None:
    per_file = -(-rows // files)
    for i in range(files):
        n = min(per_file, rows - i * per_file)
        path = os.path.join(out, f"{split}-{i:05d}-of-{files:05d}.parquet")
        with pq.ParquetWriter(path, table(1, rng).schema, compression="none", use_dictionary=False) as w:
            for start in range(0, n, row_group):
                w.write_table(table(min(row_group, n - start), rng), row_group_size=row_group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, required=True, help="training rows")
    p.add_argument("--test-rows", type=int, default=2000)
    p.add_argument("--files", type=int, default=4, help="training files")
    p.add_argument("--row-group", type=int, default=1024, help="rows per row group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    write("train", a.rows, a.files, a.row_group, a.out, rng)
    write("test", a.test_rows, 1, a.row_group, a.out, rng)


if __name__ == "__main__":
    main()
