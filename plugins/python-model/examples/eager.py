"""Plain PyTorch eager training of a Python model file, as trainerd's Python model plugin runs
it: the reference that trainerd's losses are compared against, and a benchmark.

    python eager.py --module FILE [--arg KEY=VALUE ...] --data DIR --seed S [--init-seed S0]
        [--init WEIGHTS.safetensors] --batch B --lr LR --steps N [--order ORDER.json]
        --out RESULT.json [--test] [--threads 1] [--device cpu]

The module: torch's default generator seeded with --init-seed (default --seed, as trainerd seeds
it with the run's seed) just before model(args), where args are the file's `arguments` defaults
updated by --arg (strings, as trainerd passes --plugin-arg); with --init, those initial weights
(and buffers) loaded over it as plain PyTorch loads trainerd's export:
module.load_state_dict(safetensors.torch.load_file(PATH)).

The data: the training split's rows in file-name order, rows in file order, numbered from 0 (the
Parquet files directly in DIR: train-0000i-of-0000n.parquet or train.parquet), or, for a file
that declares no columns, an MNIST-format directory (train-images-idx3-ubyte.gz, ...) as well.
Step s trains on the rows ORDER.json lists s-th (a JSON list of lists of row numbers); without
--order, on rows s*B .. s*B+B-1 (mod the split's rows). Each batch is built as trainerd builds
it: a dict of column name -> tensor, `tokens:LEN` columns int64 [B, LEN] padded with 0 at the end
or cut at the end, `attention_mask` (1 for the row's own tokens, 0 for padding) added when a
tokens column is declared and no attention_mask column, images float32 [B, C, H, W] in [0, 1].

Each step: the generator seeded as trainerd seeds it before a step (SplitMix64 of the seed and
the step's number, see step_seed), the file's loss (or the default: cross-entropy of the module
on the one non-label column against `label`), backward, torch.optim.Adam(lr, betas (0.9, 0.999),
eps 1e-8). One thread and deterministic algorithms by default.

Writes JSON: {"losses": [each step's loss], "seconds": training time, "test": {"loss": ...,
metric: ...} with --test (the test split, the module in eval mode, means over examples)}.
"""
import os
import sys

# This directory holds tokenize.py, which shadows the standard library's `tokenize` (which torch
# imports) when the directory is first on sys.path: take it off.
_here = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _here]
# cuBLAS needs this for deterministic results under torch.use_deterministic_algorithms.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse
import gzip
import importlib.util
import inspect
import io
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

LABEL = "label"
ATTENTION_MASK = "attention_mask"
MASK64 = (1 << 64) - 1


def step_seed(seed, global_step):
    """The seed of the generator before `global_step` (0 for the first) of a run seeded `seed`,
    on the first replica: trainerd's SplitMix64 (daemon/src/state/position.rs), as an unsigned
    64-bit value (the same bits as trainerd's i64)."""
    z = (seed ^ (global_step * 0x9E3779B97F4A7C15)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def load_module_file(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "model", None)):
        raise SystemExit(f"eager.py: {path} defines no model(args)")
    return mod


def parse_args_for(mod, pairs):
    """The file's `arguments` defaults updated by KEY=VALUE pairs (unknown keys refused when the
    file declares `arguments`)."""
    declared = getattr(mod, "arguments", None)
    args = dict(declared or {})
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"eager.py: --arg {pair!r}: expected KEY=VALUE")
        if declared is not None and key not in declared:
            raise SystemExit(f"eager.py: --arg {key}: the file accepts {', '.join(sorted(declared)) or 'no arguments'}")
        args[key] = value
    return args


# ---- columns ----

def parse_kind(spec):
    """(kind, sizes) of a column declaration: integer, number, numbers:AxB, tokens:LEN,
    image:CxHxW."""
    kind, _, size = spec.strip().partition(":")
    kind, size = kind.strip(), size.strip()
    dims = [int(d) for d in size.split("x")] if size else []
    if (kind in ("integer", "number") and not size) or (kind == "numbers" and dims) or (
            kind == "tokens" and len(dims) == 1 and dims[0] > 0) or (kind == "image" and len(dims) == 3):
        return kind, dims
    raise SystemExit(f"eager.py: column kind {spec!r}: expected integer, number, numbers:N, tokens:LEN or image:CxHxW")


def decode_image(value, c, h, w):
    from PIL import Image

    data = value["bytes"] if isinstance(value, dict) else value
    img = Image.open(io.BytesIO(data))
    img = img.convert("L" if c == 1 else "RGB")
    if img.size != (w, h):
        raise SystemExit(f"eager.py: an image of {img.size[0]}x{img.size[1]}, declared {w}x{h}")
    pixels = np.asarray(img, dtype=np.uint8).reshape(h, w, c).transpose(2, 0, 1)
    return pixels


class Split:
    """One split's rows, column by column (Python values), and how to batch them."""

    def __init__(self, columns, values, rows):
        self.columns, self.values, self.rows = columns, values, rows

    def batch(self, rows, device):
        out = {}
        masked = None
        if ATTENTION_MASK not in self.columns:
            masked = next((n for n, (k, _) in self.columns.items() if k == "tokens"), None)
        for name, (kind, dims) in self.columns.items():
            vals = [self.values[name][r] for r in rows]
            if kind == "integer":
                t = torch.tensor([int(v) for v in vals], dtype=torch.int64)
            elif kind == "number":
                t = torch.tensor(np.asarray(vals, dtype=np.float32))
            elif kind == "numbers":
                t = torch.from_numpy(np.asarray(vals, dtype=np.float32).reshape(len(rows), *dims))
            elif kind == "tokens":
                length = dims[0]
                ids = np.zeros((len(rows), length), dtype=np.int64)
                mask = np.zeros((len(rows), length), dtype=np.int64)
                for i, v in enumerate(vals):
                    kept = list(v)[:length]
                    ids[i, :len(kept)] = kept
                    mask[i, :len(kept)] = 1
                t = torch.from_numpy(ids)
                if name == masked:
                    out[ATTENTION_MASK] = torch.from_numpy(mask)
            else:  # image, or the MNIST-format pixels as uint8 [C, H, W]
                c, h, w = dims
                pixels = np.stack([v if isinstance(v, np.ndarray) else decode_image(v, c, h, w) for v in vals])
                # One correctly rounded float32 division per pixel, as trainerd scales them.
                t = torch.from_numpy(pixels.astype(np.float32) / np.float32(255.0))
            out[name] = t
        # The batch in the declared order, the derived mask after its tokens column.
        ordered = {}
        for name in self.columns:
            ordered[name] = out[name].to(device)
            if name == masked:
                ordered[ATTENTION_MASK] = out[ATTENTION_MASK].to(device)
        return ordered


def parquet_files(data, split):
    names = sorted(os.listdir(data))
    files = [n for n in names if n.endswith(".parquet") and (n.startswith(split + "-") or n == split + ".parquet")]
    if split == "test" and not files:
        files = [n for n in names if n.endswith(".parquet") and
                 (n.startswith("validation-") or n == "validation.parquet")]
    return [os.path.join(data, n) for n in files]


def load_split(data, split, columns):
    """The split's rows: from Parquet when DIR holds any, else (MNIST-format data, no columns
    declared) the idx files."""
    import pyarrow.parquet as pq

    files = parquet_files(data, split)
    if files:
        values = {name: [] for name in columns}
        for f in files:
            table = pq.read_table(f, columns=list(columns))
            for name in columns:
                values[name].extend(table.column(name).to_pylist())
        return Split(columns, values, len(values[next(iter(columns))]))
    prefix = {"train": "train", "test": "t10k"}[split]
    path = os.path.join(data, f"{prefix}-images-idx3-ubyte.gz")
    if not os.path.exists(path):
        raise SystemExit(f"eager.py: {data} holds no {split} Parquet files and no MNIST-format {prefix} files")
    with gzip.open(path) as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16)
    with gzip.open(os.path.join(data, f"{prefix}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    n = labels.shape[0]
    images = images.reshape(n, 1, 28, 28)
    return Split(columns, {"image": list(images), LABEL: [int(x) for x in labels]}, n)


# ---- the file's functions, or trainerd's defaults ----

def input_column(columns):
    inputs = [n for n in columns if n != LABEL]
    if len(inputs) != 1:
        raise SystemExit(f"eager.py: the default loss, metrics and predict need one input column besides "
                         f"{LABEL!r}; the file declares {list(columns)}")
    return inputs[0]


def make_loss(mod, columns):
    if hasattr(mod, "loss"):
        return mod.loss
    x = input_column(columns)
    return lambda module, batch: F.cross_entropy(module(batch[x]), batch[LABEL])


def split_loss(value):
    """(loss, outputs or None): a file's loss may return (loss, outputs) for its metrics."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return value[0], value[1]
    return value, None


def make_metrics(mod, columns):
    if hasattr(mod, "metrics"):
        params = inspect.signature(mod.metrics).parameters
        if len(params) >= 3:
            return lambda module, batch, outputs=None: mod.metrics(module, batch, outputs)
        return lambda module, batch, outputs=None: mod.metrics(module, batch)
    if hasattr(mod, "loss"):
        return lambda module, batch, outputs=None: {}
    x = input_column(columns)
    return lambda module, batch, outputs=None: {"accuracy": (module(batch[x]).argmax(-1) == batch[LABEL]).sum().to(torch.float32)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", required=True, help="the model file")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE", help="as --plugin-arg")
    p.add_argument("--data", required=True)
    p.add_argument("--seed", type=int, required=True, help="the run's seed")
    p.add_argument("--init-seed", type=int, help="the generator's seed before model(args) (default --seed)")
    p.add_argument("--init", help="initial weights (safetensors), loaded over the built module")
    p.add_argument("--batch", type=int, default=32, help="rows per step without --order; test batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--order", help="JSON list of lists of training row numbers, one list per step")
    p.add_argument("--out", required=True)
    p.add_argument("--test", action="store_true", help="evaluate the test split after training")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    device = torch.device(a.device)

    mod = load_module_file(a.module)
    args = parse_args_for(mod, a.arg)
    declared = getattr(mod, "columns", None)
    if callable(declared):
        declared = declared(args)
    if declared:
        columns = {name: parse_kind(spec) for name, spec in declared.items()}
    else:
        columns = {"image": ("image", [1, 28, 28]), LABEL: ("integer", [])}

    torch.manual_seed(a.seed if a.init_seed is None else a.init_seed)
    module = mod.model(args)
    if a.init:
        from safetensors.torch import load_file

        module.load_state_dict(load_file(a.init))
    module.to(device)
    loss_fn, metrics_fn = make_loss(mod, columns), make_metrics(mod, columns)

    train = load_split(a.data, "train", columns)
    if a.order:
        with open(a.order) as f:
            order = json.load(f)
        if len(order) < a.steps:
            raise SystemExit(f"eager.py: {a.order} lists {len(order)} steps, fewer than --steps {a.steps}")
    else:
        order = [[(s * a.batch + j) % train.rows for j in range(a.batch)] for s in range(a.steps)]

    opt = torch.optim.Adam(module.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    module.train()
    losses = []
    started = time.perf_counter()
    for step in range(a.steps):
        batch = train.batch(order[step], device)
        torch.manual_seed(step_seed(a.seed, step))
        opt.zero_grad(set_to_none=True)
        loss, _ = split_loss(loss_fn(module, batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - started
    result = {"losses": losses, "seconds": round(seconds, 3)}

    if a.test:
        test = load_split(a.data, "test", columns)
        module.eval()
        totals, examples = {}, 0
        with torch.no_grad():
            for start in range(0, test.rows, a.batch):
                rows = list(range(start, min(start + a.batch, test.rows)))
                batch = test.batch(rows, device)
                loss, outputs = split_loss(loss_fn(module, batch))
                totals["loss"] = totals.get("loss", 0.0) + loss.item() * len(rows)
                for k, v in metrics_fn(module, batch, outputs).items():
                    totals[k] = totals.get(k, 0.0) + v.item()
                examples += len(rows)
        result["test"] = {k: v / examples for k, v in totals.items()}
        result["test"]["examples"] = examples

    with open(a.out, "w") as f:
        json.dump(result, f)
    summary = {"steps": len(losses), "first_loss": losses[:1], "last_loss": losses[-1:], "seconds": result["seconds"]}
    if "test" in result:
        summary["test"] = result["test"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
