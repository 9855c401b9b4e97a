"""A small language-model dataset for trainerd's Python model plugin, from text every Debian
machine has (/usr/share/common-licenses: the GPL, Apache, MPL, ... about 240 KB of distinct text).

    python tokenize.py --out DIR [--corpus PATH ...] [--tokenizer bpe|bytes] [--vocab N]
        [--length LEN] [--test-fraction F] [--train-shards K] [--rows-per-group R] [--raw]

With --raw, the documents themselves go in (a `text` column, one row per document, as Hugging
Face's text datasets hold them; document i to the test split when floor((i + 1) * F) >
floor(i * F)) beside the tokenizer.json, for trainerd to tokenize and pack at the model's length.

Documents: the corpus' files (a directory stands for the files directly in it; symbolic links
followed), in the order of their resolved paths, each once by content. Each is encoded and
followed by the end-of-text id; the whole stream is cut into blocks of LEN tokens (the tail that
does not fill a block is dropped), and block i goes to the test split when
floor((i + 1) * F) > floor(i * F) (F = 0.1: every tenth block), to the training split otherwise.

Ids: 0 is `<pad>` (what trainerd pads `tokens:LEN` columns with; never in the data), 1 is
`<|endoftext|>`. `bpe` (the default): a byte-level BPE (Hugging Face `tokenizers`, GPT-2's
pre-tokenization) trained on the corpus to --vocab ids (default 512): 2 + 256 bytes + merges.
`bytes`: each byte b is id b + 2 (258 ids; --vocab is ignored).

Writes, in Hugging Face's Parquet layout as trainerd reads it (files directly in DIR):
DIR/train-0000i-of-0000K.parquet and DIR/test-00000-of-00001.parquet with one column
`input_ids: list<int64>` (every row exactly LEN ids), DIR/tokenizer.json (loadable with
`tokenizers.Tokenizer.from_file`) and DIR/meta.json (sizes, counts, the documents' sha256).
The output is byte-for-byte the same on every run with the same corpus and package versions.

This file is named like the standard library's `tokenize` module, which torch, transformers and
linecache import. Run as a script, its directory comes first on sys.path, so it takes its own
directory off the path before importing anything; imported as `tokenize` (another script in this
directory, or a host that put the directory first on sys.path), it replaces itself with the
standard library's module.
"""
import sys

if __name__ == "tokenize":
    # `import tokenize` found this file instead of the standard library's: become that module.
    # (The import system returns what sys.modules holds under the name after this file runs.)
    import importlib.util as _util
    import os as _os

    _spec = _util.spec_from_file_location("tokenize", _os.path.join(_os.path.dirname(_os.__file__), "tokenize.py"))
    _stdlib = _util.module_from_spec(_spec)
    sys.modules["tokenize"] = _stdlib
    _spec.loader.exec_module(_stdlib)
elif __name__ == "__main__":
    # Before anything imports the standard library's `tokenize`, take this directory off the path.
    import os as _os

    _here = _os.path.dirname(_os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if _os.path.realpath(p or _os.getcwd()) != _here]

import argparse
import hashlib
import json
import os
from fractions import Fraction

DEFAULT_CORPUS = "/usr/share/common-licenses"
DEFAULT_VOCAB = 512
DEFAULT_LENGTH = 128
DEFAULT_TEST_FRACTION = "0.1"
PAD, EOT = "<pad>", "<|endoftext|>"


def documents(paths):
    """(name, bytes) of each distinct document under `paths`, in the order of their resolved
    paths."""
    files = set()
    for path in paths:
        if os.path.isdir(path):
            for name in os.listdir(path):
                full = os.path.join(path, name)
                if os.path.isfile(full):
                    files.add(os.path.realpath(full))
        elif os.path.isfile(path):
            files.add(os.path.realpath(path))
        else:
            raise SystemExit(f"tokenize.py: no such file or directory: {path}")
    seen, docs = set(), []
    for f in sorted(files):
        with open(f, "rb") as fh:
            data = fh.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen or not data:
            continue
        seen.add(digest)
        docs.append((f, data))
    if not docs:
        raise SystemExit("tokenize.py: the corpus holds no text")
    return docs


def byte_tokenizer():
    """A tokenizer whose ids are the bytes plus 2 (0 and 1 the special tokens), in
    `tokenizers`' format: a byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel's alphabet: the printable stand-in character of each byte, as GPT-2 maps them.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    stand_in, extra = {}, 0
    for b in range(256):
        if b in printable:
            stand_in[b] = chr(b)
        else:
            stand_in[b] = chr(256 + extra)
            extra += 1
    assert sorted(stand_in.values()) == sorted(ByteLevel.alphabet())
    vocab = {PAD: 0, EOT: 1}
    vocab.update({stand_in[b]: b + 2 for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, EOT])
    return tok


def bpe_tokenizer(texts, vocab_size):
    """A byte-level BPE of `vocab_size` ids trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[PAD, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_parquet(path, blocks, rows_per_group):
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = pa.array([t for b in blocks for t in b], type=pa.int64())
    offsets = pa.array([i * (len(blocks[0]) if blocks else 0) for i in range(len(blocks) + 1)], type=pa.int32())
    column = pa.ListArray.from_arrays(offsets, flat, type=pa.list_(pa.int64()))
    table = pa.Table.from_arrays([column], names=["input_ids"])
    pq.write_table(table, path, row_group_size=rows_per_group, compression="snappy")


def write_text(path, texts, rows_per_group):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_arrays([pa.array(texts, type=pa.string())], names=["text"])
    pq.write_table(table, path, row_group_size=rows_per_group, compression="snappy")


def write_raw(out, tok, texts, fraction, a):
    """The documents as a text column, split by document, and the tokenizer beside them."""
    test = [t for i, t in enumerate(texts) if (i + 1) * fraction // 1 > i * fraction // 1]
    train = [t for i, t in enumerate(texts) if not (i + 1) * fraction // 1 > i * fraction // 1]
    if not train or not test:
        raise SystemExit(f"tokenize.py: {len(texts)} documents leave a split empty at --test-fraction {fraction}")
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if old.endswith(".parquet") and (old.startswith("train") or old.startswith("test")):
            os.remove(os.path.join(out, old))
    shards = min(a.train_shards, len(train))
    per = -(-len(train) // shards)
    for k in range(shards):
        write_text(os.path.join(out, f"train-{k:05}-of-{shards:05}.parquet"), train[k * per:(k + 1) * per],
                   a.rows_per_group)
    write_text(os.path.join(out, "test-00000-of-00001.parquet"), test, a.rows_per_group)
    tok.save(os.path.join(out, "tokenizer.json"), pretty=True)
    print(json.dumps({"tokenizer": a.tokenizer, "vocab_size": tok.get_vocab_size(), "documents":
                      {"train": len(train), "test": len(test)}, "bytes": sum(len(t.encode()) for t in texts)}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the dataset's directory (made if missing)")
    p.add_argument("--corpus", nargs="+", action="extend", help=f"files or directories (default {DEFAULT_CORPUS})")
    p.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help=f"BPE ids in all (default {DEFAULT_VOCAB})")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH, help=f"tokens per row (default {DEFAULT_LENGTH})")
    p.add_argument("--test-fraction", default=DEFAULT_TEST_FRACTION, help="share of blocks in the test split")
    p.add_argument("--train-shards", type=int, default=1, help="training split's files (default 1)")
    p.add_argument("--rows-per-group", type=int, default=100, help="Parquet row group size (default 100)")
    p.add_argument("--raw", action="store_true", help="write the documents' text, not token rows")
    a = p.parse_args()
    fraction = Fraction(a.test_fraction)
    if not 0 <= fraction < 1:
        raise SystemExit("tokenize.py: --test-fraction must be in [0, 1)")
    if a.length < 2 or a.train_shards < 1 or a.rows_per_group < 1:
        raise SystemExit("tokenize.py: --length must be at least 2, --train-shards and --rows-per-group at least 1")

    import tokenizers

    docs = documents(a.corpus or [DEFAULT_CORPUS])
    texts = [data.decode("utf-8") for _, data in docs]
    if a.tokenizer == "bpe":
        if a.vocab < 259:
            raise SystemExit("tokenize.py: --vocab must be at least 259 (2 special ids, 256 bytes, a merge)")
        tok = bpe_tokenizer(texts, a.vocab)
    else:
        tok = byte_tokenizer()
    assert tok.token_to_id(PAD) == 0 and tok.token_to_id(EOT) == 1
    vocab = tok.get_vocab_size()
    if a.raw:
        write_raw(a.out, tok, texts, fraction, a)
        return

    stream, described = [], []
    for (name, data), text in zip(docs, texts):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert 0 not in ids and 1 not in ids
        assert tok.decode(ids) == text, f"{name} does not round-trip"
        if a.tokenizer == "bytes":
            assert ids == [b + 2 for b in data]
        stream.extend(ids)
        stream.append(1)
        described.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                          "tokens": len(ids)})
    n = len(stream) // a.length
    blocks = [stream[i * a.length:(i + 1) * a.length] for i in range(n)]
    test = [b for i, b in enumerate(blocks) if (i + 1) * fraction // 1 > i * fraction // 1]
    train = [b for i, b in enumerate(blocks) if not (i + 1) * fraction // 1 > i * fraction // 1]
    if not train or not test:
        raise SystemExit(f"tokenize.py: {n} blocks of {a.length} tokens leave a split empty")

    os.makedirs(a.out, exist_ok=True)
    for old in os.listdir(a.out):
        if old.endswith(".parquet") and (old.startswith("train") or old.startswith("test")):
            os.remove(os.path.join(a.out, old))
    shards = min(a.train_shards, len(train))
    per = -(-len(train) // shards)
    files = []
    for k in range(shards):
        name = f"train-{k:05}-of-{shards:05}.parquet"
        write_parquet(os.path.join(a.out, name), train[k * per:(k + 1) * per], a.rows_per_group)
        files.append(name)
    write_parquet(os.path.join(a.out, "test-00000-of-00001.parquet"), test, a.rows_per_group)
    files.append("test-00000-of-00001.parquet")
    tok.save(os.path.join(a.out, "tokenizer.json"), pretty=True)

    meta = {
        "tokenizer": a.tokenizer,
        "tokenizers_version": tokenizers.__version__,
        "vocab_size": vocab,
        "pad_id": 0,
        "eot_id": 1,
        "length": a.length,
        "test_fraction": str(fraction),
        "tokens": len(stream),
        "dropped_tokens": len(stream) - n * a.length,
        "blocks": {"train": len(train), "test": len(test)},
        "bytes_per_token": round(sum(d["bytes"] for d in described) / (len(stream) - len(docs)), 4),
        "files": files,
        "documents": [dict(d, name=os.path.basename(d["name"])) for d in described],
    }
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(json.dumps({k: meta[k] for k in ("tokenizer", "vocab_size", "length", "tokens", "blocks",
                                           "bytes_per_token")}))


if __name__ == "__main__":
    main()
