"""trainerd's packing rule in a few lines of Python, with Hugging Face's `tokenizers`: the
reference that trainerd's blocks are tested against, and what a PyTorch peer trains on.

    python pack.py --data DIR --split train|test --length LEN --out FILE [--tokenizer FILE]
        [--column text] [--eos-token TOKEN]

The split's files (DIR/<split>-*.parquet, or DIR/<split>.parquet; the test split is the
validation split where DIR has no test files) in name order, rows in file order. Each document
is tokenized without special tokens and followed by the end-of-text token (--eos-token, else the
first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|im_end|> the tokenizer has); empty
documents (no tokens; a null is one) are skipped and counted; the stream is cut into blocks of
LEN tokens and the last partial block dropped.

Writes the blocks to FILE as little-endian uint32 (blocks x LEN), and prints the counts as JSON.
"""
import argparse
import json
import os

import numpy as np
import pyarrow.parquet as pq
from tokenizers import Tokenizer

EOS_TOKENS = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>"]


def split_files(data, split):
    names = sorted(os.listdir(data))
    for name in [split] + (["validation"] if split == "test" else []):
        files = [f for f in names if f.endswith(".parquet") and (f.startswith(name + "-") or f == name + ".parquet")]
        if files:
            return files
    raise SystemExit(f"pack.py: no {split} files in {data}")


def pack(data, split, length, tokenizer=None, column="text", eos_token=None):
    """(blocks as a uint32 array [n, length], counts)."""
    tok = Tokenizer.from_file(tokenizer or os.path.join(data, "tokenizer.json"))
    if eos_token is not None:
        eos = tok.token_to_id(eos_token)
    else:
        eos = next(i for i in (tok.token_to_id(t) for t in EOS_TOKENS) if i is not None)
    stream, documents, empty = [], 0, 0
    for name in split_files(data, split):
        texts = pq.read_table(os.path.join(data, name), columns=[column]).column(column).to_pylist()
        for encoding in tok.encode_batch([t or "" for t in texts], add_special_tokens=False):
            if not encoding.ids:
                empty += 1
                continue
            documents += 1
            stream.extend(encoding.ids)
            stream.append(eos)
    n = len(stream) // length
    blocks = np.asarray(stream[: n * length], dtype="<u4").reshape(n, length)
    return blocks, {"documents": documents, "empty": empty, "tokens": len(stream), "blocks": n}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="train")
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer")
    p.add_argument("--column", default="text")
    p.add_argument("--eos-token")
    a = p.parse_args()
    blocks, counts = pack(a.data, a.split, a.length, a.tokenizer, a.column, a.eos_token)
    blocks.tofile(a.out)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
