#!/usr/bin/env python3
"""A language model as its users train it, trainerd beside PyTorch, in one session. Two tables:

Training, 2 workers: the GPT example (plugins/python-model/examples/gpt.py, input=text, blocks
of 128) on raw text (the licenses of /usr/share/common-licenses with their 512-id BPE, written by
tokenize.py --raw), AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1 on the parameters of 2 or
more dimensions, none on the others), a warmup over the first 10% of the steps and Hugging
Face's cosine decay:
  - `trainerd local --workers 2` (it tokenizes and packs the text itself);
  - PyTorch DDP (gloo, 2 processes) on the same module, initial weights (torch.manual_seed(seed)
    before model(args), as trainerd seeds it), blocks (pack.py, the packing rule in Python, which a
    test holds equal to trainerd's), order (each step's blocks from trainerd's --log-examples),
    torch.optim.AdamW with the same groups and transformers' get_cosine_schedule_with_warmup;
  - PyTorch eager, 1 process, the same per-process batch.
  Goals: the first 50 losses agree within 1e-5 relative; trainerd's tokens/s at least 1.15x DDP's; with
  --bucket-mb small enough for several buckets, its exposed communication at most 0.25x --overlap off's.
  Scaling efficiency: 2-worker tokens/s over twice the 1-process eager tokens/s, for both.
  Rates: from the end of step 5 to the last: trainerd's by its metrics log's clock (everything
  between steps included), the peers' timed loops; trainerd's summary rate (its first steps
  included) is printed beside.

Input, raw text to packed blocks, 1 loader thread: 708 documents of real text (every
/usr/share/doc/*/copyright, about 17 MB) in Parquet (`text`, row groups of 100), an 8,192-id BPE:
  - `trainerd data read` of the split, its token cache empty (the tokenizing pass, then every
    block of an epoch read);
  - the usual Python recipe: datasets' load_dataset("parquet") and map(tokenize, batched=True)
    with the tokenizer as transformers loads it (PreTrainedTokenizerFast), then run_clm's
    group_texts map (concatenate 1,000 examples, cut into blocks of 1,024), in memory
    (keep_in_memory=True), the tokenizers library held to 1 thread (RAYON_NUM_THREADS=1).
  Goal: trainerd at least 2x the recipe's tokens/s; and trainerd's blocks equal, byte for byte,
  pack.py's.

Usage: bench/lm.sh [--runs N] [--epochs E] [--only train|input]
Environment: TARGET (trainerd and libpython_model.so; default target/release).

Internally `lm.py --peer ddp|eager ...` is the PyTorch side of one training run, and
`lm.py --recipe ...` the datasets recipe (each prints JSON).
"""
import argparse, glob, importlib.util, itertools, json, os, socket, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "plugins", "python-model", "examples")
MODULE = os.path.join(EXAMPLES, "gpt.py")
TARGET = os.environ.get("TARGET", os.path.join(ROOT, "target", "release"))
CACHE = os.environ.get("TRAINERD_CACHE", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                                                      "trainerd"))
TEXT = os.path.join(CACHE, "bench", "lm-licenses-text")
DOCS = os.path.join(CACHE, "bench", "lm-copyrights")
LENGTH, BATCH, LR, BETAS, WD, SEED, WARMUP = 128, 8, 2e-3, (0.9, 0.95), 0.1, 0, 5
INPUT_LENGTH = 1024


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_data():
    """The licenses' raw text (once), and the copyright documents with their tokenizer (once)."""
    if not os.path.exists(os.path.join(TEXT, "tokenizer.json")):
        subprocess.run([sys.executable, os.path.join(EXAMPLES, "tokenize.py"), "--raw", "--out", TEXT + ".partial"],
                       check=True, stdout=subprocess.DEVNULL)
        os.replace(TEXT + ".partial", TEXT)
    if not os.path.exists(os.path.join(DOCS, "tokenizer.json")):
        import pyarrow as pa, pyarrow.parquet as pq
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        texts = []
        for f in sorted(glob.glob("/usr/share/doc/*/copyright")):
            with open(f, "rb") as fh:
                texts.append(fh.read().decode("utf-8", errors="replace"))
        tmp = DOCS + ".partial"
        os.makedirs(tmp, exist_ok=True)
        pq.write_table(pa.table({"text": pa.array(texts[:-8], type=pa.string())}),
                       os.path.join(tmp, "train-00000-of-00001.parquet"), row_group_size=100)
        pq.write_table(pa.table({"text": pa.array(texts[-8:], type=pa.string())}),
                       os.path.join(tmp, "test-00000-of-00001.parquet"), row_group_size=100)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=8192, min_frequency=2, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer=trainer)
        tok.save(os.path.join(tmp, "tokenizer.json"))
        os.replace(tmp, DOCS)


# ---- training ----

def trainerd(workers, epochs, d, extra=()):
    """One trainerd run in `d` with `extra` arguments: (its summary, each step's loss, each
    worker's blocks per step)."""
    head = [os.path.join(TARGET, "trainerd")]
    head += ["local", "--workers", str(workers), "--restart-delay", "0"] if workers > 1 else ["run"]
    cmd = head + ["--plugin", os.path.join(TARGET, "libpython_model.so"), "--plugin-arg", f"module={MODULE}",
                  "--plugin-arg", "input=text", "--plugin-arg", f"context={LENGTH}", "--data", TEXT,
                  "--batch-size", str(BATCH), "--threads", "1", "--epochs", str(epochs), "--seed", str(SEED),
                  "--optimizer", "adamw", "--lr", str(LR), "--adam-beta1", str(BETAS[0]), "--adam-beta2",
                  str(BETAS[1]), "--weight-decay", str(WD), "--warmup-steps", "0.1", "--lr-schedule", "cosine",
                  "--no-evaluation", "--summary", os.path.join(d, "s.json"), "--metrics-log", os.path.join(d, "m.jsonl"),
                  "--log-examples", os.path.join(d, "ex.jsonl"), "--data-cache", os.path.join(d, "cache"), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"trainerd failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    name = (lambda base, w: os.path.join(d, f"{base}.worker{w}.jsonl" if workers > 1 else f"{base}.jsonl"))
    s = json.load(open(os.path.join(d, "s.worker0.json" if workers > 1 else "s.json")))
    lines = [json.loads(l) for l in open(name("m", 0))]
    losses = [l["loss"] for l in lines]
    # As the peers time themselves: from the end of step --warmup to the last, by the metrics
    # log's clock (everything between steps included).
    first, last = lines[WARMUP - 1], lines[-1]
    s["steady"] = (last["global_step"] - first["global_step"]) * workers * BATCH * LENGTH / (last["time"] - first["time"])
    order = [[[i[1] for i in json.loads(l)["ids"]] for l in open(name("ex", w))] for w in range(workers)]
    return s, losses, order


def peer_rank(rank, world, a, port, out):
    import numpy as np, torch, torch.distributed as dist
    from transformers import get_cosine_schedule_with_warmup

    torch.set_num_threads(1)
    if world > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    gpt, pack = load(MODULE, "gpt"), load(os.path.join(EXAMPLES, "pack.py"), "pack")
    blocks = torch.from_numpy(pack.pack(TEXT, "train", LENGTH)[0].astype(np.int64))
    order = json.load(open(a.order))[rank]
    args = dict(gpt.arguments, input="text", context=str(LENGTH))
    torch.manual_seed(SEED)
    net = gpt.model(args)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                            betas=BETAS, eps=1e-8, foreach=False)
    steps = len(order)
    sched = get_cosine_schedule_with_warmup(opt, -(-steps // 10), steps)
    net.train()
    losses, began = [], None
    for s in range(steps):
        if s == a.warmup:
            if world > 1:
                dist.barrier()
            began = time.perf_counter()
        ids = blocks[order[s]]
        opt.zero_grad(set_to_none=True)
        loss = gpt.loss(net, {"input_ids": ids, "labels": ids})[0]
        loss.backward()
        opt.step()
        sched.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    if world > 1:
        dist.barrier()
    seconds = time.perf_counter() - began
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"tokens_per_second": (steps - a.warmup) * world * BATCH * LENGTH / seconds, "losses": losses}, f)
    if world > 1:
        dist.destroy_process_group()


def peer(kind, order, warmup, d):
    path = os.path.join(d, f"order-{kind}.json")
    json.dump(order, open(path, "w"))
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", kind, "--order", path, "--warmup", str(warmup)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise SystemExit(f"the PyTorch {kind} peer failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def peer_main(a):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        if a.peer == "ddp":
            import torch.multiprocessing as mp

            mp.spawn(peer_rank, args=(2, a, free_port(), out), nprocs=2)
        else:
            peer_rank(0, 1, a, 0, out)
        print(open(out).read())


def training(a):
    med = statistics.median
    ours, whole, ddp, eager, worst, exposed = [], [], [], [], [], []
    buckets = ("--bucket-mb", str(a.bucket_mb)) if a.bucket_mb else ()
    for r in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            s, losses, order = trainerd(2, a.epochs, d, buckets)
            ours.append(s["steady"])
            whole.append(s["tokens_per_second"])
            with tempfile.TemporaryDirectory() as d_off:
                off, _, _ = trainerd(2, a.epochs, d_off, (*buckets, "--overlap", "off"))
            exposed.append((s["step_phases"]["exposed_communication_ms"], off["step_phases"]["exposed_communication_ms"],
                            off["steady"]))
            print(f"  run {r + 1}: trainerd's exposed communication per step {exposed[-1][0]:.2f} ms with --overlap on, "
                  f"{exposed[-1][1]:.2f} ms off ({off['steady']:,.0f} tokens/s off)", flush=True)
            theirs = peer("ddp", order, a.warmup, d)
            ddp.append(theirs["tokens_per_second"])
            # 1 process, the same per-process batch and steps: worker 0's blocks.
            eager.append(peer("eager", [order[0]], a.warmup, d)["tokens_per_second"])
        n = min(50, len(losses))
        rel = [abs(x - y) / abs(y) for x, y in zip(losses[:n], theirs["losses"][:n])]
        worst.append(max(rel))
        print(f"  run {r + 1}: trainerd {ours[-1]:,.0f} tokens/s (its summary, the first steps included: "
              f"{whole[-1]:,.0f}), DDP {ddp[-1]:,.0f}, eager (1 process) "
              f"{eager[-1]:,.0f}; first {n} losses within {max(rel):.1e} relative of DDP's "
              f"({losses[0]:.4f} -> {losses[n - 1]:.4f})", flush=True)
    o, t, e = med(ours), med(ddp), med(eager)
    paired = med([x / y for x, y in zip(ours, ddp)])
    steps = len(losses)
    print(f"\nTraining, 2 workers: gpt.py on raw text, blocks of {LENGTH}, batch {BATCH} per worker, {steps} steps, "
          f"AdamW + warmup + cosine, 1 thread per process, median of {a.runs}")
    print("| | tokens/s | vs DDP | scaling efficiency (2 workers / 2 x eager) | first 50 losses vs DDP |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| trainerd (2 workers) | {o:,.0f} | {o / t:.2f}x (goal >= 1.15x: {'met' if o / t >= 1.15 else 'NOT met'}) "
          f"| {o / (2 * e):.2f} | within {max(worst):.1e} (goal 1e-5: {'met' if max(worst) <= 1e-5 else 'NOT met'}) |")
    print(f"| PyTorch DDP, gloo (2 processes) | {t:,.0f} | 1.00x | {t / (2 * e):.2f} | |")
    print(f"| PyTorch eager (1 process) | {e:,.0f} | | | |")
    print(f"the median of each run's ratio (trainerd and DDP run one after the other): {paired:.2f}x")
    on_ms, off_ms = med(x[0] for x in exposed), med(x[1] for x in exposed)
    print(f"trainerd's exposed communication per step (--bucket-mb {a.bucket_mb or 'default, 25'}): {on_ms:.2f} ms with "
          f"--overlap on, {off_ms:.2f} ms off, {on_ms / off_ms:.2f}x (goal <= 0.25x: "
          f"{'met' if on_ms <= 0.25 * off_ms else 'NOT met'}); --overlap off {med(x[2] for x in exposed):,.0f} tokens/s")


# ---- input ----

def recipe_main(a):
    """datasets' map(tokenize) then run_clm's group_texts, in memory; prints tokens/s."""
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    began = time.perf_counter()
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(DOCS, "tokenizer.json"))
    raw = datasets.load_dataset("parquet", data_files={"train": os.path.join(DOCS, "train-*.parquet")},
                                keep_in_memory=True, cache_dir=a.cache)["train"]
    tokenized = raw.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"], keep_in_memory=True)

    def group_texts(examples):
        concatenated = {k: list(itertools.chain(*examples[k])) for k in examples.keys()}
        total = (len(concatenated["input_ids"]) // INPUT_LENGTH) * INPUT_LENGTH
        result = {k: [t[i:i + INPUT_LENGTH] for i in range(0, total, INPUT_LENGTH)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    blocks = tokenized.map(group_texts, batched=True, keep_in_memory=True)
    n = len(blocks)
    seconds = time.perf_counter() - began
    print(json.dumps({"tokens_per_second": n * INPUT_LENGTH / seconds, "blocks": n, "seconds": seconds}))


def input_pipeline(a):
    import numpy as np

    pack = load(os.path.join(EXAMPLES, "pack.py"), "pack")
    reference, counts = pack.pack(DOCS, "train", INPUT_LENGTH)
    ours, theirs, equal = [], [], None
    for r in range(a.runs):
        with tempfile.TemporaryDirectory() as d:
            summary = os.path.join(d, "s.json")
            cmd = [os.path.join(TARGET, "trainerd"), "data", "read", "--plugin", os.path.join(TARGET, "libpython_model.so"),
                   "--plugin-arg", f"module={MODULE}", "--plugin-arg", "input=text", "--plugin-arg",
                   f"context={INPUT_LENGTH}", "--plugin-arg", "vocab=8192", "--data", DOCS, "--loader-threads", "1",
                   "--batch-size", "8", "--data-cache", os.path.join(d, "cache"), "--summary", summary]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"trainerd data read failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            s = json.load(open(summary))
            ours.append(s["tokens_per_second"])
            (tokens,) = glob.glob(os.path.join(d, "cache", "tokens", "*.tokens"))
            stream = np.fromfile(tokens, dtype="<u4")
            n = stream.size // INPUT_LENGTH
            equal = n == reference.shape[0] and stream[: n * INPUT_LENGTH].tobytes() == reference.tobytes()
            env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            q = subprocess.run([sys.executable, os.path.abspath(__file__), "--recipe", "--cache", os.path.join(d, "hf")],
                               capture_output=True, text=True, env=env)
            if q.returncode != 0:
                raise SystemExit(f"the datasets recipe failed:\n{q.stderr[-3000:]}")
            theirs.append(json.loads(q.stdout.strip().splitlines()[-1])["tokens_per_second"])
        print(f"  run {r + 1}: trainerd {ours[-1]:,.0f} tokens/s ({s['pack_seconds']:.2f} s tokenizing and packing, "
              f"{s['seconds']:.2f} s in all), datasets recipe {theirs[-1]:,.0f} tokens/s", flush=True)
    o, t = statistics.median(ours), statistics.median(theirs)
    print(f"\nInput, raw text to packed blocks of {INPUT_LENGTH}, 1 loader thread: {counts['documents']} documents "
          f"({counts['empty']} empty), {counts['tokens']:,} tokens, 8,192-id BPE, median of {a.runs}")
    print("| | tokens/s | vs the recipe |")
    print("| --- | --- | --- |")
    print(f"| trainerd (data read: tokenize, pack, read every block) | {o:,.0f} | {o / t:.2f}x (goal >= 2x: "
          f"{'met' if o / t >= 2 else 'NOT met'}) |")
    print(f"| datasets map(tokenize) + group_texts | {t:,.0f} | 1.00x |")
    print(f"trainerd's {reference.shape[0]} blocks equal pack.py's byte for byte: {'yes' if equal else 'NO'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3, help="of the training runs")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="steps every rate leaves out")
    ap.add_argument("--only", choices=["train", "input"])
    ap.add_argument("--bucket-mb", type=float, help="trainerd's --bucket-mb (default: its own, 25: one bucket here)")
    ap.add_argument("--peer", choices=["ddp", "eager"], help=argparse.SUPPRESS)
    ap.add_argument("--order", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer_main(a)
    if a.recipe:
        return recipe_main(a)
    ensure_data()
    print(f"binaries {TARGET}", flush=True)
    if a.only != "input":
        training(a)
    if a.only != "train":
        input_pipeline(a)


if __name__ == "__main__":
    main()
